"""Every validation error names the argument, what was found and what was expected."""

from __future__ import annotations

import pytest
import torch

import mla_plugins
from tests.core.helpers import cu_seqlens, random_batch


@pytest.fixture
def batch():
    return random_batch([5, 7], [9, 7], 2)


def call(batch, **changes):
    q, k, v, cq, ck = batch
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    kwargs = {key: changes.pop(key) for key in list(changes) if key not in args}
    args.update(changes)
    return mla_plugins.mla_prefill(*args.values(), **kwargs)


@pytest.mark.parametrize(
    "change,exc,pattern",
    [
        (lambda q, k, v, cq, ck: {"q": q[:, :, :1].squeeze(-1)}, ValueError, r"q: found shape .* expected 3-D"),
        (lambda q, k, v, cq, ck: {"q": q.float()}, TypeError, r"q: found dtype torch.float32, expected"),
        (lambda q, k, v, cq, ck: {"q": q.to(torch.float8_e4m3fn)}, TypeError, r"q: found dtype .*fp8=True quantizes"),
        (lambda q, k, v, cq, ck: {"k": k.half()}, TypeError, r"k, v: found dtypes torch.float16"),
        (lambda q, k, v, cq, ck: {"k": k[:, :1]}, ValueError, r"k, v: found 1 and 2 heads, expected 2"),
        (lambda q, k, v, cq, ck: {"k": k[..., :64]}, ValueError, r"k: found head dim 64, expected 192"),
        (lambda q, k, v, cq, ck: {"v": v[:3]}, ValueError, r"v: found 3 tokens, expected 16"),
        (lambda q, k, v, cq, ck: {"cu_seqlens_q": cq.long()}, TypeError, r"cu_seqlens_q: found dtype torch.int64, expected torch.int32"),
        (lambda q, k, v, cq, ck: {"cu_seqlens_k": ck[:2]}, ValueError, r"cu_seqlens_k: found shape \(2,\), expected \(3,\)"),
        (lambda q, k, v, cq, ck: {"cu_seqlens_q": torch.tensor([0, 9, 8], dtype=torch.int32)}, ValueError, r"cu_seqlens_q: found decreasing offsets 9 -> 8"),
        (lambda q, k, v, cq, ck: {"cu_seqlens_q": torch.tensor([1, 5, 12], dtype=torch.int32)}, ValueError, r"cu_seqlens_q: found first offset 1, expected 0"),
        (lambda q, k, v, cq, ck: {"cu_seqlens_q": cu_seqlens([5, 6])}, ValueError, r"cu_seqlens_q: found total 11, expected 12"),
        (lambda q, k, v, cq, ck: {"cu_seqlens_k": cu_seqlens([9, 8])}, ValueError, r"cu_seqlens_k: found total 17, expected 16"),
        (lambda q, k, v, cq, ck: {"cu_seqlens_k": ck.to("meta")}, ValueError, r"cu_seqlens_k: found device meta, expected cpu"),
        (lambda q, k, v, cq, ck: {"softmax_scale": -1.0}, ValueError, r"softmax_scale: found -1.0, expected a finite float > 0"),
        (lambda q, k, v, cq, ck: {"softmax_scale": "0.1"}, TypeError, r"softmax_scale: found str"),
        (lambda q, k, v, cq, ck: {"causal": 1}, TypeError, r"causal: found int, expected bool"),
        (lambda q, k, v, cq, ck: {"out": torch.empty(12, 2, 64, dtype=torch.bfloat16)}, ValueError, r"out: found \(12, 2, 64\)"),
        (lambda q, k, v, cq, ck: {"plan": mla_plugins.plan_prefill(cq, ck, num_heads=3)}, ValueError, r"plan: found \(total_q, total_k, num_heads, causal\)"),
        (lambda q, k, v, cq, ck: {"plan": "fast"}, TypeError, r"plan: found str, expected a PrefillPlan"),
        (lambda q, k, v, cq, ck: {"kernel": 3}, TypeError, r"kernel: found int, expected a kernel name"),
    ],
)
def test_prefill_errors_name_the_argument(batch, change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(batch, **change(*batch))


def reduce_args(**changes):
    args = dict(
        partial_out=torch.randn(64, 2, 128),
        partial_lse=torch.randn(64, 2),
        reduce_indptr=torch.tensor([0, 2], dtype=torch.int32),
        reduce_final_map=torch.tensor([[0, 32]], dtype=torch.int32),
        reduce_partial_map=torch.tensor([0, 32], dtype=torch.int32),
        tile_q=32,
        num_kv_splits=0,
        out=torch.empty(32, 2, 128, dtype=torch.bfloat16),
        final_lse=None,
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes,exc,pattern",
    [
        ({"num_kv_splits": -1}, ValueError, r"num_kv_splits: found -1, expected an int >= 0"),
        ({"num_kv_splits": 2.0}, TypeError, r"num_kv_splits: found float"),
        ({"partial_out": torch.randn(64, 2, 128).half()}, TypeError, r"partial_out: found dtype torch.float16, expected torch.float32"),
        ({"partial_lse": torch.randn(64, 3)}, ValueError, r"partial_lse: found \(64, 3\), expected \(64, 2\)"),
        ({"partial_out": torch.randn(64, 4, 128)}, ValueError, r"partial_out: found \(64, 4, 128\), expected \[P, 2, 128\]"),
        ({"reduce_indptr": torch.tensor([0, 2])}, TypeError, r"reduce_indptr: found dtype torch.int64"),
        ({"reduce_final_map": torch.tensor([[0, 32, 1]], dtype=torch.int32)}, ValueError, r"reduce_final_map: found \(1, 3\)"),
        ({"out": torch.empty(32, 2, 128)}, TypeError, r"out: found dtype torch.float32"),
        ({"final_lse": torch.empty(31, 2)}, ValueError, r"final_lse: found \(31, 2\), expected \(32, 2\)"),
        ({"tile_q": 0}, ValueError, r"tile_q: found 0, expected a positive int"),
        ({"partial_lse": torch.randn(64, 2, device="meta")}, ValueError, r"partial_lse: found device meta"),
    ],
)
def test_reduce_errors_name_the_argument(changes, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mla_plugins.mla_reduce(**reduce_args(**changes))


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"num_heads": 0}, r"num_heads: found 0, expected a positive int"),
        ({"num_heads": 2, "tile_q": 2.5}, r"tile_q: found float 2.5"),
        ({"num_heads": 2, "num_workers": -3}, r"num_workers: found -3"),
        ({"num_heads": 2, "kv_granularity": True}, r"kv_granularity: found bool"),
    ],
)
def test_plan_errors_name_the_argument(kwargs, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        mla_plugins.plan_prefill(cu_seqlens([4]), cu_seqlens([4]), **kwargs)


def test_settings_flags(monkeypatch):
    monkeypatch.delenv("MLA_PLUGINS_FP8", raising=False)
    assert mla_plugins.fp8_requested("fp8_e4m3") and not mla_plugins.fp8_requested("auto")
    assert not mla_plugins.fp8_requested(None)
    monkeypatch.setenv("MLA_PLUGINS_FP8", "1")
    assert mla_plugins.fp8_requested("auto")
    monkeypatch.setenv("MLA_PLUGINS_FP8", "0")
    assert not mla_plugins.fp8_requested("fp8")
    monkeypatch.setenv("MLA_PLUGINS_FP8", "maybe")  # warns (tests/core/test_hardening_env.py)
    assert mla_plugins.fp8_requested("fp8") and not mla_plugins.fp8_requested("auto")
    assert mla_plugins.shim_enabled()
    monkeypatch.setenv("MLA_PLUGINS_SHIM", "0")
    assert not mla_plugins.shim_enabled()
