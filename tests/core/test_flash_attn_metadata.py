"""FA3's scheduler metadata through the flash_attn provider, against the fake builds (CPU).

Each fake build registers its real `get_scheduler_metadata` schema (tests/fakes/fa3/schemas.py)
and a body returning an int32 tensor of the size the real op returns; the fake forward applies
mha_fwd's checks on a `scheduler_metadata` it is given (device, size, contiguous, int32) and
refuses one made for other arguments than the call's, which the real kernel would schedule by
without a word (tests/fakes/fa3/kernel.py). What the GPU adds (the metadata's contents, the
prepare kernel it replaces, the time saved, CUDA-graph replay): tests/gpu/test_flash_attn_gpu.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

import mla_plugins
from mla_plugins.core.kernels import flash_attn
from mla_plugins.core.reference import reference_attention
from tests.core.test_flash_attn import LENS, builds, on_cpu  # noqa: F401  (fixtures)
from tests.fakes.fa3 import kernel as fake
from tests.fakes.fa3 import schemas
from tests.fakes.fa3.harness import NAMESPACE, batch, check, schema_names, usable

E4M3 = torch.float8_e4m3fn
BUILDS = ["fa3_fwd", "flash_attn_3", "sgl_kernel", "vllm"]
METADATA_SCHEMA = {"fa3_fwd": schemas.FA3_FWD_0_0_3_METADATA,
                   "flash_attn_3": schemas.FA3_HEAD_METADATA,
                   "sgl_kernel": schemas.SGL_KERNEL_0_4_10_METADATA,
                   "vllm": schemas.VLLM_FA3_METADATA}
FWD_SCHEMA = {"fa3_fwd": schemas.FA3_FWD_0_0_3, "flash_attn_3": schemas.FA3_HEAD,
              "sgl_kernel": schemas.SGL_KERNEL_0_4_10, "vllm": schemas.VLLM_FA3}


def _use(builds, name):  # noqa: F811 - the fixture, imported
    builds(name, capability=(9, 0))
    return usable(name)


def _fwd_metadata(namespace, call=-1):
    """The scheduler_metadata the fake forward got in call `call`."""
    names = [a.name for a in getattr(torch.ops, namespace).fwd.default._schema.arguments]
    return fake.CALLS[namespace][call][names.index("scheduler_metadata")]


def _metadata_args(namespace, call=-1) -> dict:
    names = [a.name for a in getattr(torch.ops, namespace).get_scheduler_metadata.default._schema.arguments]
    return dict(zip(names, fake.METADATA_CALLS[namespace][call], strict=True))


def _layers(q, k, v, cq, ck, plan, *, fp8, layers=3):
    """`layers` planned calls (a serving loop's), each checked against float64."""
    results = []
    for _ in range(layers):
        out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
        _, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=fp8,
                                         fp8_rotate=False if fp8 else None, out=out,
                                         return_lse=True)
        ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck),
                                               fp8_dtype=E4M3 if fp8 else None,
                                               fp8_per_sequence=True)
        check(out, lse, ref_out, ref_lse, 5e-3 if fp8 else 1e-2, f"fp8={fp8}")
        results.append((out, lse))
    return results


# -- binding ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDS)
def test_binds_each_builds_metadata_op_by_its_schema(builds, name):  # noqa: F811
    b = _use(builds, name)
    ns = NAMESPACE[name]
    assert b.metadata_op is getattr(torch.ops, ns).get_scheduler_metadata.default, b.describe()
    assert list(b.metadata_names) == schema_names(METADATA_SCHEMA[name]), b.metadata_names
    assert b.metadata_reason is None
    assert b.describe().endswith(
        f"op {ns}::fwd, equal-length batches in FA3's batched layout, scheduler metadata from "
        f"{ns}::get_scheduler_metadata once per plan and mode"), b.describe()
    # vLLM's fork has no attention_chunk in either op: bound by name, it is simply not passed
    assert ("attention_chunk" in b.metadata_names) == ("attention_chunk" in schema_names(FWD_SCHEMA[name]))


def test_absent_metadata_op_runs_without_it(builds, on_cpu):  # noqa: F811
    """A build registering no get_scheduler_metadata (FA3 before 2025-03): the forward alone."""
    builds("fa3_fwd")
    import fa3_fwd._C as lib

    fake.register(dataclasses.replace(lib.BUILD, metadata_schema=None))
    flash_attn.reset()
    b = usable("fa3_fwd")
    assert b.metadata_op is None
    assert b.metadata_reason == "fa3_fwd::get_scheduler_metadata is not registered"
    assert b.describe().endswith(
        "no scheduler metadata (fa3_fwd::get_scheduler_metadata is not registered)"), b.describe()
    q, k, v, cq, ck = batch(LENS, 2, seed=300)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=False, kernel="flash_attn")
    _layers(q, k, v, cq, ck, plan, fp8=False, layers=2)
    assert _fwd_metadata("fa3_fwd") is None and _fwd_metadata("fa3_fwd", -2) is None
    assert "fa3_fwd" not in fake.METADATA_CALLS


def test_unknown_metadata_schema_runs_without_it(builds, on_cpu):  # noqa: F811
    """A get_scheduler_metadata with an argument no release has: not guessed at."""
    builds("flash_attn_3")
    import flash_attn_3._C as lib

    fake.register(dataclasses.replace(lib.BUILD, metadata_schema=schemas.UNKNOWN_METADATA))
    flash_attn.reset()
    b = usable("flash_attn_3")
    assert b.metadata_op is None
    assert b.metadata_reason.startswith(
        "unknown get_scheduler_metadata schema (arguments this provider does not know: deterministic): "
        "flash_attn_3::get_scheduler_metadata(int batch_size"), b.metadata_reason
    assert "bool deterministic=False" in b.metadata_reason
    assert "no scheduler metadata (unknown get_scheduler_metadata schema" in b.describe()
    q, k, v, cq, ck = batch(LENS, 2, seed=301)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=True, kernel="flash_attn")
    _layers(q, k, v, cq, ck, plan, fp8=True, layers=2)
    assert _fwd_metadata("flash_attn_3") is None
    assert fake.METADATA_CALLS.get("flash_attn_3") == []


def test_metadata_op_missing_an_argument_runs_without_it(builds, on_cpu):  # noqa: F811
    builds("fa3_fwd")
    import fa3_fwd._C as lib

    schema = schemas.FA3_FWD_0_0_3_METADATA.replace("bool has_softcap = False,", "", 1)
    fake.register(dataclasses.replace(lib.BUILD, metadata_schema=schema))
    flash_attn.reset()
    b = usable("fa3_fwd")
    assert b.metadata_op is None and "no argument named has_softcap" in b.metadata_reason, b.metadata_reason


# -- made once per plan and mode, passed on every call --------------------------------------


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("name", BUILDS)
def test_made_once_per_plan_and_passed_on_every_call(builds, on_cpu, name, fp8):  # noqa: F811
    _use(builds, name)
    ns = NAMESPACE[name]
    q, k, v, cq, ck = batch(LENS, 3, seed=310)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=3, device="cpu", fp8=fp8, kernel="flash_attn")
    assert not fake.METADATA_CALLS.get(ns), "made at plan time: the first call makes it"
    calls = len(fake.CALLS.get(ns, []))
    _layers(q, k, v, cq, ck, plan, fp8=fp8, layers=4)
    assert len(fake.METADATA_CALLS[ns]) == 1, "one metadata per plan and mode, not per call"
    assert len(fake.CALLS[ns]) == calls + 4
    first = _fwd_metadata(ns)
    assert isinstance(first, torch.Tensor) and first.dtype == torch.int32
    for i in range(-4, 0):
        assert _fwd_metadata(ns, i) is first, f"call {i}: the plan's metadata, every call"
    made = _metadata_args(ns)
    assert made["qkv_dtype"] == (E4M3 if fp8 else torch.bfloat16)


@pytest.mark.parametrize("name", BUILDS)
def test_metadata_arguments_are_the_calls(builds, on_cpu, name):  # noqa: F811
    """Every argument the metadata was made with is what the forward call passed."""
    b = _use(builds, name)
    ns = NAMESPACE[name]
    q, k, v, cq, ck = batch(LENS, 2, seed=320)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=False, kernel="flash_attn")
    _layers(q, k, v, cq, ck, plan, fp8=False, layers=1)
    made = _metadata_args(ns)
    call = dict(zip(b.names, fake.CALLS[ns][-1], strict=True))
    assert made["batch_size"] == len(LENS) == call["cu_seqlens_q"].shape[0] - 1
    assert made["cu_seqlens_q"] is call["cu_seqlens_q"] and made["cu_seqlens_k"] is call["cu_seqlens_k"]
    assert made["seqused_k"].dtype == torch.int32
    assert made["seqused_k"].tolist() == [b_ - a for a, b_ in zip(ck, ck[1:], strict=False)]
    for arg in ("max_seqlen_q", "max_seqlen_k", "is_causal", "window_size_left",
                "window_size_right", "num_splits", "pack_gqa", "sm_margin"):
        assert made[arg] == call[arg], f"{arg}: metadata made with {made[arg]!r}, the call passes {call[arg]!r}"
    assert made["num_heads"] == made["num_heads_k"] == call["q"].shape[1] == 2
    assert (made["headdim"], made["headdim_v"]) == (call["q"].shape[2], call["v"].shape[2]) == (192, 128)
    assert made["qkv_dtype"] == call["q"].dtype
    assert made["has_softcap"] is (call["softcap"] != 0.0) is False
    assert made.get("attention_chunk", 0) == call.get("attention_chunk", 0) == 0
    for arg in ("cu_seqlens_k_new", "seqused_q", "leftpad_k", "page_size"):
        assert made[arg] is None, arg
    assert made["max_seqlen_k_new"] == 0


def test_each_mode_its_own_metadata(builds, on_cpu):  # noqa: F811
    """A plan for either mode: one metadata per mode (e4m3 changes FA3's tiles), each call
    passing its own mode's."""
    _use(builds, "fa3_fwd")
    q, k, v, cq, ck = batch(LENS, 2, seed=330)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", kernel="flash_attn")
    _layers(q, k, v, cq, ck, plan, fp8=False, layers=2)
    bf16 = _fwd_metadata("fa3_fwd")
    _layers(q, k, v, cq, ck, plan, fp8=True, layers=2)
    e4m3 = _fwd_metadata("fa3_fwd")
    _layers(q, k, v, cq, ck, plan, fp8=False, layers=1)
    assert _fwd_metadata("fa3_fwd") is bf16 and e4m3 is not bf16
    assert [m[7] for m in fake.METADATA_CALLS["fa3_fwd"]] == [torch.bfloat16, E4M3], "qkv_dtype per mode"


def test_another_plan_its_own_metadata(builds, on_cpu):  # noqa: F811
    _use(builds, "fa3_fwd")
    q, k, v, cq, ck = batch(LENS, 2, seed=335)
    plans = [mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=False,
                                      kernel="flash_attn") for _ in range(2)]
    for plan in plans:
        _layers(q, k, v, cq, ck, plan, fp8=False, layers=2)
    assert len(fake.METADATA_CALLS["fa3_fwd"]) == 2
    assert _fwd_metadata("fa3_fwd") is not _fwd_metadata("fa3_fwd", -3)


def test_batch_invariance_metadata_has_one_split(builds, on_cpu):  # noqa: F811
    """A plan asked for fixed workers (batch invariance) passes num_splits 1 to the forward
    and to the metadata alike."""
    _use(builds, "vllm")
    q, k, v, cq, ck = batch(LENS, 2, seed=340)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=False,
                                    kernel="flash_attn", num_workers=4)
    assert plan.memo["num_splits"] == 1
    _layers(q, k, v, cq, ck, plan, fp8=False, layers=2)
    call = dict(zip(flash_attn.binding().names, fake.CALLS["_vllm_fa3_C"][-1], strict=True))
    assert call["num_splits"] == 1 == _metadata_args("_vllm_fa3_C")["num_splits"]


def test_argument_list_holds_no_tensor_of_a_call(builds, on_cpu):  # noqa: F811
    """The per-plan argument list keeps no q, k, v or out alive between layers."""
    b = _use(builds, "fa3_fwd")
    q, k, v, cq, ck = batch(LENS, 2, seed=345)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=True, kernel="flash_attn")
    _layers(q, k, v, cq, ck, plan, fp8=True, layers=1)
    (call,) = plan.memo["fa3_calls"].values()
    base = dict(zip(b.names, call[1], strict=True))
    for arg in ("q", "k", "v", "out", "q_descale", "k_descale", "v_descale"):
        assert base[arg] is None, f"{arg} kept in the plan's argument list"
    assert base["scheduler_metadata"] is _fwd_metadata("fa3_fwd")


# -- CUDA graph capture: never made while capturing ------------------------------------------


def test_not_made_while_capturing(builds, on_cpu, monkeypatch):  # noqa: F811
    """A plan's first call inside a capture runs without metadata (FA3 schedules itself, as
    before); the next call outside one makes it; the capture's own calls never do."""
    _use(builds, "flash_attn_3")
    q, k, v, cq, ck = batch(LENS, 2, seed=350)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=True, kernel="flash_attn")
    seen = []
    monkeypatch.setattr(flash_attn, "_capturing", lambda device: seen.append(device) or True)
    _layers(q, k, v, cq, ck, plan, fp8=True, layers=2)
    assert seen, "the capture state must be asked before making the metadata"
    assert not fake.METADATA_CALLS.get("flash_attn_3"), "made while capturing"
    assert _fwd_metadata("flash_attn_3") is None and _fwd_metadata("flash_attn_3", -2) is None
    assert "fa3_seqused_k" not in plan.memo, "seqused_k launched while capturing"
    monkeypatch.setattr(flash_attn, "_capturing", lambda device: False)
    _layers(q, k, v, cq, ck, plan, fp8=True, layers=2)
    assert len(fake.METADATA_CALLS["flash_attn_3"]) == 1
    made = _fwd_metadata("flash_attn_3")
    assert made is not None and _fwd_metadata("flash_attn_3", -2) is made
    # made once: a later capture replays the calls with it, asking nothing
    seen.clear()
    monkeypatch.setattr(flash_attn, "_capturing", lambda device: seen.append(device) or True)
    _layers(q, k, v, cq, ck, plan, fp8=True, layers=1)
    assert _fwd_metadata("flash_attn_3") is made and not seen


def test_capture_check_asks_cuda_only_for_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert flash_attn._capturing(torch.device("cuda", 0))
    assert not flash_attn._capturing(torch.device("cpu"))


# -- plans with nothing to schedule ------------------------------------------------------------


@pytest.mark.parametrize("lens", [[(0, 4), (0, 3)], [(3, 0), (2, 0)], [(0, 0)]], ids=str)
def test_plans_without_rows_or_keys_make_none(builds, on_cpu, lens):  # noqa: F811
    _use(builds, "fa3_fwd")
    q, k, v, cq, ck = batch(lens, 2, seed=360)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=False, kernel="flash_attn")
    out, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=False,
                                       return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    assert not fake.METADATA_CALLS.get("fa3_fwd") and not fake.CALLS.get("fa3_fwd")
    assert "fa3_calls" not in plan.memo


def test_metadata_op_refusing_runs_without_it(builds, on_cpu, monkeypatch, caplog):  # noqa: F811
    """The build's metadata op raising (its own checks): a warning, the forward alone."""
    _use(builds, "sgl_kernel")

    def refuse(build, a):
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")

    monkeypatch.setattr(fake, "scheduler_metadata", refuse)
    q, k, v, cq, ck = batch(LENS, 2, seed=365)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", fp8=False, kernel="flash_attn")
    with caplog.at_level(logging.WARNING, logger="mla_plugins.core.kernels.flash_attn"):
        _layers(q, k, v, cq, ck, plan, fp8=False, layers=2)
    assert _fwd_metadata("sgl_kernel") is None and _fwd_metadata("sgl_kernel", -2) is None
    assert len(fake.METADATA_CALLS["sgl_kernel"]) == 1, "refused once, not asked again per call"
    (record,) = [r for r in caplog.records if "get_scheduler_metadata refused" in r.getMessage()]
    assert "sgl_kernel::get_scheduler_metadata refused" in record.getMessage()
    assert "Number of heads in key/value" in record.getMessage()


# -- the fakes: the real checks on a metadata, and what the real kernel would not check --------


def _forward_with(namespace, q, k, v, cq, ck, metadata, **kw):
    """The build's forward called as the provider calls it (every argument, by name)."""
    op = getattr(torch.ops, namespace).fwd.default
    cu_q, cu_k = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
    values = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
              "max_seqlen_q": max(b - a for a, b in zip(cq, cq[1:], strict=False)),
              "max_seqlen_k": max(b - a for a, b in zip(ck, ck[1:], strict=False)),
              "softmax_scale": 0.07, "is_causal": True, "window_size_left": -1,
              "window_size_right": -1, "attention_chunk": 0, "softcap": 0.0,
              "is_rotary_interleaved": False, "num_splits": 0, "sm_margin": 0, "cp_world_size": 1,
              "cp_rank": 0, "only_qv": False, "scheduler_metadata": metadata}
    values.update(kw)
    args = [values.get(a.name) for a in op._schema.arguments]
    return op(*args), (cu_q, cu_k, values)


def _make(namespace, cu_q, cu_k, values, **kw):
    op = getattr(torch.ops, namespace).get_scheduler_metadata.default
    q, v = values["q"], values["v"]
    made = {"batch_size": cu_q.shape[0] - 1, "max_seqlen_q": values["max_seqlen_q"],
            "max_seqlen_k": values["max_seqlen_k"], "num_heads": q.shape[1],
            "num_heads_k": values["k"].shape[1], "headdim": q.shape[2], "headdim_v": v.shape[2],
            "qkv_dtype": q.dtype, "seqused_k": cu_k[1:] - cu_k[:-1], "cu_seqlens_q": cu_q,
            "cu_seqlens_k": cu_k, "cu_seqlens_k_new": None, "seqused_q": None, "leftpad_k": None,
            "page_size": None, "max_seqlen_k_new": 0, "is_causal": values["is_causal"],
            "window_size_left": -1, "window_size_right": -1, "attention_chunk": 0,
            "has_softcap": False, "num_splits": values["num_splits"], "pack_gqa": None,
            "sm_margin": 0}
    made.update(kw)
    return op(*[made[a.name] for a in op._schema.arguments if a.name in made])


@pytest.mark.parametrize("name", BUILDS)
def test_fake_metadata_size_and_checks(builds, name):  # noqa: F811
    builds(name, capability=(9, 0))
    usable(name)  # imports the build (registers its ops)
    ns = NAMESPACE[name]
    lens = [(5, 5), (3, 9), (6, 2), (1, 1), (2, 4), (4, 4)]
    q, k, v, cq, ck = batch(lens, 2, seed=370)
    _, (cu_q, cu_k, values) = _forward_with(ns, q, k, v, cq, ck, None)
    good = _make(ns, cu_q, cu_k, values)
    # 6 sequences round to 8: FA3 1 + 8 * (semaphore-less vectors: 2 + sort + swizzle);
    # vLLM's fork 1 + 8 * (1 + swizzle) (no split at this size)
    assert good.shape == ((1 + 8 * 4,) if name != "vllm" else (1 + 8 * 2,)) and good.dtype == torch.int32
    _forward_with(ns, q, k, v, cq, ck, good)  # the same arguments: accepted
    noncausal = _make(ns, cu_q, cu_k, values, is_causal=False)
    assert noncausal.shape[0] == good.shape[0] - 8, "no head-swizzle vector without causal"
    with pytest.raises(RuntimeError, match=re.escape("scheduler_metadata must have shape (metadata_size)")):
        _forward_with(ns, q, k, v, cq, ck, noncausal)
    with pytest.raises(RuntimeError, match=re.escape("scheduler_metadata must have dtype int32")):
        _forward_with(ns, q, k, v, cq, ck, good.long())
    with pytest.raises(RuntimeError, match=re.escape("scheduler_metadata must be contiguous")):
        _forward_with(ns, q, k, v, cq, ck, torch.zeros(2 * good.shape[0], dtype=torch.int32)[::2])
    with pytest.raises(RuntimeError, match="was not made by this build's get_scheduler_metadata"):
        _forward_with(ns, q, k, v, cq, ck, torch.zeros_like(good))
    with pytest.raises(RuntimeError, match=re.escape("Number of heads in key/value must divide")):
        _make(ns, cu_q, cu_k, values, num_heads=3)
    with pytest.raises(RuntimeError, match=re.escape("expected scalar type Int but found Long")):
        _make(ns, cu_q, cu_k, values, seqused_k=(cu_k[1:] - cu_k[:-1]).long())


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("wrong", ["batch_size", "num_heads", "qkv_dtype", "num_splits",
                                   "max_seqlen_k", "seqused_k"])
def test_fake_refuses_a_metadata_made_for_other_arguments(builds, name, wrong):  # noqa: F811
    """Of the right size but made for another call: the real kernel would schedule by it
    without a check; the fake says which argument differs."""
    builds(name, capability=(9, 0))
    usable(name)
    ns = NAMESPACE[name]
    lens = [(5, 5), (3, 9), (6, 2), (1, 1), (2, 4), (4, 4)]
    q, k, v, cq, ck = batch(lens, 4, seed=380)
    _, (cu_q, cu_k, values) = _forward_with(ns, q, k, v, cq, ck, None)
    other = {
        # 5 sequences also round to 8: the real size check cannot tell
        "batch_size": {"batch_size": 5, "cu_seqlens_q": cu_q[:6], "seqused_k": (cu_k[1:] - cu_k[:-1])[:5]},
        "num_heads": {"num_heads": 2, "num_heads_k": 2},
        "qkv_dtype": {"qkv_dtype": E4M3},
        "num_splits": {"num_splits": 1},
        "max_seqlen_k": {"max_seqlen_k": values["max_seqlen_k"] + 128},
        "seqused_k": {"seqused_k": (cu_k[1:] - cu_k[:-1]) + 1},
    }[wrong]
    metadata = _make(ns, cu_q, cu_k, values, **other)
    field = "num_heads" if wrong == "num_heads" else "k_lens" if wrong == "seqused_k" else (
        "q_lens" if wrong == "batch_size" else wrong)
    with pytest.raises(RuntimeError, match=f"made for other arguments than this call's \\(.*{field}: made for"):
        _forward_with(ns, q, k, v, cq, ck, metadata)


def test_fake_vllm_size_follows_its_split_heuristic(builds):  # noqa: F811
    """vLLM's fork keeps a split vector only where the batch splits: metadata made with
    num_splits 1 for a call that lets FA3's heuristic split (one short query over 8192 keys,
    one head: 55 splits on 132 SMs) has the wrong size, as on the GPU."""
    builds("vllm", capability=(9, 0))
    usable("vllm")
    q, k, v, cq, ck = batch([(128, 8192)], 1, seed=390)
    _, (cu_q, cu_k, values) = _forward_with("_vllm_fa3_C", q, k, v, cq, ck, None, is_causal=False)
    assert fake._num_splits_heuristic(1, 132, 64, 1, 8192 * 320 * 2, False, 128) == 55
    split = _make("_vllm_fa3_C", cu_q, cu_k, values, is_causal=False)
    one = _make("_vllm_fa3_C", cu_q, cu_k, values, is_causal=False, num_splits=1)
    assert (split.shape[0], one.shape[0]) == (1 + 4 * 2, 1 + 4 * 1)
    with pytest.raises(RuntimeError, match=re.escape("scheduler_metadata must have shape (metadata_size)")):
        _forward_with("_vllm_fa3_C", q, k, v, cq, ck, one, is_causal=False)
    _forward_with("_vllm_fa3_C", q, k, v, cq, ck, split, is_causal=False)
