"""The AITER provider's capability checks, as on a ROCm machine (arch and AITER status faked).

Only the declared capabilities are exercised: the asm kernel itself needs a gfx950 GPU.
"""

from __future__ import annotations

import pytest
import torch

from mla_plugins.core import aiter as aiter_binding
from mla_plugins.core import device
from mla_plugins.core.kernels import aiter_kernel, base
from mla_plugins.core.kernels.aiter_kernel import AiterKernel, padded_heads
from mla_plugins.core.kernels.base import ConfigInputs, ReduceInputs


@pytest.fixture
def rocm(monkeypatch):
    """Pretend: a ROCm device of a chosen arch, and a usable AITER with the FP8 prefill op."""
    state = {"arch": "gfx950"}
    status = aiter_binding.AiterStatus(installed=True, is_amd_aiter=True, reduce_convention="num_kv_splits",
                                       prefill_op=True, reason="fake")
    monkeypatch.setattr(aiter_kernel, "probe_aiter", lambda: status)
    monkeypatch.setattr(base, "device_kind", lambda device: "rocm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(aiter_kernel, "device_kind", lambda device: "rocm")
    monkeypatch.setattr(aiter_kernel, "device_arch", lambda device: state["arch"])
    return state


def config(heads=16, dqk=192, dv=128, dtype=torch.bfloat16, fp8=True):
    return ConfigInputs(heads, dqk, dv, dtype, torch.device("cpu"), fp8)


def test_supported_configuration(rocm):
    assert AiterKernel().not_supported_reasons(config()) == []


@pytest.mark.parametrize("kwargs,reason", [
    ({"fp8": False}, "fp8=False not supported"),
    ({"dqk": 128}, "query/key head dim 128 not supported"),
    ({"dv": 512}, "value head dim 512 not supported"),
    ({"dtype": torch.float16}, "dtype torch.float16 not supported"),
    ({"heads": 129}, "129 heads not supported"),
])
def test_rejections(rocm, kwargs, reason):
    reasons = AiterKernel().not_supported_reasons(config(**kwargs))
    assert any(reason in r for r in reasons), reasons


def test_arch(rocm):
    rocm["arch"] = "gfx942"
    reasons = AiterKernel().not_supported_reasons(config())
    assert reasons == ["arch gfx942 not supported (AITER's FP8 prefill exists for ['gfx950'] only)"]


@pytest.mark.parametrize("heads,padded", [(1, 1), (2, 16), (3, 16), (8, 16), (10, 16), (12, 16),
                                          (16, 16), (20, 32), (40, 64), (48, 64), (80, 128),
                                          (96, 128), (100, 128), (128, 128), (129, None)])
def test_head_padding(rocm, heads, padded):
    """1 or a multiple of 16 (what the asm kernel is known to take: vLLM pads to 16, SGLang
    saw 10 heads read out of bounds) that the v0.1.16 reduce router takes."""
    assert padded_heads(heads) == padded
    assert (AiterKernel().not_supported_reasons(config(heads=heads)) == []) == (padded is not None)


@pytest.mark.parametrize("heads,v0116,v0120", [(48, 64, 48), (80, 128, 96), (96, 128, 96),
                                               (33, 64, 48), (12, 16, 16)])
def test_head_padding_follows_the_router_of_the_release(heads, v0116, v0120):
    """AITER #4727 (v0.1.20) added 48 and 96 heads at Dv 128 to mla_reduce_v1's router."""
    old = aiter_binding.AiterStatus(installed=True, is_amd_aiter=True, version="0.1.16")
    new = aiter_binding.AiterStatus(installed=True, is_amd_aiter=True, version="0.1.22.post1")
    dev = aiter_binding.AiterStatus(installed=True, is_amd_aiter=True, version="0.1.14-rc0-265-gff61bb3")
    assert padded_heads(heads, old.reduce_router()) == v0116
    assert padded_heads(heads, new.reduce_router()) == v0120
    assert padded_heads(heads, dev.reduce_router()) == v0116  # older release: the smaller set
    assert padded_heads(heads, aiter_binding.AiterStatus(installed=True).reduce_router()) == v0116


def test_no_key_rows():
    cq, ck = (0, 5, 8, 8, 12), (0, 3, 3, 9, 9)
    assert aiter_kernel.no_key_rows(cq, ck, causal=True) == [(0, 2), (5, 8), (8, 12)]
    assert aiter_kernel.no_key_rows(cq, ck, causal=False) == [(5, 8), (8, 12)]


@pytest.mark.parametrize("version,name", [(90402, "gfx942"), (90500, "gfx950"), (90010, "gfx90a"),
                                          (110000, "gfx1100"), (100300, "gfx1030")])
def test_gfx_name_from_kfd_target_version(version, name):
    assert device._gfx_name(version) == name


def test_arch_from_kfd_sysfs_without_a_context(tmp_path, monkeypatch):
    """The arch comes from KFD's topology (no HIP context); CPU nodes report 0."""
    for node, version in (("0", 0), ("1", 90500), ("2", 90500), ("10", 90402)):
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(
            f"cpu_cores_count 0\ngfx_target_version {version}\nsimd_count 1024\n")
    assert device._kfd_archs(tmp_path) == ["gfx950", "gfx950", "gfx942"]
    monkeypatch.setattr(device, "_kfd_archs", lambda: ["gfx950", "gfx950", "gfx942"])
    monkeypatch.setattr(device, "_amdsmi_archs", lambda: [])
    monkeypatch.setattr(torch.version, "hip", "7.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a, **k: pytest.fail("created a HIP context"))
    for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    device.gcn_arch_no_context.cache_clear()
    device.gcn_arch.cache_clear()
    try:
        assert device.gcn_arch_no_context(2) == "gfx942"
        monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,0")
        device.gcn_arch_no_context.cache_clear()
        assert device.gcn_arch_no_context(0) == "gfx942"
        assert device.gcn_arch_no_context(1) == "gfx950"
        device.gcn_arch.cache_clear()
        assert device.gcn_arch(1) == "gfx950"
    finally:
        device.gcn_arch_no_context.cache_clear()
        device.gcn_arch.cache_clear()


def reduce_inputs(heads, dv, dtype=torch.bfloat16):
    return ReduceInputs(torch.empty(0, heads, dv), torch.empty(0, heads), torch.zeros(1, dtype=torch.int32),
                        None, torch.zeros(0, dtype=torch.int32), 256, 0,
                        torch.empty(4, heads, dv, dtype=dtype), None)


@pytest.mark.parametrize("heads,dv,ok", [(16, 128, True), (12, 128, False), (48, 512, True), (10, 512, False),
                                        (48, 128, False)])
def test_reduce_router(rocm, heads, dv, ok):
    """The reduce alone is not padded: it takes exactly the router's (H, Dv) pairs."""
    reasons = AiterKernel().not_supported_reasons(reduce_inputs(heads, dv))
    assert (reasons == []) == ok, reasons


def test_unusable_aiter_reason_comes_first(monkeypatch):
    status = aiter_binding.AiterStatus(installed=False, reason="AITER is not installed; x")
    monkeypatch.setattr(aiter_kernel, "probe_aiter", lambda: status)
    assert AiterKernel().not_supported_reasons(config())[0] == "AITER is not installed; x"
