"""The Triton kernels' logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Runs in CI, where no GPU exists: work items, causal bottom-right masks, splits, the lse of
every row, the reduce, and the fp8 path's block-scaling logic with fp16 storage. fp16
only: the interpreter mishandles bf16 loads and fp8 rounding (numpy has no such types),
so fp8 numerics and speed are covered by tests/gpu on the H200.
"""

from __future__ import annotations

import os

import pytest
import torch

import mla_plugins
from mla_plugins.core.kernels import triton_kernel
from mla_plugins.core.reference import reference_attention, relative_error
from tests.core.helpers import BF16_TOL, poisoned, random_batch

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="runs the Triton interpreter: set TRITON_INTERPRET=1 (nox -s triton)"),
]

CASES = {
    "edge lengths": ([0, 1, 127, 128, 129], [0, 1, 127, 128, 129]),
    "cached prefix": ([1, 70, 130], [1, 200, 300]),
    "no key for early rows": ([300, 5], [100, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("workers", [None, 5])
def test_prefill_matches_float64(case, causal, workers):
    lens_q, lens_k = CASES[case]
    heads = 2
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, dtype=torch.float16)
    plan = None
    if workers:
        plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, causal=causal, tile_q=128,
                                        kv_granularity=64, num_workers=workers)
    out = poisoned((q.shape[0], heads, 128), torch.float16)
    _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=causal, fp8=False, out=out,
                                     return_lse=True, plan=plan, kernel="triton")
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, causal=causal)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert relative_error(out, ref_out) <= BF16_TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (out[~finite] == 0).all()
    assert relative_error(lse[finite], ref_lse[finite]) <= 1e-3


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_path_matches_float64(case, causal, monkeypatch):
    """The fp8 path (block scales, in-kernel q cast, per-block k/v scales, transposed v with
    16-aligned sequence columns), its values stored in fp16: the interpreter has no fp8."""
    monkeypatch.setattr(triton_kernel, "_FP8_STORAGE", torch.float16)
    lens_q, lens_k = CASES[case]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 2, dtype=torch.float16, scale=4.0)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, causal=causal, tile_q=128,
                                    kv_granularity=128, num_workers=5)
    out = poisoned((q.shape[0], 2, 128), torch.float16)
    _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=causal, fp8=True, out=out,
                                     return_lse=True, plan=plan, kernel="triton")
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, causal=causal)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert relative_error(out, ref_out) <= BF16_TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert relative_error(lse[finite], ref_lse[finite]) <= 1e-3


def test_fp8_plan_must_align_with_scale_blocks():
    q, k, v, cq, ck = random_batch([100], [100], 2, dtype=torch.float16)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, tile_q=96, kv_granularity=64)
    with pytest.raises(ValueError, match="tile_q a multiple of 64 and kv_granularity a multiple of 128"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, plan=plan, kernel="triton")
    # tile_q fits, kv_granularity 64 splits a 128-key scale block: refused too
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, tile_q=64, kv_granularity=64)
    with pytest.raises(ValueError, match="kv_granularity=64 found"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, plan=plan, kernel="triton")


def test_reduce_matches_torch_reduce():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    heads, dv, tq = 2, 128, 16
    po = torch.randn(8 * tq, heads, dv, generator=gen)
    pl = torch.randn(8 * tq, heads, generator=gen)
    pl[torch.rand(8 * tq, heads, generator=gen) < 0.3] = float("-inf")
    pl[:tq] = float("-inf")  # a row group whose first piece saw nothing
    pl[5 * tq : 6 * tq] = float("-inf")
    args = (po, pl, torch.tensor([0, 2, 5, 5, 5], dtype=torch.int32),
            torch.tensor([[0, tq], [tq, 2 * tq - 3], [0, 0], [0, 0]], dtype=torch.int32),
            torch.tensor([0, 5 * tq, tq, 3 * tq, 7 * tq], dtype=torch.int32), tq, 0)
    outs = []
    for kernel in ("triton", "torch"):
        out = poisoned((2 * tq, heads, dv), torch.float16)
        lse = poisoned((2 * tq, heads), torch.float32)
        mla_plugins.mla_reduce(*args, out, lse, kernel=kernel)
        outs.append((out, lse))
    (o_t, l_t), (o_r, l_r) = outs
    written = ~torch.isnan(l_r)
    assert torch.equal(written, ~torch.isnan(l_t))
    assert torch.equal(torch.isinf(l_t[written]), torch.isinf(l_r[written]))
    fin = written & torch.isfinite(l_r)
    assert relative_error(o_t[written], o_r[written]) <= 1e-3
    assert relative_error(l_t[fin], l_r[fin]) <= 1e-5
