"""On/off variables in real SGLang processes (issue 14): MLA_PLUGINS_SHIM=maybe gives one
warning and no traceback, the backend is still registered; every spelling of off turns the
shim off. Fresh interpreters, SGLang's own `load_plugins()` (run again in each scheduler, so
three times here), the library's default logging."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests import forkserver

BODY = """
import json
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.plugins import load_plugins
for _ in range(3):
    load_plugins()
from mla_plugins.sglang import shim
print(json.dumps({"registered": "mla_plugins" in ATTENTION_BACKENDS,
                  "shim": shim.install_aiter_shim()}))
"""


def _run(**env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_PLUGINS_")}
    full_env.update(env, SGLANG_PLUGINS="")
    # a fresh process, forked from one that has imported torch only (tests/forkserver.py)
    proc = forkserver.run(textwrap.dedent(BODY), env=full_env, cwd=os.getcwd(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_bad_shim_value_one_warning_no_traceback():
    got, stderr = _run(MLA_PLUGINS_SHIM="maybe")
    assert "Traceback" not in stderr, stderr[-4000:]
    assert "could not be installed" not in stderr
    warnings = [line for line in stderr.splitlines() if "MLA_PLUGINS_SHIM: found 'maybe'" in line]
    assert len(warnings) == 1, stderr[-4000:]
    assert "1/0, true/false, yes/no, on/off" in warnings[0]
    assert got["registered"] and got["shim"] != "disabled"  # counted as the default: on


@pytest.mark.parametrize("raw", ["off", " No "])  # every spelling: tests/core/test_hardening_env.py
def test_shim_off_in_other_spellings(raw):
    got, stderr = _run(MLA_PLUGINS_SHIM=raw)
    assert got == {"registered": True, "shim": "disabled"}, stderr[-2000:]


AITER_BODY = """
import json
import mla_plugins
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.plugins import load_plugins
for _ in range(3):
    load_plugins()
status = mla_plugins.probe_aiter()   # what the scheduler's first prefill does
print(json.dumps({"registered": "mla_plugins" in ATTENTION_BACKENDS, "amd": status.is_amd_aiter,
                  "usable": status.usable, "import_error": status.import_error,
                  "reason": status.reason}))
"""


@pytest.mark.parametrize("variant", ["systemexit", "no_metadata"])
def test_aiter_failures_do_not_stop_sglang(variant, tmp_path):
    """An aiter whose import raises SystemExit neither stops SGLang's plugin loading nor the
    probe; an AMD aiter without distribution metadata is not called the async-iterator one."""
    from tests.fakes import fake_aiter

    site = fake_aiter.write_package(tmp_path / "site", variant)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_PLUGINS_")}
    env.update(SGLANG_PLUGINS="", PYTHONPATH=os.pathsep.join(
        [str(site), repo, os.environ.get("PYTHONPATH", "")]))
    proc = forkserver.run(textwrap.dedent(AITER_BODY), env=env, cwd=repo, path=[str(site), repo], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["registered"], proc.stderr[-4000:]
    if variant == "systemexit":
        assert got["import_error"] and got["import_error"].startswith("SystemExit"), got
        assert not got["usable"]
    else:
        assert got["amd"] and got["usable"], got
        assert "async" not in got["reason"], got
