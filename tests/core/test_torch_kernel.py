"""The torch kernel against the float64 reference, through the public `mla_prefill`."""

from __future__ import annotations

import pytest
import torch

import mla_plugins
from mla_plugins.core.reference import reference_attention, relative_error
from tests.core.helpers import BF16_TOL, FP8_TOL, poisoned, random_batch
from tests.core.helpers import LENGTH_CASES as CASES
from tests.core.helpers import check_attention as check


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_matches_float64(case, heads, causal, fp8):
    lens_q, lens_k = CASES[case]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads)
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, causal=causal)
    out = poisoned((q.shape[0], heads, 128), q.dtype)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, causal=causal, num_workers=5)
    result, lse = mla_plugins.mla_prefill(
        q, k, v, cq, ck, causal=causal, fp8=fp8, out=out, return_lse=True, plan=plan, kernel="torch"
    )
    assert result is out
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_large_inputs_fp8_no_overflow(fp8):
    """Inputs scaled by 1e3 (logits kept comparable by the softmax scale): dynamic per-tensor
    scales make fp8 scale-invariant, where unit scales would saturate at 448."""
    q, k, v, cq, ck = random_batch([300, 40], [300, 90], 4, scale=1e3)
    scale = 192**-0.5 / 1e6
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, softmax_scale=scale)
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, softmax_scale=scale, fp8=fp8, return_lse=True,
                                       kernel="torch")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


def test_large_inputs_default_scale():
    """1e3-scaled inputs at the model's own softmax scale: near one-hot rows, still no NaN/inf."""
    q, k, v, cq, ck = random_batch([257], [257], 2, scale=1e3)
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck)
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, return_lse=True, kernel="torch")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert relative_error(lse, ref_lse) <= FP8_TOL


def test_fp16_and_softmax_scale():
    q, k, v, cq, ck = random_batch([100, 3], [150, 3], 2, dtype=torch.float16)
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, softmax_scale=0.05)
    out = mla_plugins.mla_prefill(q, k, v, cq, ck, softmax_scale=0.05, fp8=False, kernel="torch")
    assert out.dtype == torch.float16
    assert relative_error(out, ref_out) <= BF16_TOL


def test_128_heads_default_plan():
    q, k, v, cq, ck = random_batch([257, 64], [300, 64], 128, seed=3)
    ref_out, _ = reference_attention(q, k, v, cq, ck)
    out = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False)
    assert relative_error(out, ref_out) <= BF16_TOL


def test_non_contiguous_inputs():
    """vLLM hands over k as a cat of nope/rope views and v sliced out of kv: strided views work."""
    q, k, v, cq, ck = random_batch([130], [130], 4)
    wide = torch.cat([k, v], dim=-1)  # [T, H, 320]
    k_view, v_view = wide[..., :192], wide[..., 192:]
    ref_out, _ = reference_attention(q, k, v, cq, ck)
    out = mla_plugins.mla_prefill(q, k_view, v_view, cq, ck, fp8=False)
    assert relative_error(out, ref_out) <= BF16_TOL


def test_return_without_lse_and_trace(tmp_path, monkeypatch):
    import json
    import os

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MLA_PLUGINS_TRACE", str(trace))
    q, k, v, cq, ck = random_batch([5, 7], [9, 7], 2)
    with mla_plugins.trace_context("test", "unit"):
        out = mla_plugins.mla_prefill(q, k, v, cq, ck)
    mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False)
    assert isinstance(out, torch.Tensor)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0] == {"framework": "test", "entry": "unit", "kernel": "torch", "fp8": True,
                        "q_tokens": 12, "k_tokens": 16, "heads": 2, "pid": os.getpid()}
    assert lines[1]["framework"] == "direct" and lines[1]["fp8"] is False
