"""The plan as the batch's authority (issue 11): host offsets, own copies, kernel choice,
workspace; calls given a plan never read the caller's offsets."""

from __future__ import annotations

import pytest
import torch

import mla_plugins
from mla_plugins.core import workspace as ws_mod
from mla_plugins.core.reference import reference_attention, relative_error
from tests.core.helpers import BF16_TOL, cu_seqlens, random_batch

LENS_Q, LENS_K = [300, 17, 0, 64], [310, 40, 5, 64]


def offsets(lens):
    return cu_seqlens(lens).tolist()


@pytest.mark.parametrize("form", ["list", "tuple", "cpu-int32", "cpu-int64"])
def test_host_offsets_give_the_same_plan(form):
    cq, ck = offsets(LENS_Q), offsets(LENS_K)
    make = {"list": list, "tuple": tuple,
            "cpu-int32": lambda x: torch.tensor(x, dtype=torch.int32),
            "cpu-int64": lambda x: torch.tensor(x, dtype=torch.int64)}[form]
    plan = mla_plugins.plan_prefill(make(cq), make(ck), num_heads=4, num_workers=6)
    ref = mla_plugins.plan_prefill(cu_seqlens(LENS_Q), cu_seqlens(LENS_K), num_heads=4, num_workers=6)
    assert torch.equal(plan.work_info, ref.work_info)
    assert plan.seqlens_host == (tuple(cq), tuple(ck))
    assert plan.cu_seqlens_q.tolist() == cq and plan.cu_seqlens_k.tolist() == ck
    assert plan.cu_seqlens_q.dtype == torch.int32 and plan.device == torch.device("cpu")
    assert plan.kernel == "torch"  # on a CPU, the automatic choice


def test_plan_owns_its_offsets_and_call_ignores_the_callers():
    """Edits the version counter never sees (numpy views, .data) cannot make a plan stale,
    and a call given a plan reads the plan's offsets, not the caller's."""
    q, k, v, cq, ck = random_batch(LENS_Q, LENS_K, 2)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, fp8=False)
    ref_out, ref_lse = reference_attention(q, k, v, cq.clone(), ck.clone())
    cq.numpy()[1] += 7  # no version bump
    ck.data[1] -= 3
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, plan=plan, return_lse=True)
    assert relative_error(out, ref_out) <= BF16_TOL
    out2 = mla_plugins.mla_prefill(q, k, v, plan=plan)  # offsets omitted
    assert torch.equal(out, out2)


class _Untouchable(torch.Tensor):
    """Offsets that raise on any host read."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"read the caller's offsets: {func}")


def test_call_with_plan_does_not_touch_given_offsets():
    q, k, v, cq, ck = random_batch([33, 70], [33, 90], 2)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, fp8=False)
    bad_q, bad_k = cq.as_subclass(_Untouchable), ck.as_subclass(_Untouchable)
    out = mla_plugins.mla_prefill(q, k, v, bad_q, bad_k, plan=plan)
    assert relative_error(out, reference_attention(q, k, v, cq, ck)[0]) <= BF16_TOL


def test_without_plan_offsets_are_required():
    q, k, v, _, _ = random_batch([5], [5], 1)
    with pytest.raises(TypeError, match="cu_seqlens_q, cu_seqlens_k: found None"):
        mla_plugins.mla_prefill(q, k, v)


def test_plan_modes_must_agree():
    q, k, v, cq, ck = random_batch([20, 9], [20, 30], 2)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, fp8=False)
    with pytest.raises(ValueError, match="fp8: found True, expected False like the plan"):
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=True)
    with pytest.raises(ValueError, match=r"plan: found \(total_q, total_k, num_heads, causal\)"):
        mla_plugins.mla_prefill(q, k, v, plan=plan, causal=False)
    with pytest.raises(TypeError, match="plan: found dict"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, plan={})
    # fp8 left open at planning: either mode runs
    open_plan = mla_plugins.plan_prefill(cq, ck, num_heads=2)
    assert open_plan.fp8 is None
    mla_plugins.mla_prefill(q, k, v, plan=open_plan, fp8=False)


def test_plan_request_arguments_are_checked():
    cq = offsets([4])
    with pytest.raises(TypeError, match="cu_seqlens_q: found str"):
        mla_plugins.plan_prefill("0,4", cq, num_heads=2)
    with pytest.raises(ValueError, match="cu_seqlens_k: found first offset 1"):
        mla_plugins.plan_prefill(cq, [1, 4], num_heads=2)
    with pytest.raises(TypeError, match="fp8: found int"):
        mla_plugins.plan_prefill(cq, cq, num_heads=2, fp8=1)
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="kernel='triton' cannot run"):
        mla_plugins.plan_prefill(cq, cq, num_heads=2, kernel="triton")


def test_workspace_given_or_shared():
    q, k, v, cq, ck = random_batch([300, 40], [700, 40], 3, dqk=24, dv=16)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=3, num_workers=6, head_dim_qk=24, head_dim_v=16,
                                    fp8=False)
    assert plan.num_partial_tiles > 0 and plan.workspace_bytes > 0
    ref = reference_attention(q, k, v, cq, ck)[0]
    mine = torch.empty(plan.workspace_bytes, dtype=torch.uint8)
    out = mla_plugins.mla_prefill(q, k, v, plan=plan, workspace=mine)
    assert relative_error(out, ref) <= BF16_TOL
    with pytest.raises(ValueError, match="workspace: found 10 bytes, expected at least"):
        mla_plugins.mla_prefill(q, k, v, plan=plan, workspace=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(TypeError, match="workspace: found torch.float32"):
        mla_plugins.mla_prefill(q, k, v, plan=plan, workspace=torch.empty(10))

    ws_mod.release()
    shared = ws_mod.get_workspace("cpu")
    out = mla_plugins.mla_prefill(q, k, v, plan=plan)
    assert relative_error(out, ref) <= BF16_TOL
    first, generation = shared.buffer, shared.generation
    for _ in range(3):  # reused, not reallocated, across calls ("layers")
        mla_plugins.mla_prefill(q, k, v, plan=plan)
    assert shared.buffer is first and shared.generation == generation
    # a larger need grows it; the plan then carves views of the new buffer
    shared.get(first.numel() * 2)
    assert shared.generation > generation and shared.buffer is not first
    out = mla_plugins.mla_prefill(q, k, v, plan=plan)
    assert relative_error(out, ref) <= BF16_TOL


def test_reserve_and_set_workspace():
    ws_mod.release()
    buf = ws_mod.reserve("cpu", 1 << 16)
    assert buf.numel() >= 1 << 16 and ws_mod.get_workspace("cpu").buffer is buf
    mine = torch.empty(1 << 12, dtype=torch.uint8)
    ws_mod.set_workspace("cpu", mine)
    assert ws_mod.get_workspace("cpu").get(100) is mine
    with pytest.raises(TypeError, match="expected a 1-D torch.uint8 tensor"):
        ws_mod.set_workspace("cpu", torch.empty(3))
    ws_mod.release()


def test_kernel_build_plan_hook_is_used():
    """plan_prefill asks the chosen kernel for the plan (AITER overrides build_plan)."""
    from mla_plugins.core.kernels.torch_kernel import TorchKernel

    calls = []
    original = TorchKernel.build_plan

    def spy(self, request):
        calls.append(request)
        return original(self, request)

    TorchKernel.build_plan = spy
    try:
        plan = mla_plugins.plan_prefill([0, 5], [0, 9], num_heads=2, kernel="torch", tile_q=16)
    finally:
        TorchKernel.build_plan = original
    assert len(calls) == 1 and calls[0].overrides == {"tile_q": 16} and calls[0].seqlens_host[1] == (0, 9)
    assert plan.tile_q == 16 and plan.kernel == "torch"


@pytest.fixture
def interpreter(monkeypatch):
    """TRITON_INTERPRET=1 with the Triton provider taken as installed (this env may lack it)."""
    from mla_plugins.core import registry
    from mla_plugins.core.kernels import triton_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MLA_PLUGINS_KERNEL", raising=False)
    monkeypatch.setattr(triton_kernel.TritonKernel, "environment_reasons", lambda self: [])
    registry.reset_registry()
    yield registry.get_registry()
    registry.reset_registry()


def test_auto_never_takes_triton_on_a_cpu(interpreter, monkeypatch):
    """Issue 13: under the interpreter the Triton kernel runs on a CPU, but only when pinned,
    and never in bf16 (the interpreter's bf16 gives garbage)."""
    from mla_plugins.core.kernels.base import ConfigInputs

    cpu = torch.device("cpu")
    fp16 = ConfigInputs(16, 192, 128, torch.float16, cpu, False)
    bf16 = ConfigInputs(16, 192, 128, torch.bfloat16, cpu, False)
    assert interpreter.select(fp16).name == "torch"
    assert interpreter.select(bf16).name == "torch"
    assert interpreter.select(fp16, "triton").name == "triton"
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="bfloat16 is refused under the Triton interpreter"):
        interpreter.select(bf16, "triton")
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "triton")
    assert interpreter.select(fp16).name == "triton"
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="MLA_PLUGINS_KERNEL='triton' cannot run"):
        interpreter.select(bf16)
    monkeypatch.delenv("MLA_PLUGINS_KERNEL")
    # plans follow the same rule
    assert mla_plugins.plan_prefill([0, 8], [0, 8], num_heads=16, dtype=torch.float16).kernel == "torch"
    assert mla_plugins.plan_prefill([0, 8], [0, 8], num_heads=16, dtype=torch.float16,
                                    kernel="triton").kernel == "triton"
    # what `mla-plugins check` / `doctor` print comes from here
    info = next(i for i in mla_plugins.available_kernels("cpu") if i.name == "triton")
    assert info.available and any("chosen only when pinned" in r for r in info.reasons)
    assert any("bfloat16 is refused" in r for r in info.reasons)
    reasons = interpreter.rejections(fp16)["triton"]
    assert reasons and "chosen only when pinned" in reasons[0]


def test_triton_off_the_interpreter_is_not_offered_on_a_cpu(monkeypatch):
    from mla_plugins.core import registry
    from mla_plugins.core.kernels import triton_kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernel.TritonKernel, "environment_reasons", lambda self: [])
    registry.reset_registry()
    try:
        info = next(i for i in mla_plugins.available_kernels("cpu") if i.name == "triton")
        assert not info.available and "device cpu not supported" in info.reasons[0]
    finally:
        registry.reset_registry()


def test_new_views_of_one_workspace_reuse_the_carving():
    """vLLM hands a fresh view of its workspace to every call: the plan's views are kept."""
    q, k, v, cq, ck = random_batch([300, 40], [700, 40], 3, dqk=24, dv=16)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=3, num_workers=6, head_dim_v=16, fp8=False)
    big = torch.empty(plan.workspace_bytes + 4096, dtype=torch.uint8)
    mla_plugins.mla_prefill(q, k, v, plan=plan, workspace=big[:plan.workspace_bytes + 512])
    token = plan.memo["scratch"][-1]
    out = mla_plugins.mla_prefill(q, k, v, plan=plan, workspace=big[:plan.workspace_bytes + 512])
    assert plan.memo["scratch"][-1] == token
    mla_plugins.mla_prefill(q, k, v, plan=plan, workspace=big[256:])  # other memory: carved anew
    assert plan.memo["scratch"][-1] != token
    assert relative_error(out, reference_attention(q, k, v, cq, ck)[0]) <= BF16_TOL
