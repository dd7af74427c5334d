"""The planned call's fast path (`api._planned_call`): after one accepted call, the layers of
a batch skip the checks, so every argument that would fail them must miss the fast path
and fail as on the first call. Torch kernel, CPU."""

from __future__ import annotations

import json

import pytest
import torch

import mla_plugins
from mla_plugins.core import api
from mla_plugins.core.reference import reference_attention, relative_error
from tests.core.helpers import BF16_TOL, poisoned, random_batch

LENS_Q, LENS_K, H = [70, 130], [100, 130], 4


@pytest.fixture
def planned():
    q, k, v, cq, ck = random_batch(LENS_Q, LENS_K, H, seed=3)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=H, fp8=False)
    out = poisoned((q.shape[0], H, 128), q.dtype)
    mla_plugins.mla_prefill(q, k, v, plan=plan, out=out, fp8=False)  # accepted: memo made
    assert plan.memo.get("call") is not None
    return q, k, v, cq, ck, plan


def _fast_path_taken(monkeypatch):
    """Counts the calls that went past the fast path into the full checks."""
    seen = []
    full = api._prefill_inputs

    def counting(*args, **kwargs):
        seen.append(1)
        return full(*args, **kwargs)

    monkeypatch.setattr(api, "_prefill_inputs", counting)
    return seen


def test_layers_take_the_fast_path_and_match_float64(planned, monkeypatch):
    q, k, v, cq, ck, plan = planned
    full = _fast_path_taken(monkeypatch)
    for seed in range(3):  # new layers: fresh values, same layout
        q2, k2, v2, _, _ = random_batch(LENS_Q, LENS_K, H, seed=10 + seed)
        out = poisoned(q2.shape[:2] + (128,), q2.dtype)
        got = mla_plugins.mla_prefill(q2, k2, v2, plan=plan, out=out, fp8=False)
        ref, _ = reference_attention(q2, k2, v2, cq, ck, causal=True)
        assert got is out and relative_error(got, ref) <= BF16_TOL
    assert full == []


@pytest.mark.parametrize("case,error,match", [
    ("fewer q rows", ValueError, "plan: found"),
    ("more k rows", ValueError, "plan: found"),
    ("other heads", ValueError, "plan: found|heads"),
    ("fp16 q", TypeError, "k, v: found dtypes"),
    ("meta q", ValueError, "meta device"),
    ("causal=1", TypeError, "causal: found int"),
    ("fp8=True", ValueError, "fp8: found True"),
    ("return_lse=1", TypeError, "return_lse: found int"),
    ("scale True", TypeError, "softmax_scale: found bool"),
    ("scale nan", ValueError, "softmax_scale: found nan"),
    ("expanded out", ValueError, "stride 0"),
    ("short out", ValueError, "out: found"),
    ("fp16 out", ValueError, "out: found"),
    ("q list", TypeError, "q: found list"),
    ("lse without return_lse", ValueError, "lse: given with return_lse=False"),
    ("short lse", ValueError, "lse: found"),
    ("fp16 lse", TypeError, "lse: found dtype"),
    ("expanded lse", ValueError, "lse: found stride 0"),
])
def test_a_call_the_checks_refuse_is_refused_after_the_memo(planned, case, error, match):
    q, k, v, cq, ck, plan = planned
    kwargs = {"plan": plan, "fp8": False}
    out_shape = (q.shape[0], H, 128)
    if case == "fewer q rows":
        q = q[:-1]
    elif case == "more k rows":
        k, v = torch.cat([k, k[:1]]), torch.cat([v, v[:1]])
    elif case == "other heads":
        q, k, v = q[:, :2], k[:, :2], v[:, :2]
    elif case == "fp16 q":
        q = q.half()
    elif case == "meta q":
        q = q.to("meta")
    elif case == "causal=1":  # 1 == True: accept causal=True first
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, causal=True)
        kwargs["causal"] = 1
    elif case == "fp8=True":
        kwargs["fp8"] = True
    elif case == "return_lse=1":
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, return_lse=True)
        kwargs["return_lse"] = 1
    elif case == "scale True":  # True == 1: accept softmax_scale=1 first
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, softmax_scale=1)
        kwargs["softmax_scale"] = True
    elif case == "scale nan":
        kwargs["softmax_scale"] = float("nan")
    elif case == "expanded out":
        kwargs["out"] = torch.empty(1, H, 128, dtype=q.dtype).expand(*out_shape)
    elif case == "short out":
        kwargs["out"] = torch.empty(out_shape[0] - 1, H, 128, dtype=q.dtype)
    elif case == "fp16 out":
        kwargs["out"] = torch.empty(out_shape, dtype=torch.float16)
    elif case == "q list":
        q = q.tolist()
    elif case.endswith("lse"):  # accept a caller's lse first: the memo holds its layout
        lse = torch.empty(out_shape[:2])
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, return_lse=True, lse=lse)
        kwargs.update(return_lse=True, lse=lse)
        if case == "lse without return_lse":
            kwargs["return_lse"] = False
        elif case == "short lse":
            kwargs["lse"] = lse[1:]
        elif case == "fp16 lse":
            kwargs["lse"] = lse.half()
        else:
            kwargs["lse"] = torch.empty(1, H).expand(out_shape[:2])
    with pytest.raises(error, match=match):
        mla_plugins.mla_prefill(q, k, v, **kwargs)


def test_out_with_other_strides_is_checked_then_remembered(planned, monkeypatch):
    """A new out layout takes the full path once (its checks run), then the fast one."""
    q, k, v, cq, ck, plan = planned
    full = _fast_path_taken(monkeypatch)
    wide = poisoned((q.shape[0], H, 256), q.dtype)[..., :128]  # rows strided, features dense
    for _ in range(3):
        got = mla_plugins.mla_prefill(q, k, v, plan=plan, out=wide, fp8=False)
    ref, _ = reference_attention(q, k, v, cq, ck, causal=True)
    assert relative_error(got, ref) <= BF16_TOL and len(full) == 1


def test_lse_mode_and_trace_on_the_fast_path(planned, monkeypatch, tmp_path):
    q, k, v, cq, ck, plan = planned
    ref, ref_lse = reference_attention(q, k, v, cq, ck, causal=True)
    for _ in range(2):
        out, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, return_lse=True)
    assert relative_error(out, ref) <= BF16_TOL
    seen = torch.isfinite(ref_lse)
    assert (lse.double()[seen] - ref_lse[seen]).abs().max() <= 2e-3
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MLA_PLUGINS_TRACE", str(trace))  # set late: seen by the next call
    mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, return_lse=True)
    line = json.loads(trace.read_text())
    assert (line["q_tokens"], line["k_tokens"], line["heads"], line["fp8"]) == (200, 230, H, False)
    monkeypatch.delenv("MLA_PLUGINS_TRACE")
    mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, return_lse=True)
    assert len(trace.read_text().splitlines()) == 1


@pytest.mark.parametrize("layout", ["dense", "heads_first"])
def test_lse_into_the_callers_buffer(planned, monkeypatch, layout):
    """`lse=` (any strides: SGLang's dense [T, H], or vLLM's [H, T] seen as [T, H]) is written
    in place and returned, every row of it (poisoned first), on the full path then the fast
    one; the buffer's layout is part of what the memo compares."""
    q, k, v, cq, ck, plan = planned
    ref, ref_lse = reference_attention(q, k, v, cq, ck, causal=True)
    full = _fast_path_taken(monkeypatch)
    shape = (q.shape[0], H)
    for _ in range(3):
        lse = poisoned(shape if layout == "dense" else shape[::-1], torch.float32)
        lse = lse if layout == "dense" else lse.t()
        out, got = mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, return_lse=True, lse=lse)
        assert got is lse and not lse.isnan().any()
        assert relative_error(out, ref) <= BF16_TOL
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isinf(lse), ~seen)
        assert (lse.double()[seen] - ref_lse[seen]).abs().max() <= 2e-3
    assert len(full) == 1, "a new lse layout takes the full path once"


def test_lse_heads_first_names_the_plans_kernels_layout(planned):
    """The torch kernel writes [total_q, H] (a caller wanting [H, total_q] passes `lse=`); a
    non-plan argument is refused by name."""
    plan = planned[-1]
    assert plan.kernel == "torch" and mla_plugins.lse_heads_first(plan) is False
    with pytest.raises(TypeError, match="plan: found dict, expected a PrefillPlan"):
        mla_plugins.lse_heads_first({})


def test_a_kernel_named_per_call_is_selected_every_call(planned, monkeypatch):
    """Only kernel="auto" (the plan's kernel) is remembered: a named kernel keeps the
    registry's selection, and so its refusal."""
    q, k, v, cq, ck, plan = planned
    with pytest.raises(mla_plugins.KernelNotSupportedError):
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=False, kernel="aiter")
