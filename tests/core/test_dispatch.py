"""The measured dispatch table (core/dispatch.py) and kernel='auto' choosing by it.

The table is data measured on the H200; these tests check the arithmetic the choice rests on
(the work of a batch, against brute force), the nearest-entry rule, the ranking, the
fp8 -> bf16 choice under kernel='auto' only, and that a broken or absent table falls back to
the priority order. Kernels here are torch kernels under other names (CPU, real math), so
a choice can be run and compared with float64.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import mla_plugins
from mla_plugins.core import dispatch
from mla_plugins.core import registry as registry_mod
from mla_plugins.core.kernels.torch_kernel import TorchKernel
from mla_plugins.core.reference import reference_attention, relative_error
from tests.core.helpers import random_batch


def brute_work(cq, ck, heads, causal):
    pairs = rows = seqs = 0
    for b in range(len(cq) - 1):
        q, k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if q:
            seqs += 1
            rows += q
        for i in range(q):
            pairs += k if not causal else max(0, min(k, i + 1 + k - q))
    return pairs * heads, (rows / seqs if seqs else 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_batch_work_matches_brute_force(seed):
    rng = random.Random(seed)
    lens = [(rng.randint(0, 70), rng.randint(0, 90)) for _ in range(rng.randint(1, 5))]
    cq, ck = [0], [0]
    for q, k in lens:
        cq.append(cq[-1] + q)
        ck.append(ck[-1] + k)
    heads = rng.randint(1, 7)
    for causal in (True, False):
        assert dispatch.batch_work(cq, ck, heads, causal) == brute_work(cq, ck, heads, causal)


def table(*entries):
    return dispatch.parse_table({"device": "test", "source": "test", "entries": [
        {"shape": name, "work": work, "mean_q": mean_q, "gpu_us": us} for name, work, mean_q, us in entries]})


def test_nearest_entry_is_by_log_work_then_query_length():
    t = table(("small", 1e6, 512, {}), ("large", 1e9, 8192, {}), ("large-short-q", 1e9, 512, {}))
    assert t.nearest(2e6, 1000).shape == "small"
    assert t.nearest(3e8, 8000).shape == "large"
    assert t.nearest(3e8, 600).shape == "large-short-q"


def test_rank_orders_measured_variants_and_keeps_unmeasured_last():
    t = table(("s", 1e6, 512, {"a:fp8": 30.0, "b:fp8": 10.0, "b:bf16": 20.0}))
    variants = [("a", True), ("c", True), ("b", True), ("b", False)]
    cu = [0, 1000]  # work 1000 * 1001 / 2 * 1 head: near 1e6 in log2
    assert dispatch.rank(t, cu, cu, 1, True, variants) == [("b", True), ("b", False), ("a", True), ("c", True)]
    assert dispatch.rank(None, cu, cu, 1, True, variants) == variants


@pytest.mark.parametrize("bad", [
    {"entries": [{"shape": "x", "work": 0, "mean_q": 1, "gpu_us": {}}]},
    {"entries": [{"shape": "x", "mean_q": 1, "gpu_us": {}}]},
    {"entries": [{"shape": "x", "work": 1, "mean_q": 1, "gpu_us": {"a:fp8": "fast"}}]},
    {},
])
def test_malformed_tables_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="dispatch table"):
        dispatch.parse_table(bad)


COMMITTED = [(cap, needle, name) for cap, rows in dispatch.TABLES.items() for needle, name in rows]


@pytest.mark.parametrize(("cap", "needle", "name"), COMMITTED, ids=[r[2] for r in COMMITTED])
def test_each_committed_table_parses_and_was_measured_on_its_card(cap, needle, name):
    from importlib import resources

    path = resources.files("mla_plugins.core").joinpath(name)
    assert path.is_file(), f"{name} is named in dispatch.TABLES but not in the package"
    data = json.loads(path.read_text())
    t = dispatch.parse_table(data)
    assert t.entries and all(e.gpu_us for e in t.entries)
    assert tuple(data["capability"]) == cap
    # a table written on another card than the one it is chosen for would steer auto wrongly
    assert needle in t.device, f"{name} was measured on {t.device!r}, chosen for {needle!r} cards"
    if needle == "":
        others = [n for c, n, _ in COMMITTED if c == cap and n]
        assert not any(n in t.device for n in others), f"{name}: {t.device!r} has its own table"


@pytest.mark.parametrize(("cap", "card", "expected"), [
    ((9, 0), "NVIDIA H100 80GB HBM3", "dispatch_h100.json"),
    ((9, 0), "NVIDIA H100 NVL", "dispatch_h100.json"),
    ((9, 0), "NVIDIA H200", "dispatch_h200.json"),
    ((9, 0), "NVIDIA H800", "dispatch_h200.json"),  # no table of its own: the other sm_90 one
    ((8, 0), "NVIDIA A100-SXM4-80GB", None),
    ((10, 0), "NVIDIA B200", None),
])
def test_the_table_follows_the_card(cap, card, expected):
    assert dispatch.table_file(cap, card) == expected


class FastKernel(TorchKernel):
    """The torch math under another name, CPU, priority after torch: only a table picks it."""

    name = "fast_on_paper"
    priority = 200
    devices = frozenset({"cpu"})


class Fp8OnlyKernel(TorchKernel):
    name = "fp8_only"
    priority = 150
    devices = frozenset({"cpu"})
    supports_bf16_compute = False


@pytest.fixture
def registry(monkeypatch):
    registry_mod.reset_registry()
    reg = registry_mod.get_registry()
    reg.register(type("P", (), {"mla_plugins_kernels": staticmethod(
        mla_plugins.hookimpl(lambda: [FastKernel(), Fp8OnlyKernel()]))})(), name="test-dispatch")
    yield reg
    registry_mod.reset_registry()


def with_table(monkeypatch, us):
    t = table(("only", 1e6, 300, us))
    monkeypatch.setattr(dispatch, "table_for", lambda device: t)
    return t


def test_auto_takes_the_measured_fastest_and_runs_it(registry, monkeypatch):
    with_table(monkeypatch, {"torch:fp8": 50.0, "fast_on_paper:fp8": 5.0, "fp8_only:fp8": 9.0})
    q, k, v, cq, ck = random_batch([300, 17], [300, 40], 2, seed=3)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, fp8=True)
    assert plan.kernel == "fast_on_paper" and not plan.auto_bf16
    out = torch.full((q.shape[0], 2, 128), float("nan"), dtype=q.dtype)
    mla_plugins.mla_prefill(q, k, v, plan=plan, out=out)
    ref, _ = reference_attention(q, k, v, cq, ck, fp8_dtype=torch.float8_e4m3fn,
                                 fp8_rotate=mla_plugins.core.fp8.rotation_applies(192, None))
    assert relative_error(out, ref) < 1e-2


def test_auto_may_run_an_fp8_request_in_bf16_and_says_so(registry, monkeypatch, tmp_path):
    with_table(monkeypatch, {"torch:fp8": 50.0, "torch:bf16": 20.0, "fp8_only:fp8": 40.0})
    q, k, v, cq, ck = random_batch([300], [300], 2, seed=4)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, fp8=True)
    assert (plan.kernel, plan.auto_bf16, plan.fp8) == ("torch", True, False)
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MLA_PLUGINS_TRACE", str(trace))
    out = torch.full((q.shape[0], 2, 128), float("nan"), dtype=q.dtype)
    for _ in range(2):  # the full path, then the planned fast path
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=True, out=out)
    ref, _ = reference_attention(q, k, v, cq, ck)
    assert relative_error(out, ref) < 1e-2  # bf16 accuracy: it did not quantize
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 2 and all(x["fp8"] is False and x["fp8_asked"] is True for x in lines)


def test_a_pinned_kernel_does_what_was_asked(registry, monkeypatch):
    with_table(monkeypatch, {"torch:fp8": 50.0, "torch:bf16": 20.0, "fast_on_paper:fp8": 1.0})
    cq = [0, 300]
    plan = mla_plugins.plan_prefill(cq, cq, num_heads=2, fp8=True, kernel="torch")
    assert (plan.kernel, plan.auto_bf16, plan.fp8) == ("torch", False, True)
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "torch")
    plan = mla_plugins.plan_prefill(cq, cq, num_heads=2, fp8=True)
    assert (plan.kernel, plan.auto_bf16) == ("torch", False)


def test_a_bf16_request_never_runs_fp8(registry, monkeypatch):
    with_table(monkeypatch, {"torch:bf16": 50.0, "fast_on_paper:bf16": 40.0, "fp8_only:fp8": 1.0})
    plan = mla_plugins.plan_prefill([0, 300], [0, 300], num_heads=2, fp8=False)
    assert (plan.kernel, plan.fp8) == ("fast_on_paper", False)


def test_without_a_table_auto_is_the_priority_order(registry, monkeypatch):
    monkeypatch.setattr(dispatch, "table_for", lambda device: None)
    plan = mla_plugins.plan_prefill([0, 300], [0, 300], num_heads=2, fp8=True)
    assert plan.kernel == "torch" and not plan.auto_bf16


def test_a_plan_with_its_own_pinned_kernel_takes_the_fast_path(registry, monkeypatch):
    monkeypatch.setattr(dispatch, "table_for", lambda device: None)
    q, k, v, cq, ck = random_batch([100], [100], 2, seed=5)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, fp8=False, kernel="torch")
    mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="torch")
    assert "call" in plan.memo  # the checks of the first call are remembered for this signature
    from mla_plugins.core import api

    calls = []
    original = api._prefill_inputs
    monkeypatch.setattr(api, "_prefill_inputs", lambda *a, **k: calls.append(1) or original(*a, **k))
    mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="torch")
    assert calls == []
    with pytest.raises(mla_plugins.KernelNotSupportedError):
        mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="fp8_only", fp8=False)
