"""The FlashAttention-3 provider's batched layout for equal-length batches, against the fake
FA3 builds on the CPU (tests/fakes/fa3: `mha_fwd`'s batched branch written from
flash_api.cpp 758-892, its checks and its [B, H, S] lse).

A batch of B >= 2 sequences that all have S queries and S keys reaches FA3 as [B, S, H, D] views
with no offsets and no scheduler metadata (the provider's module doc); every other batch
keeps the varlen call. What the real kernel adds (its tile scheduler, the speed) is
measured on the H200 (benchmarks/fa3_batched.py; tests/gpu/test_flash_attn_gpu.py runs the
same batches through the real FA3).
"""

from __future__ import annotations

import pytest
import torch

import mla_plugins
from mla_plugins.core.kernels import flash_attn
from mla_plugins.core.reference import reference_attention
from tests.core.test_flash_attn import builds, on_cpu  # noqa: F401  (fixtures)
from tests.fakes.fa3 import kernel as fake
from tests.fakes.fa3.harness import NAMESPACE, batch, check, run, schema_names
from tests.fakes.fa3.harness import SCHEMA as FWD_SCHEMA

E4M3 = torch.float8_e4m3fn
BUILDS = ["fa3_fwd", "flash_attn_3", "sgl_kernel", "vllm"]


def _last_call(name: str) -> dict:
    return dict(zip(schema_names(FWD_SCHEMA[name]), fake.CALLS[NAMESPACE[name]][-1], strict=True))


@pytest.mark.parametrize("cu, expected", [
    (([0, 4, 8, 12], [0, 4, 8, 12]), (3, 4)),
    (([0, 7], [0, 7]), None),           # one sequence keeps varlen
    (([0, 4, 8], [0, 4, 9]), None),     # one sequence with a key more
    (([0, 4, 8], [0, 8, 16]), None),    # keys past the queries (a cached prefix)
    (([0, 4, 7], [0, 4, 7]), None),     # unequal lengths
    (([0, 0, 0], [0, 0, 0]), None),     # no rows
    (([0], [0]), None),
    (([2, 6], [2, 6]), None),           # not from row 0
])
def test_equal_lengths(cu, expected):
    assert flash_attn.equal_lengths(cu) == expected


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_equal_lengths_reach_fa3_batched(builds, on_cpu, name, fp8):  # noqa: F811
    """[B, S, H, D] views of the caller's tensors (no copy), no offsets, no maxima, no
    scheduler metadata, descales [B, H]; out and lse against float64."""
    builds(name, capability=(9, 0))
    lens = [(6, 6)] * 3
    q, k, v, cq, ck = batch(lens, 3, seed=600 + fp8)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False, namespace=NAMESPACE[name])
    a = _last_call(name)
    assert a["cu_seqlens_q"] is None and a["cu_seqlens_k"] is None, "equal lengths: no offsets"
    assert a["max_seqlen_q"] is None and a["max_seqlen_k"] is None
    assert a.get("scheduler_metadata") is None, "no varlen metadata for the batched layout"
    assert tuple(a["q"].shape) == (3, 6, 3, 192) and tuple(a["v"].shape) == (3, 6, 3, 128)
    assert tuple(a["out"].shape) == (3, 6, 3, 128)
    assert a["out"].data_ptr() == out.data_ptr(), "FA3 must write the caller's out through a view"
    if fp8:
        for d in ("q_descale", "k_descale", "v_descale"):
            assert tuple(a[d].shape) == (3, 3), (d, a[d].shape)
        ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck),
                                               fp8_dtype=E4M3, fp8_per_sequence=True)
        check(out, lse, ref_out, ref_lse, 5e-3, f"{name} fp8 batched vs quantized float64")
    else:
        assert a["q"].data_ptr() == q.data_ptr(), "bf16: FA3 reads the caller's q through a view"
        ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck))
        check(out, lse, ref_out, ref_lse, 1e-2, f"{name} bf16 batched")


@pytest.mark.parametrize("lens", [[(5, 5)] * 4, [(9, 9)] * 3, [(3, 3)] * 2],
                         ids=["B4-S5", "B3-S9", "B2-S3"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_batched_equals_varlen(builds, on_cpu, monkeypatch, lens, causal, fp8):  # noqa: F811
    """The same batch through the batched layout and through the varlen call: out and lse
    equal bit for bit (the fake computes both in float64 from the same rows), lse in the
    caller's [total_q, H] in both, from `run` (lse into the caller's buffer) and from
    `run_with_lse` (mla_prefill's return_lse)."""
    builds("fa3_fwd")
    q, k, v, cq, ck = batch(lens, 2, seed=610 + causal + 2 * fp8)
    got = {}
    for batched in (True, False):
        monkeypatch.setattr(flash_attn, "UNIFORM_BATCHED", batched)
        out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False, causal=causal, namespace="fa3_fwd")
        assert (_last_call("fa3_fwd")["cu_seqlens_q"] is None) == batched
        # the copying path (a caller's lse buffer, `FlashAttnKernel.run`), on a fresh plan
        plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, causal=causal, device="cpu",
                                        fp8=fp8, kernel="flash_attn")
        inputs = mla_plugins.core.api._prefill_inputs(q, k, v, None, None, None, causal, fp8,
                                                      plan, False)
        out2 = torch.full_like(out, float("nan"))
        lse2 = torch.full((q.shape[0], 2), float("nan"))
        flash_attn.FlashAttnKernel().run(inputs, plan, out2, lse2)
        assert torch.equal(out2, out) and torch.equal(lse2, lse), "run() and run_with_lse differ"
        # mla_prefill(lse=...): a caller's buffer, dense (SGLang's) or [H, T] seen as [T, H]
        for buf in (torch.full((q.shape[0], 2), float("nan")),
                    torch.full((2, q.shape[0]), float("nan")).t()):
            _, lse3 = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=fp8,
                                              fp8_rotate=False, causal=causal, return_lse=True,
                                              lse=buf)
            assert lse3 is buf and torch.equal(buf, lse), "lse= differs from run_with_lse"
        got[batched] = (out, lse)
    assert torch.equal(got[True][0], got[False][0]), "out: batched layout differs from varlen"
    assert torch.equal(got[True][1], got[False][1]), "lse: batched layout differs from varlen"
    for batched, (_, lse) in got.items():
        # [total_q, H] over an [H, total_q] buffer both ways: vLLM's lse.t() copies nothing
        assert lse.shape == (q.shape[0], 2) and lse.t().is_contiguous(), batched


@pytest.mark.parametrize("lens", [[(5, 5), (4, 4)], [(4, 8), (4, 8)], [(4, 4), (0, 0)], [(6, 6)]],
                         ids=["unequal", "cached-prefix", "empty-sequence", "one-sequence"])
def test_other_batches_keep_varlen(builds, on_cpu, lens):  # noqa: F811
    builds("fa3_fwd")
    q, k, v, cq, ck = batch(lens, 2, seed=630)
    out, lse = run(q, k, v, cq, ck, fp8=False, namespace="fa3_fwd")
    assert _last_call("fa3_fwd")["cu_seqlens_q"] is not None
    ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck))
    check(out, lse, ref_out, ref_lse, 1e-2, "varlen")


def test_doctor_says_equal_lengths_run_batched(builds):  # noqa: F811
    builds("fa3_fwd")
    assert "equal-length batches in FA3's batched layout" in flash_attn.binding().describe()


def test_fake_batched_layout_checks_shapes(builds):  # noqa: F811
    """The fake's batched branch refuses what mha_fwd refuses (flash_api.cpp 807-823, 866-870):
    a test against it can fail."""
    builds("fa3_fwd")
    b = flash_attn.binding()
    q = torch.randn(2, 4, 1, 192).bfloat16()
    k = torch.randn(2, 5, 1, 192).bfloat16()
    v = torch.randn(2, 4, 1, 128).bfloat16()  # seqlen 4, k's 5
    with pytest.raises(RuntimeError, match="v must have shape"):
        flash_attn._call(b, q, k, v, None, None, None, None, None, None, 0.1, True)
    out = torch.empty(8, 1, 128).bfloat16()  # varlen-shaped out for a batched call
    with pytest.raises(RuntimeError, match="out must have shape"):
        flash_attn._call(b, q, k, k[..., :128], out, None, None, None, None, None, 0.1, True)
