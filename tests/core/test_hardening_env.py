"""On/off variables and the trace file (issue 14): one parser, the same spellings for every
variable, a bad value warns once and counts as the default, never raises; an unwritable
MLA_PLUGINS_TRACE warns once per process, not per call."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

import mla_plugins
from mla_plugins.core import settings, trace

FLAGS = sorted(settings.FLAGS)
READERS = {
    "MLA_PLUGINS_FP8": lambda: mla_plugins.fp8_requested("auto"),
    "MLA_PLUGINS_SHIM": mla_plugins.shim_enabled,
    "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL": settings.cpu_chunked_prefill_requested,
    "MLA_PLUGINS_GLUON": settings.gluon_enabled,
    "MLA_PLUGINS_FP8_ROTATE": settings.fp8_rotate_enabled,
    "MLA_PLUGINS_FP8_OUTLIERS": settings.fp8_outliers_enabled,
}
DEFAULTS = {"MLA_PLUGINS_FP8": False, "MLA_PLUGINS_SHIM": True, "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL": False,
            "MLA_PLUGINS_GLUON": True,
            "MLA_PLUGINS_FP8_ROTATE": settings.FLAGS["MLA_PLUGINS_FP8_ROTATE"],
            "MLA_PLUGINS_FP8_OUTLIERS": settings.FLAGS["MLA_PLUGINS_FP8_OUTLIERS"]}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for name in FLAGS + ["MLA_PLUGINS_TRACE"]:
        monkeypatch.delenv(name, raising=False)
    settings._warned.clear()
    trace._warned_paths.clear()
    yield
    settings._warned.clear()
    trace._warned_paths.clear()


def test_every_flag_has_a_reader():
    assert set(READERS) == set(FLAGS)


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("raw,value", [
    ("1", True), ("true", True), (" Yes ", True), ("ON", True),
    ("0", False), ("False", False), ("no", False), (" off", False),
])
def test_same_spellings_for_every_flag(monkeypatch, caplog, name, raw, value):
    monkeypatch.setenv(name, raw)
    with caplog.at_level(logging.WARNING):
        assert READERS[name]() is value
    assert not caplog.records


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("raw", ["maybe", "2", "enabled", "y"])
def test_a_bad_value_warns_once_and_counts_as_the_default(monkeypatch, caplog, name, raw):
    monkeypatch.setenv(name, raw)
    with caplog.at_level(logging.WARNING, logger="mla_plugins"):
        results = [READERS[name]() for _ in range(5)]
    assert results == [DEFAULTS[name]] * 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert name in warnings[0].getMessage() and repr(raw) in warnings[0].getMessage()
    assert "1/0, true/false, yes/no, on/off" in warnings[0].getMessage()


@pytest.mark.parametrize("name", FLAGS)
def test_unset_and_empty_are_the_default(monkeypatch, name):
    assert READERS[name]() is DEFAULTS[name]
    monkeypatch.setenv(name, "  ")
    assert READERS[name]() is DEFAULTS[name]


def test_no_module_reads_an_on_off_variable_itself():
    """Every on/off variable goes through settings.flag (public: mla_plugins.env_flag)."""
    root = Path(mla_plugins.__file__).parent
    names = "|".join(FLAGS + ["CPU_CHUNKED_ENV"])
    pattern = re.compile(rf"environ[^\n]*({names})")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "settings.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_unwritable_trace_warns_once(monkeypatch, tmp_path, caplog):
    path = tmp_path / "no-such-dir" / "trace.jsonl"
    monkeypatch.setenv("MLA_PLUGINS_TRACE", str(path))
    with caplog.at_level(logging.WARNING, logger="mla_plugins.trace"):
        for _ in range(61):  # one forward of a 61-layer model
            trace.record_prefill(kernel="torch", fp8=False, q_tokens=1, k_tokens=1, heads=1)
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()


def test_writable_trace_appends(monkeypatch, tmp_path):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MLA_PLUGINS_TRACE", str(path))
    for _ in range(3):
        trace.record_prefill(kernel="torch", fp8=False, q_tokens=1, k_tokens=1, heads=1)
    assert len(path.read_text().splitlines()) == 3
