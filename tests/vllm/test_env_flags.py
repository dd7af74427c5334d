"""On/off variables in real vLLM processes (issue 14): an unreadable value gives one warning
and no traceback, the backend is still registered, and nothing is silently ignored.

Each case is a fresh interpreter that loads plugins through vLLM's own loader three times
(API server, engine core and worker each do in a real engine), with the library's default
logging (our warnings reach stderr through Python's last-resort handler, as in vLLM).
"""

from __future__ import annotations

import json

import pytest

from .conftest import run_python

LOAD_THREE_TIMES = """
import json
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.mla.prefill import registry as pr
from vllm.platforms.cpu import CpuPlatform
for _ in range(3):
    load_general_plugins()
print(json.dumps({
    "members": list(pr.MLAPrefillBackendEnum.__members__),
    "cpu_hook_ours": getattr(CpuPlatform.__dict__["check_and_update_config"].__func__,
                             "_mla_plugins_keeps_chunked_prefill", False),
}))
"""


def _load(env):
    proc = run_python(LOAD_THREE_TIMES, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _mentions(stderr: str, text: str) -> list[str]:
    return [line for line in stderr.splitlines() if text in line]


@pytest.mark.parametrize("name", ["MLA_PLUGINS_SHIM", "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL"])
def test_bad_value_one_warning_no_traceback(name):
    got, stderr = _load({name: "maybe"})
    assert "Traceback" not in stderr, stderr[-4000:]
    assert not _mentions(stderr, "registering with vLLM failed"), stderr[-4000:]
    warnings = _mentions(stderr, f"{name}: found 'maybe'")
    assert len(warnings) == 1, stderr[-4000:]
    assert "1/0, true/false, yes/no, on/off" in warnings[0]
    assert "MLA_PLUGINS" in got["members"]  # the backend is registered all the same
    if name == "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL":
        assert not got["cpu_hook_ours"]  # counted as off


@pytest.mark.parametrize("raw", ["YES", " on "])  # every spelling: tests/core/test_hardening_env.py
def test_cpu_chunked_prefill_accepts_every_spelling(raw):
    got, stderr = _load({"MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL": raw})
    assert got["cpu_hook_ours"], stderr[-2000:]
    assert not _mentions(stderr, "found")


@pytest.mark.parametrize("raw", ["off"])
def test_shim_off_in_every_spelling(raw):
    proc = run_python("""
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from mla_plugins.vllm import registration
print(json.dumps(registration.install_aiter_shim()))
""", env={"MLA_PLUGINS_SHIM": raw})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["AITER shim off (MLA_PLUGINS_SHIM=0)"]


def test_bad_fp8_value_warns_once_in_the_prefill_backend():
    """MLA_PLUGINS_FP8=maybe: the backend is built (per layer in a real model), one warning,
    and the KV-cache rule decides (auto cache: bf16)."""
    proc = run_python("""
import json
from vllm.config import VllmConfig
from vllm.plugins import load_general_plugins
load_general_plugins()
from mla_plugins.vllm.prefill import MLAPluginsPrefillBackend
kw = dict(num_heads=2, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128,
          qk_rope_head_dim=64, v_head_dim=128, vllm_config=VllmConfig())
print(json.dumps([MLAPluginsPrefillBackend(**kw).fp8 for _ in range(4)]))
""", env={"MLA_PLUGINS_FP8": "maybe"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [False] * 4
    assert "Traceback" not in proc.stderr
    assert len(_mentions(proc.stderr, "MLA_PLUGINS_FP8: found 'maybe'")) == 1, proc.stderr[-4000:]


AITER_BODY = """
import json
import mla_plugins
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.mla.prefill import registry as pr
for _ in range(3):
    load_general_plugins()
status = mla_plugins.probe_aiter()   # what the worker's first prefill does
print(json.dumps({"members": list(pr.MLAPrefillBackendEnum.__members__),
                  "amd": status.is_amd_aiter, "usable": status.usable,
                  "import_error": status.import_error, "reason": status.reason}))
"""


@pytest.mark.parametrize("variant", ["systemexit", "no_metadata"])
def test_aiter_failures_do_not_stop_vllm(variant, tmp_path):
    """An aiter whose import raises SystemExit neither stops vLLM's plugin loading nor the
    probe; an AMD aiter without distribution metadata is not called the async-iterator one."""
    from tests.fakes import fake_aiter

    from .conftest import REPO

    site = fake_aiter.write_package(tmp_path / "site", variant)
    proc = run_python(AITER_BODY, env={"PYTHONPATH": f"{site}:{REPO}"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "MLA_PLUGINS" in got["members"], proc.stderr[-4000:]
    if variant == "systemexit":
        assert got["import_error"] and got["import_error"].startswith("SystemExit"), got
        assert not got["usable"]
    else:
        assert got["amd"] and got["usable"], got
        assert "async" not in got["reason"], got
