"""register() through vLLM's own plugin loader, in fresh processes (entry points are per process)."""

from __future__ import annotations

import json

from .conftest import run_python

SNAPSHOT = """
import json, sys
def snapshot():
    from vllm.v1.attention.backends.mla.prefill import registry as pr
    from vllm.v1.attention.backends import registry as ar
    from vllm.platforms.cpu import CpuPlatform
    return {
        "prefill_members": list(pr.MLAPrefillBackendEnum.__members__),
        "prefill_overrides": {k.name: v for k, v in pr._MLA_PREFILL_OVERRIDES.items()},
        "attn_overrides": {k.name: v for k, v in ar._ATTN_OVERRIDES.items()},
        "cpu_hook": CpuPlatform.__dict__["check_and_update_config"].__func__.__qualname__,
        "adapter_imported": "mla_plugins.vllm" in sys.modules,
    }
"""


def _run(body: str, env: dict | None = None) -> dict:
    proc = run_python(SNAPSHOT + body, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_loader_discovers_and_runs_register():
    got = _run("""
from vllm.plugins import load_general_plugins
before = snapshot()
load_general_plugins()
loaded = sorted(m for m in sys.modules if m.startswith("vllm.plugins.lora_resolvers"))
print(json.dumps({"before": before, "after": snapshot(), "lora_resolvers": loaded}))
""", env={"VLLM_PLUGINS": "mla_plugins"})
    assert not got["before"]["adapter_imported"] and "MLA_PLUGINS" not in got["before"]["prefill_members"]
    after = got["after"]
    path = "mla_plugins.vllm.prefill.MLAPluginsPrefillBackend"
    assert after["adapter_imported"]
    assert after["prefill_overrides"] == {"CUSTOM": path, "MLA_PLUGINS": path}
    assert after["attn_overrides"] == {}  # no slot taken without MLA_PLUGINS_VLLM_OVERRIDE
    # the allow-list loads ours alone: vLLM's own LoRA resolver plugins (one imports
    # huggingface_hub, ~2 s here) stay out of the process
    assert got["lora_resolvers"] == [], got["lora_resolvers"]


def test_register_is_cheap_and_idempotent():
    got = _run("""
import vllm  # already imported in any process where vLLM calls register()
from mla_plugins.vllm import register
before = set(sys.modules)
register()
imported = sorted(set(sys.modules) - before)
one = snapshot()
calls = []
def profile(frame, event, arg):
    if event == "call":
        calls.append(frame.f_code.co_qualname)
sys.setprofile(profile)
register()
sys.setprofile(None)
from mla_plugins.vllm import registration
registration._done = False  # even a forced second pass changes nothing
register()
print(json.dumps({"one": one, "two": snapshot(), "imported": imported, "second_calls": calls}))
""", env={"MLA_PLUGINS_VLLM_OVERRIDE": "CPU", "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL": "1"})
    assert got["one"] == got["two"]
    assert got["one"]["prefill_overrides"]["CPU"] == "mla_plugins.vllm.prefill.MLAPluginsPrefillBackend"
    assert got["one"]["cpu_hook"] == "CpuPlatform.check_and_update_config"  # wrapped (functools.wraps)
    # cheap by what it does, not by a wall clock (a loaded 2-core CI machine triples that):
    # the first call imports none of our modules beyond the adapter's (the prefill backend and
    # every kernel load only when vLLM builds the backend) and no compiler, only vLLM's own
    # registry and platform modules with what they import; the second call is one function
    # call that returns at the flag
    ours = [m for m in got["imported"] if m.startswith("mla_plugins")]
    assert ours == [], ours
    assert not [m for m in got["imported"] if m.split(".")[0] in ("triton", "transformers", "huggingface_hub")]
    assert "vllm.v1.attention.backends.mla.prefill.registry" in got["imported"]
    assert got["second_calls"] == ["register"], got["second_calls"]


def test_vllm_plugins_allow_list_excluding_us_leaves_vllm_unchanged():
    got = _run("""
before = snapshot()
from vllm.plugins import load_general_plugins
load_general_plugins()
print(json.dumps({"before": before, "after": snapshot()}))
""", env={"VLLM_PLUGINS": "lora_filesystem_resolver", "MLA_PLUGINS_VLLM_OVERRIDE": "CPU"})
    assert got["before"] == got["after"]
    assert not got["after"]["adapter_imported"]


def test_unsupported_vllm_version_warns_once_and_touches_nothing():
    proc = run_python(SNAPSHOT + """
import logging
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
import vllm
vllm.__version__ = "0.31.2"  # what an older vLLM reports
before = snapshot()
from mla_plugins.vllm import register, registration
register(); registration._done = False; register()
after = snapshot(); after["adapter_imported"] = before["adapter_imported"]
print(json.dumps({"same": before == after}))
""", env={"MLA_PLUGINS_VLLM_OVERRIDE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"same": True}
    warnings = [line for line in proc.stderr.splitlines() if "found vLLM 0.31.2" in line]
    assert len(warnings) == 1 and "expected >= 0.32 and < 0.34" in warnings[0], proc.stderr[-2000:]


def test_unknown_override_slot_is_reported_and_known_ones_taken():
    proc = run_python(SNAPSHOT + """
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from mla_plugins.vllm import register
register()
print(json.dumps(snapshot()))
""", env={"MLA_PLUGINS_VLLM_OVERRIDE": "cpu, ROCM_AITER_FA,NOT_A_SLOT,ROCM_AITER_MLA"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    snap = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(snap["prefill_overrides"]) == {"CUSTOM", "MLA_PLUGINS", "CPU", "ROCM_AITER_FA"}
    assert snap["attn_overrides"] == {
        "ROCM_AITER_MLA": "mla_plugins.vllm.rocm_backend.MLAPluginsAiterMLABackend"}
    assert "names 'NOT_A_SLOT', which is no slot it can take" in proc.stderr


def test_register_never_raises_into_vllm():
    """A failure inside register() is logged, not raised (vLLM does not catch it)."""
    proc = run_python("""
import logging, sys
logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
from mla_plugins.vllm import registration
def boom():
    raise RuntimeError("simulated failure")
registration._register_prefill_backend = boom
registration.register()
print("vLLM goes on")
""")
    assert proc.returncode == 0 and "vLLM goes on" in proc.stdout
    assert "registering with vLLM failed" in proc.stderr and "simulated failure" in proc.stderr


def test_import_needs_no_vllm():
    proc = run_python("""
import sys, builtins
real_import = builtins.__import__
def guarded(name, *a, **k):
    if name == "vllm" or name.startswith("vllm."):
        raise ImportError("vllm hidden")
    return real_import(name, *a, **k)
builtins.__import__ = guarded
import mla_plugins.vllm
print(mla_plugins.vllm.BACKEND_NAME)
""")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "MLA_PLUGINS"
