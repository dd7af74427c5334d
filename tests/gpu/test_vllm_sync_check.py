"""VLLM_GPU_SYNC_CHECK=error with vLLM's own checker, on the GPU machine where vLLM is absent.

vLLM 0.32's `vllm/utils/gpu_sync_debug.py` travels alone into `.vllm_sync/` at the repo root
(prepare it with the command in README.md's "GPU tests" notes or the report of issue 11:

    mkdir -p .vllm_sync && cp .nox/vllm/lib/python3.11/site-packages/vllm/utils/gpu_sync_debug.py .vllm_sync/

) and is loaded here with the two modules it imports replaced by stand-ins (`vllm.envs`
with VLLM_GPU_SYNC_CHECK="error", `vllm.platforms.current_platform` on a CUDA-alike
platform), registered in sys.modules for the test only. It is armed as vLLM's GPU worker
arms it after warm-up (`enable_gpu_sync_check()`, gpu_worker.py, end of compile_or_warm_up_model)
and the per-layer loop runs inside `with_gpu_sync_check`, the wrapper of vLLM's
`execute_model`: one plan per batch inside `gpu_sync_allowed()` (as mla_plugins/vllm/prefill.py
plans in prepare_metadata), then 61 planned calls. Negative controls: a `.item()` and a
non-blocking copy from pageable memory inside the checked region must raise.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import mla_plugins
from tests.core.helpers import poisoned, random_batch
from tests.gpu.test_serving import check, offsets

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / ".vllm_sync" / "gpu_sync_debug.py"
LAYERS = 61  # DeepSeek-V3 / Kimi-K2
LENS_Q, LENS_K, HEADS = [1, 200, 257, 70], [129, 700, 513, 70], 16


@pytest.fixture
def sync_debug(monkeypatch):
    """vLLM's gpu_sync_debug module, armed; every process-global patch undone afterwards."""
    if not SOURCE.is_file():
        pytest.skip(f"{SOURCE.relative_to(REPO)} absent: copy vLLM 0.32's vllm/utils/gpu_sync_debug.py "
                    "there before the device run (see this file's docstring)")
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_GPU_SYNC_CHECK = "error"
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cuda_alike=lambda: True)
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    vllm.envs, vllm.platforms = envs, platforms
    for name, module in (("vllm", vllm), ("vllm.envs", envs), ("vllm.platforms", platforms)):
        monkeypatch.setitem(sys.modules, name, module)
    # enable_gpu_sync_check patches these for the whole process
    for attr in ("to", "cuda", "copy_"):
        monkeypatch.setattr(torch.Tensor, attr, getattr(torch.Tensor, attr))
    from torch._inductor import cudagraph_trees
    from torch._inductor.fx_passes import joint_graph

    monkeypatch.setattr(cudagraph_trees, "cudagraphify", cudagraph_trees.cudagraphify)
    monkeypatch.setattr(joint_graph, "joint_graph_passes", joint_graph.joint_graph_passes)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    spec = importlib.util.spec_from_file_location("vllm.utils.gpu_sync_debug", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._SYNC_CHECK_MODE == "error"
    saved_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        module.enable_gpu_sync_check()
        try:
            yield module
        finally:
            torch.cuda.set_sync_debug_mode(saved_mode)


def _warm_up(device, fp8):
    """What vLLM's warm-up leaves behind before the gate flips: compiled kernels, a sized
    workspace (the adapter reserves it at construction)."""
    plan = mla_plugins.plan_prefill(offsets(LENS_Q), offsets(LENS_K), kernel="triton", num_heads=HEADS,
                                    device=device, fp8=fp8)
    mla_plugins.reserve_workspace(device, plan.workspace_bytes)
    q, k, v, _, _ = random_batch(LENS_Q, LENS_K, HEADS, device=device)
    for _ in range(2):
        mla_plugins.mla_prefill(q, k, v, plan=plan, return_lse=True)
    torch.cuda.synchronize()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_planned_layers_pass_vllms_sync_check(sync_debug, fp8, device):
    _warm_up(device, fp8)
    # distinct inputs per layer (cycled), made before the checked region: their H2D copies
    # from pageable memory would be flagged, rightly
    inputs = [random_batch(LENS_Q, LENS_K, HEADS, device=device)[:3] for _ in range(4)]
    outs = [poisoned((sum(LENS_Q), HEADS, 128), torch.bfloat16, device) for _ in range(LAYERS)]
    torch.cuda.synchronize()
    results = []

    @sync_debug.with_gpu_sync_check
    def execute_model():
        # prepare_metadata: the batch's plan from host offsets, its H2D copy allowed
        with sync_debug.gpu_sync_allowed():
            plan = mla_plugins.plan_prefill(offsets(LENS_Q), offsets(LENS_K), kernel="triton", num_heads=HEADS,
                                            device=device, fp8=fp8)
        for layer in range(LAYERS):
            q, k, v = inputs[layer % len(inputs)]
            out = outs[layer] if layer % 2 else None  # the adapter's out=, and none
            results.append(mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=fp8, out=out,
                                                   return_lse=True))
        return plan

    plan = execute_model()
    torch.cuda.synchronize()
    assert plan.memo.get("replay") is not None  # later layers replayed their launches
    for layer, (out, lse) in enumerate(results):
        if layer % 2:
            assert out.data_ptr() == outs[layer].data_ptr()
        if layer < 2 * len(inputs) or layer == LAYERS - 1:
            q, k, v = inputs[layer % len(inputs)]
            check(out, lse, q, k, v, plan, fp8)


def test_a_sync_in_the_checked_region_raises(sync_debug, device):
    """The negative control: the check this file relies on does fire on this machine."""
    x = torch.ones(4, device=device)

    @sync_debug.with_gpu_sync_check
    def reads_back():
        return x.sum().item()

    @sync_debug.with_gpu_sync_check
    def copies_from_pageable():
        return torch.ones(1 << 20).to(device, non_blocking=True)

    @sync_debug.with_gpu_sync_check
    def reads_back_allowed():
        with sync_debug.gpu_sync_allowed():
            return x.sum().item()

    with pytest.raises(RuntimeError, match="GPU<->CPU sync detected"):
        reads_back()
    with pytest.raises(RuntimeError, match="Implicit GPU<->CPU sync detected"):
        copies_from_pageable()
    assert reads_back_allowed() == 4.0
    assert x.sum().item() == 4.0  # outside a checked region nothing is policed
