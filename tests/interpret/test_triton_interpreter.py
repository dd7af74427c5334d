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
from tests.core.helpers import BF16_TOL, cu_seqlens, poisoned, random_batch, vllm_v_view

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


@pytest.mark.parametrize("workers", [None, 5])
def test_lse_into_a_heads_first_buffer(workers):
    """`mla_prefill(lse=...)` with vLLM's layout ([H, total_q] seen as [total_q, H]): the
    attention's direct stores and the reduce's (split rows, workers 5) both write through
    the buffer's strides, every row (poisoned first), no copy made."""
    lens_q, lens_k = CASES["cached prefix"]
    heads = 2
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, dtype=torch.float16)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, dtype=torch.float16, fp8=False,
                                    tile_q=128, kv_granularity=64, num_workers=workers,
                                    kernel="triton")
    buf = poisoned((heads, q.shape[0]), torch.float32).t()
    out, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, return_lse=True, lse=buf,
                                       kernel="triton")
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, causal=True)
    assert lse is buf and not torch.isnan(buf).any()
    assert relative_error(out, ref_out) <= BF16_TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert relative_error(lse[finite], ref_lse[finite]) <= 1e-3


@pytest.mark.parametrize("layout", ["contiguous", "vllm-v-view", "padded-heads"])
def test_tma_loads_match_float64(layout, monkeypatch):
    """The descriptor path (forced: the interpreter runs TMA loads) on the layouts adapters
    pass: packed [T, H, D]; vLLM's v, a view with head stride 256; k and v with padded
    heads (head stride > width) and a row stride past the last head."""
    monkeypatch.setattr(triton_kernel, "_can_tma", lambda device: True)
    lens_q, lens_k = [1, 70, 130], [1, 200, 300]
    heads = 3
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, dtype=torch.float16)
    if layout == "vllm-v-view":
        v = vllm_v_view(v)
    elif layout == "padded-heads":
        kp = torch.randn(k.shape[0], heads, 192 + 64, dtype=k.dtype)
        kp = torch.cat((kp, torch.randn(k.shape[0], 1, 256, dtype=k.dtype)), dim=1)
        kp[:, :heads, :192] = k
        k = kp[:, :heads, :192]
        v = torch.cat((v, torch.randn_like(v)), dim=-1)[..., :128]
    assert triton_kernel._tma_ok(k, 192) and triton_kernel._tma_ok(v, 128), layout
    out = poisoned((q.shape[0], heads, 128), torch.float16)
    _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=True, fp8=False, out=out,
                                     return_lse=True, kernel="triton")
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, causal=True)
    assert relative_error(out, ref_out) <= BF16_TOL
    finite = torch.isfinite(ref_lse)
    assert relative_error(lse[finite], ref_lse[finite]) <= 1e-3


@pytest.mark.parametrize("permuted", [True, False], ids=["v-key-order-cuda", "v-key-order-rocm"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_path_matches_float64(case, causal, permuted, monkeypatch):
    """The fp8 path (block scales, in-kernel q cast, per-block k/v scales, transposed v with
    16-aligned sequence columns), its values stored in fp16: the interpreter has no fp8.
    Both key orders of the transposed v (triton_quant.permuted_v: CUDA's, ROCm's)."""
    from mla_plugins.core.kernels import triton_quant

    monkeypatch.setattr(triton_kernel, "_FP8_STORAGE", torch.float16)
    monkeypatch.setattr(triton_quant, "permuted_v", lambda device: permuted)
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


@pytest.mark.parametrize("layout", ["contiguous", "vllm-v-view"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointer-loads", "tma-loads"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_16bit_bad_values_stay_in_their_sequence(tma, bad, layout, monkeypatch):
    """A non-finite value in the first keys of one sequence leaves its neighbour untouched.

    A key block of the previous sequence's last rows reaches into those keys (TMA boxes are
    not cut at a sequence's end): masked scores are -inf, but p = 0 times an inf in v is
    NaN unless the rows past kv_end are zeroed. `tma` forces the descriptor path (the
    interpreter runs TMA loads; on the device only sm_90+ takes it). `vllm-v-view`: v as
    vLLM passes it, the [..., 128:] half of kv_b_proj's [T, H, 256] output (head stride 256).
    """
    if tma:
        monkeypatch.setattr(triton_kernel, "_can_tma", lambda device: True)
    lens_q, lens_k, heads = [100, 60, 70], [100, 130, 70], 2
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, dtype=torch.float16)
    if layout == "vllm-v-view":
        v = vllm_v_view(v)
    assert triton_kernel._tma_ok(v, 128) and triton_kernel._tma_ok(k, 192)
    k0, k1 = lens_k[0], lens_k[0] + lens_k[1]
    v[k0, 0, 5] = bad  # the first key of sequence 1, inside sequence 0's last key block
    k[k0 + 1, 1, 9] = bad
    v[k1 + 3, 1, 0] = bad  # and of sequence 2, inside sequence 1's
    bounds_q, bounds_k = cq.tolist(), ck.tolist()

    def run(q, k, v, cq, ck):
        out = poisoned((q.shape[0], heads, 128), torch.float16)
        _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=True, fp8=False, out=out,
                                         return_lse=True, kernel="triton")
        return out, lse

    def alone(b):
        qs, ks = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        return qs, run(q[qs], k[ks], v[ks], cu_seqlens([lens_q[b]]), cu_seqlens([lens_k[b]]))

    out, lse = run(q, k, v, cq, ck)
    qs, (out0, lse0) = alone(0)
    assert torch.isfinite(out[qs]).all()
    assert torch.equal(out[qs], out0) and torch.equal(lse[qs], lse0)
    # sequence 1 holds bad values of its own (head 0's v, head 1's k), which reach some of
    # its rows; sequence 2's must add none
    qs, (out1, _) = alone(1)
    assert torch.equal(out[qs].isnan(), out1.isnan())
    assert torch.equal(out[qs].nan_to_num(), out1.nan_to_num())
