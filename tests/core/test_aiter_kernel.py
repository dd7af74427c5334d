"""The AITER provider's capability checks, as on a ROCm machine (arch and AITER status faked).

Only the declared capabilities are exercised: the asm kernel itself needs a gfx950 GPU.
"""

from __future__ import annotations

import pytest
import torch

from mla_plugins.core import aiter as aiter_binding
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


@pytest.mark.parametrize("heads,padded", [(1, 1), (3, 4), (12, 16), (16, 16), (20, 32), (100, 128), (128, 128), (129, None)])
def test_head_padding(rocm, heads, padded):
    assert padded_heads(heads) == padded
    assert (AiterKernel().not_supported_reasons(config(heads=heads)) == []) == (padded is not None)


def reduce_inputs(heads, dv, dtype=torch.bfloat16):
    return ReduceInputs(torch.empty(0, heads, dv), torch.empty(0, heads), torch.zeros(1, dtype=torch.int32),
                        None, torch.zeros(0, dtype=torch.int32), 256, 0,
                        torch.empty(4, heads, dv, dtype=dtype), None)


@pytest.mark.parametrize("heads,dv,ok", [(16, 128, True), (12, 128, False), (48, 512, True), (10, 512, False)])
def test_reduce_router(rocm, heads, dv, ok):
    """The reduce alone is not padded: it takes exactly the router's (H, Dv) pairs."""
    reasons = AiterKernel().not_supported_reasons(reduce_inputs(heads, dv))
    assert (reasons == []) == ok, reasons


def test_unusable_aiter_reason_comes_first(monkeypatch):
    status = aiter_binding.AiterStatus(installed=False, reason="AITER is not installed; x")
    monkeypatch.setattr(aiter_kernel, "probe_aiter", lambda: status)
    assert AiterKernel().not_supported_reasons(config())[0] == "AITER is not installed; x"
