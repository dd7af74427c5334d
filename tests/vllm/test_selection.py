"""Selecting our prefill backend by name: vLLM's CLI and Python config parsing, and vLLM's
own selection code of the CUDA and ROCm platforms, run on this CPU by patching device
properties (as vLLM's ROCm selection tests do)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mla_plugins.demo.tiny_model import build_tiny_deepseek_v2
from mla_plugins.vllm import register
from tests.fakes import gfx950

OURS = "MLAPluginsPrefillBackend"


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()


@pytest.mark.parametrize("argv", [
    ["--attention-config", '{"mla_prefill_backend": "MLA_PLUGINS"}'],
    ["--attention-config.mla_prefill_backend", "MLA_PLUGINS"],
    ["-ac", '{"mla_prefill_backend": "custom"}'],
])
def test_cli_arguments_parse_to_our_backend(argv):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", "unused", *argv]))
    cfg = engine_args.attention_config
    from vllm.config import AttentionConfig

    if not isinstance(cfg, AttentionConfig):
        cfg = AttentionConfig(**cfg)
    assert cfg.mla_prefill_backend.get_class().__name__ == OURS


@pytest.mark.parametrize("name", ["MLA_PLUGINS", "mla_plugins", "CUSTOM"])
def test_python_config_parses_to_our_backend(name):
    from vllm.config import AttentionConfig

    cfg = AttentionConfig(mla_prefill_backend=name)
    assert cfg.mla_prefill_backend.name == name.upper()
    assert cfg.mla_prefill_backend.get_class().__name__ == OURS


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from vllm.config import ModelConfig

    path = build_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny"))
    return ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16")


def _vllm_config(model_config, name):
    from vllm.config import AttentionConfig, VllmConfig

    return VllmConfig(model_config=model_config, attention_config=AttentionConfig(mla_prefill_backend=name))


@pytest.fixture(params=["cuda", "rocm"])
def gpu_platform(request, monkeypatch):
    """vLLM's CudaPlatform or RocmPlatform as current_platform, on a CPU-only torch."""
    import vllm.platforms
    from vllm.platforms.interface import DeviceCapability

    if request.param == "cuda":
        # the CPU wheel lacks the CUDA op library that vllm.platforms.cuda imports only to
        # register CUDA kernels; selection needs none of them
        monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
        from vllm.platforms.cuda import CudaPlatform as cls
        cap = (9, 0)
    else:
        # vllm.platforms.rocm reads the GCN arch at import: give it an MI355 (gfx950)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: gfx950.PROPS)
        # rocm.py imports the GPU op libraries for their side effects; this CPU wheel's vllm._C
        # is not for this CPU platform (it dies with SIGILL here), so stand in empty modules
        for name in gfx950.VLLM_GPU_LIBRARIES:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        from vllm.platforms.rocm import RocmPlatform as cls
        cap = (9, 5)
    monkeypatch.setattr(cls, "get_device_capability", classmethod(lambda c, device_id=0: DeviceCapability(*cap)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap)
    # on a GPU platform torch sees a GPU: the core answers "no cuda device visible" otherwise
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm.platforms, "_current_platform", cls())
    return cls


def test_gpu_platform_selection_accepts_our_backend(model_config, gpu_platform):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

    assert isinstance(current_platform, gpu_platform) and not current_platform.is_cpu()
    for name in ("MLA_PLUGINS", "CUSTOM"):
        assert get_mla_prefill_backend(_vllm_config(model_config, name)).__name__ == OURS


def test_gpu_platform_rejects_wrong_dimensions_with_our_reasons(model_config, gpu_platform, monkeypatch):
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

    cfg = _vllm_config(model_config, "MLA_PLUGINS")
    text = cfg.model_config.hf_text_config
    for attr in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        monkeypatch.setattr(text, attr, 0)  # what a non-MLA model's config gives
    with pytest.raises(ValueError, match="not valid for this configuration") as info:
        get_mla_prefill_backend(cfg)
    assert "Selected MLA prefill backend MLA_PLUGINS" in str(info.value)
    assert "mla-plugins: MLA dimensions" in str(info.value)


def test_cpu_platform_ignores_selection_unless_slot_taken(model_config):
    """vLLM's CPU platform always uses its CPU slot; MLA_PLUGINS_VLLM_OVERRIDE=CPU is the way in."""
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.mla.prefill.selector import _auto_select_mla_prefill_backend

    from mla_plugins.vllm.registration import _apply_overrides

    cfg = _vllm_config(model_config, "MLA_PLUGINS")
    _auto_select_mla_prefill_backend.cache_clear()
    assert get_mla_prefill_backend(cfg).__name__ == "CPUSDPAMLAPrefillBackend"
    try:
        assert _apply_overrides("CPU") == ["prefill slot CPU"]
        _auto_select_mla_prefill_backend.cache_clear()
        assert get_mla_prefill_backend(cfg).__name__ == OURS
    finally:
        MLAPrefillBackendEnum.CPU.clear_override()
        _auto_select_mla_prefill_backend.cache_clear()


def test_gpu_platform_refuses_when_only_the_torch_kernel_could_run(model_config, gpu_platform, monkeypatch):
    """No silent fallback to the reference kernel on a GPU: selection fails at start-up,
    naming the dimensions and what the fast kernels said; pinning torch is the way to want it."""
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

    from mla_plugins.core.kernels.triton_kernel import TritonKernel

    # the state of a GPU machine without triton, as TritonKernel reports it there
    monkeypatch.setattr(TritonKernel, "environment_reasons",
                        lambda self: ["triton is not installed (pip install 'mla-plugins[triton]')"])
    monkeypatch.setenv("MLA_PLUGINS_FP8", "0")
    cfg = _vllm_config(model_config, "MLA_PLUGINS")
    with pytest.raises(ValueError, match="not valid for this configuration") as info:
        get_mla_prefill_backend(cfg)
    text = str(info.value)
    assert "only the 'torch' reference kernel can run" in text
    assert "heads per rank, head dims qk 192 / v 128, bfloat16, no fp8" in text
    assert "triton: triton is not installed" in text and "aiter: " in text
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "torch")
    assert get_mla_prefill_backend(cfg).__name__ == OURS


@pytest.mark.parametrize("pin", ["aiter", "no_such_kernel"])
def test_gpu_platform_refuses_a_pinned_kernel_that_cannot_run(model_config, gpu_platform, monkeypatch, pin):
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

    monkeypatch.setenv("MLA_PLUGINS_KERNEL", pin)
    with pytest.raises(ValueError, match=f"MLA_PLUGINS_KERNEL='{pin}' cannot run"):
        get_mla_prefill_backend(_vllm_config(model_config, "MLA_PLUGINS"))
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "triton")
    assert get_mla_prefill_backend(_vllm_config(model_config, "MLA_PLUGINS")).__name__ == OURS


def test_gpu_platform_refuses_fp8_under_batch_invariance(model_config, gpu_platform, monkeypatch):
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("MLA_PLUGINS_FP8", "1")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT=1 with FP8 prefill"):
        get_mla_prefill_backend(_vllm_config(model_config, "MLA_PLUGINS"))
    monkeypatch.setenv("MLA_PLUGINS_FP8", "0")
    assert get_mla_prefill_backend(_vllm_config(model_config, "MLA_PLUGINS")).__name__ == OURS
