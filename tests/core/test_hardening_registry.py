"""Broken third-party kernel plugins (issue 14): each loses its own kernels, nothing else.

The plugins come in through faked entry points (the registry's real loading path), as a
hostile or buggy package on a user's machine would.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

import mla_plugins
from mla_plugins.core import registry as registry_mod
from mla_plugins.core.kernels.torch_kernel import TorchKernel
from tests.core.helpers import BF16_TOL, check_attention, random_batch
from tests.core.test_registry import FakeEntryPoint

CONFIG = dict(num_heads=4, qk_head_dim=192, v_head_dim=128, dtype=torch.bfloat16, device="cpu", fp8=False)


@pytest.fixture
def fake_entry_points(monkeypatch):
    """The registry's entry points replaced by a list the test fills; a fresh registry."""
    eps = []
    monkeypatch.setattr(
        registry_mod.importlib_metadata, "entry_points",
        lambda *, group=None, **_: [ep for ep in eps if ep.group == group],
    )
    registry_mod.reset_registry()
    yield eps
    registry_mod.reset_registry()


def plugin(name, hook):
    module = types.ModuleType(name)
    module.mla_plugins_kernels = mla_plugins.hookimpl(hook)
    return module


def install(eps, name, hook):
    eps.append(FakeEntryPoint(name, f"{name}_mod", plugin(name, hook)))


def assert_prefill_works():
    """The built-in torch kernel still runs a prefill, checked against float64."""
    from mla_plugins.core.reference import reference_attention

    q, k, v, cq, ck = random_batch([7, 30], [9, 30], 4)
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck)
    check_attention(out.float(), lse, ref_out.float(), ref_lse, BF16_TOL)
    assert mla_plugins.unsupported_reasons(**CONFIG) == []


class SpyTorch(TorchKernel):
    """An impostor named like a built-in: it must never run."""

    name = "torch"
    priority = 0
    ran = False

    def prefill(self, *args, **kwargs):
        type(self).ran = True
        raise AssertionError("the impostor ran")


class RaisingCheck(TorchKernel):
    name = "raising_check"
    priority = 1
    devices = frozenset({"cpu"})

    def not_supported_reasons(self, inputs):
        raise RuntimeError("capability probe exploded")


class BadAnswerCheck(TorchKernel):
    name = "bad_answer"
    priority = 2
    devices = frozenset({"cpu"})

    def not_supported_reasons(self, inputs):
        return "nope"  # a string, not a list of strings


class RaisingInfo(TorchKernel):
    name = "raising_info"
    priority = 3

    def info(self, device):
        raise OSError("driver gone")


def _raise():
    raise RuntimeError("hook exploded")


def _exit():
    raise SystemExit(3)


@pytest.mark.parametrize(
    "hook,reason",
    [
        (_raise, "RuntimeError: hook exploded"),
        (_exit, "SystemExit: 3"),
        (lambda: [None], "found NoneType None, expected an mla_plugins.Kernel"),
        (lambda: 42, "found int 42, expected a list"),
        (lambda: ["torch"], "found str 'torch', expected an mla_plugins.Kernel"),
    ],
    ids=["raises", "system-exit", "list-of-none", "int", "list-of-str"],
)
def test_a_broken_hook_loses_only_its_own_kernels(fake_entry_points, caplog, hook, reason):
    install(fake_entry_points, "broken", hook)
    with caplog.at_level(logging.WARNING, logger="mla_plugins.registry"):
        names = [k.name for k in registry_mod.get_registry().kernels()]
    assert {"aiter", "triton", "torch"} <= set(names)
    assert reason in registry_mod.get_registry().load_errors["broken"]
    assert "'broken'" in caplog.text
    assert_prefill_works()


def test_a_good_plugin_next_to_a_broken_one_still_counts(fake_entry_points):
    class Good(TorchKernel):
        name = "good"
        priority = 50

    install(fake_entry_points, "broken", _raise)
    install(fake_entry_points, "good", lambda: [Good()])
    assert "good" in [k.name for k in registry_mod.get_registry().kernels()]


def test_builtin_names_win_over_a_third_party_torch(fake_entry_points, caplog):
    SpyTorch.ran = False
    install(fake_entry_points, "impostor", lambda: [SpyTorch()])
    with caplog.at_level(logging.WARNING, logger="mla_plugins.registry"):
        kernel = registry_mod.get_registry().get("torch")
    assert type(kernel) is TorchKernel
    assert "'impostor'" in caplog.text and "keeping the built-in" in caplog.text
    assert_prefill_works()
    assert not SpyTorch.ran


def test_a_raising_capability_check_is_a_reason_naming_the_plugin(fake_entry_points):
    install(fake_entry_points, "exploding", lambda: [RaisingCheck(), BadAnswerCheck()])
    assert_prefill_works()  # auto skips both, torch runs
    rejections = registry_mod.get_registry().rejections(
        mla_plugins.core.kernels.base.ConfigInputs(4, 192, 128, torch.bfloat16, torch.device("cpu"), False)
    )
    assert "capability probe exploded" in rejections["raising_check"][0]
    assert "kernel plugin 'exploding'" in rejections["raising_check"][0]
    assert "expected a list of str" in rejections["bad_answer"][0]
    q, k, v, cq, ck = random_batch([5], [5], 4)
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="kernel plugin 'exploding'"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False, kernel="raising_check")


def test_a_raising_info_is_reported_not_raised(fake_entry_points):
    install(fake_entry_points, "noinfo", lambda: [RaisingInfo()])
    infos = {i.name: i for i in mla_plugins.available_kernels("cpu")}
    assert not infos["raising_info"].available
    assert "driver gone" in infos["raising_info"].reasons[0]
    assert infos["torch"].available


@pytest.mark.parametrize("bad_name", ["", "auto", None, 3])
def test_kernels_with_unusable_names_are_refused(fake_entry_points, bad_name):
    class Nameless(TorchKernel):
        pass

    Nameless.name = bad_name
    install(fake_entry_points, "nameless", lambda: [Nameless()])
    reg = registry_mod.get_registry()
    assert "expected a non-empty str" in reg.load_errors["nameless"]
    assert_prefill_works()


def test_a_plugin_that_exits_at_import_is_reported(fake_entry_points):
    fake_entry_points.append(FakeEntryPoint("exits", "exits_mod", error=SystemExit(1)))
    reg = registry_mod.get_registry()
    assert reg.load_errors["exits"] == "SystemExit: 1"
    assert_prefill_works()
