"""Kernel registry: pluggy built-ins, entry-point plugins (faked importlib.metadata), dispatch."""

from __future__ import annotations

import logging
import types

import pytest
import torch

import mla_plugins
from mla_plugins.core import registry as registry_mod
from mla_plugins.core.kernels.base import ConfigInputs
from mla_plugins.core.kernels.torch_kernel import TorchKernel
from tests.core.helpers import random_batch


class CountingKernel(TorchKernel):
    """A third-party kernel: the torch math, CPU only, 4 heads only, counting its calls."""

    name = "thirdparty"
    priority = 50
    devices = frozenset({"cpu"})
    num_heads = frozenset({4})
    calls = 0

    def prefill(self, *args, **kwargs):
        type(self).calls += 1
        return super().prefill(*args, **kwargs)


plugin_module = types.ModuleType("thirdparty_mla_kernels")


@mla_plugins.hookimpl
def mla_plugins_kernels():
    return [CountingKernel()]


plugin_module.mla_plugins_kernels = mla_plugins_kernels


class FakeEntryPoint:
    def __init__(self, name, value, target=None, error=None):
        self.name, self.value, self.group = name, value, registry_mod.ENTRY_POINT_GROUP
        self._target, self._error = target, error

    def load(self):
        if self._error:
            raise self._error
        return self._target


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace importlib.metadata's entry_points as pluggy's own tests do; fresh registry."""
    eps = []

    def entry_points(*, group=None, **_):
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(registry_mod.importlib_metadata, "entry_points", entry_points)
    registry_mod.reset_registry()
    yield eps
    registry_mod.reset_registry()


def test_builtin_kernels_in_priority_order():
    names = [k.name for k in registry_mod.get_registry().kernels()]
    assert names[0] == "aiter" and names[-1] == "torch"
    assert {"aiter", "torch"} <= set(names)


def test_entry_point_kernel_is_discovered_and_chosen(fake_entry_points):
    fake_entry_points.append(FakeEntryPoint("thirdparty", "thirdparty_mla_kernels", plugin_module))
    names = [k.name for k in registry_mod.get_registry().kernels()]
    assert "thirdparty" in names and names.index("thirdparty") < names.index("torch")
    CountingKernel.calls = 0
    q, k, v, cq, ck = random_batch([40], [40], 4)
    mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False)  # auto: priority 50 beats torch
    assert CountingKernel.calls == 1
    q, k, v, cq, ck = random_batch([40], [40], 2)
    mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False)  # 2 heads: falls back silently
    assert CountingKernel.calls == 1


def test_broken_plugin_is_reported_not_raised(fake_entry_points, caplog):
    fake_entry_points.append(FakeEntryPoint("broken", "broken_mod", error=ImportError("no libfoo")))
    with caplog.at_level(logging.WARNING, logger="mla_plugins.registry"):
        reg = registry_mod.get_registry()
    assert reg.load_errors == {"broken": "ImportError: no libfoo"}
    assert "broken" in caplog.text and [k.name for k in reg.kernels()][-1] == "torch"


def test_pinned_kernel_lists_every_reason(fake_entry_points):
    fake_entry_points.append(FakeEntryPoint("thirdparty", "thirdparty_mla_kernels", plugin_module))
    q, k, v, cq, ck = random_batch([10], [10], 2, dtype=torch.float16)
    with pytest.raises(mla_plugins.KernelNotSupportedError) as err:
        mla_plugins.mla_prefill(q, k, v, cq, ck, kernel="thirdparty")
    assert "kernel='thirdparty'" in str(err.value) and "2 heads not supported" in str(err.value)
    with pytest.raises(mla_plugins.KernelNotSupportedError) as err:
        mla_plugins.mla_prefill(q, k, v, cq, ck, kernel="aiter")
    text = str(err.value)
    assert "AITER is not installed" in text and "device cpu not supported" in text
    assert "dtype torch.float16 not supported" in text


def test_env_pin_and_unknown_name(monkeypatch):
    q, k, v, cq, ck = random_batch([10], [10], 2)
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "aiter")
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="MLA_PLUGINS_KERNEL='aiter'"):
        mla_plugins.mla_prefill(q, k, v, cq, ck)
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "torch")
    mla_plugins.mla_prefill(q, k, v, cq, ck)
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="expected 'auto' or one of"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, kernel="nope")


def test_auto_logs_why_others_were_skipped(caplog):
    registry_mod.reset_registry()
    q, k, v, cq, ck = random_batch([10], [10], 2)
    with caplog.at_level(logging.INFO, logger="mla_plugins.registry"):
        mla_plugins.mla_prefill(q, k, v, cq, ck)
    assert "using kernel 'torch'" in caplog.text and "aiter:" in caplog.text


def test_available_kernels_and_config_reasons():
    infos = {i.name: i for i in mla_plugins.available_kernels("cpu")}
    assert infos["torch"].available and not infos["aiter"].available
    assert mla_plugins.unsupported_reasons(num_heads=16, qk_head_dim=192, v_head_dim=128,
                                           dtype=torch.bfloat16, device="cpu", fp8=True) == []
    reasons = mla_plugins.unsupported_reasons(num_heads=16, qk_head_dim=192, v_head_dim=128,
                                              dtype=torch.float32, device="cpu", fp8=True)
    assert any(r.startswith("torch: dtype torch.float32") for r in reasons)
    assert ConfigInputs(1, 2, 3, torch.bfloat16, torch.device("cpu"), False).op == "config"


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks about a GPU from a process without one")
def test_config_reasons_for_an_absent_gpu():
    """vLLM validates CUDA/ROCm configurations in processes that may see no GPU: no crash."""
    reasons = mla_plugins.unsupported_reasons(num_heads=16, qk_head_dim=192, v_head_dim=128,
                                              dtype=torch.bfloat16, device="cuda", fp8=True)
    assert any("no cuda device is visible" in r for r in reasons), reasons
