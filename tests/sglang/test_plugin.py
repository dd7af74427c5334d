"""Entry-point discovery by SGLang's own `load_plugins()`, CLI acceptance, SGLANG_PLUGINS,
idempotence and the unsupported-version path, each in a fresh process (plugin state is
per process, as in SGLang's spawned schedulers)."""

from __future__ import annotations

import json
import os
import textwrap

from tests import forkserver

SNAPSHOT = """
import json
from sglang.srt import server_args as sa
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

def snapshot():
    return {
        "choices": list(sa.ATTENTION_BACKEND_CHOICES),
        "chunked": list(sa.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS),
        "factories": {k: f"{v.__module__}.{v.__qualname__}" for k, v in ATTENTION_BACKENDS.items()},
        "handlers": {k: f"{v.__module__}.{v.__qualname__}" for k, v in AttentionBackendRegistry._handlers.items()},
    }
"""


def run_py(body: str, *, snapshot: bool = True, **env) -> dict:
    """Run SNAPSHOT + body in a fresh interpreter; body prints one JSON line last."""
    full_env = {**os.environ, **env}
    code = (SNAPSHOT if snapshot else "import json\n") + textwrap.dedent(body)
    # a fresh process, forked from one that has imported torch only (tests/forkserver.py)
    proc = forkserver.run(code, env=full_env, cwd=os.getcwd(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_load_plugins_discovers_and_registers():
    out = run_py("""
        before = snapshot()
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print(json.dumps({"before": before, "after": snapshot()}))
    """, SGLANG_PLUGINS="")
    before, after = out["before"], out["after"]
    assert "mla_plugins" not in before["choices"] and "mla_plugins" not in before["factories"]
    assert after["choices"] == before["choices"] + ["mla_plugins"]
    assert after["chunked"] == before["chunked"] + ["mla_plugins"]
    assert after["factories"]["mla_plugins"] == "mla_plugins.sglang.backend.create_backend"
    assert after["handlers"]["mla_plugins"] == "mla_plugins.sglang.backend.deepseek_forward_method"
    # nothing else changed
    assert {k: v for k, v in after["factories"].items() if k != "mla_plugins"} == before["factories"]
    assert {k: v for k, v in after["handlers"].items() if k != "mla_plugins"} == before["handlers"]


def test_cli_rejects_the_name_before_and_accepts_it_after():
    out = run_py("""
        import argparse, contextlib, io
        from sglang.srt.server_args import ServerArgs

        def parses(*flags):
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    ns = parser.parse_args(["--model-path", "m", *flags])
            except SystemExit:
                return err.getvalue().strip().splitlines()[-1]
            return {k: getattr(ns, k) for k in ("attention_backend", "prefill_attention_backend",
                                               "decode_attention_backend")}

        before = parses("--attention-backend", "mla_plugins")
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print(json.dumps({
            "before": before,
            "only": parses("--attention-backend", "mla_plugins"),
            "split": parses("--prefill-attention-backend", "mla_plugins",
                            "--decode-attention-backend", "triton"),
        }))
    """, SGLANG_PLUGINS="")
    assert "invalid choice: 'mla_plugins'" in out["before"]
    assert out["only"]["attention_backend"] == "mla_plugins"
    assert out["split"]["prefill_attention_backend"] == "mla_plugins"
    assert out["split"]["decode_attention_backend"] == "triton"


def test_sglang_plugins_excluding_it_leaves_sglang_unchanged():
    out = run_py("""
        before = snapshot()
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import mla_plugins.sglang as adapter
        adapter.register()  # called directly too: it honours SGLANG_PLUGINS itself
        print(json.dumps({"before": before, "after": snapshot()}))
    """, SGLANG_PLUGINS="some_other_plugin")
    assert out["after"] == out["before"]
    assert "mla_plugins" not in out["after"]["choices"]


def test_register_twice_changes_nothing():
    out = run_py("""
        import mla_plugins.sglang as adapter
        from mla_plugins.sglang import plugin
        adapter.register()
        first = snapshot()
        adapter.register()
        plugin._registered = False  # force every step to run again: each checks on its own
        adapter.register()
        print(json.dumps({"first": first, "again": snapshot()}))
    """, SGLANG_PLUGINS="")
    assert out["again"] == out["first"]
    assert out["first"]["choices"].count("mla_plugins") == 1
    assert out["first"]["chunked"].count("mla_plugins") == 1


def test_unsupported_sglang_warns_once_and_changes_nothing():
    out = run_py("""
        import logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.levelname, record.getMessage()))
        logging.getLogger("mla_plugins").addHandler(Keep())
        logging.getLogger("mla_plugins").setLevel(logging.INFO)
        from mla_plugins.sglang import plugin
        plugin.sglang_version = lambda: "0.5.10"
        before = snapshot()
        plugin.register()
        plugin.register()
        print(json.dumps({"before": before, "after": snapshot(), "records": records}))
    """, SGLANG_PLUGINS="")
    assert out["after"] == out["before"]
    warnings = [m for level, m in out["records"] if level == "WARNING"]
    assert len(warnings) == 1
    assert "found sglang 0.5.10, supported >=0.5.11,<0.6" in warnings[0]


def test_register_imports_no_model_code_and_registers_the_handler_when_it_is_imported():
    """register() runs in every SGLang process: it must not import DeepSeek's model code
    (~1,900 modules, ~2 s, AWQ/GGUF warnings); the handler arrives when SGLang imports it."""
    out = run_py("""
        import sys
        from sglang.srt.plugins import load_plugins
        before = set(sys.modules)
        load_plugins()  # SGLang's loader runs our register()
        added = sorted(set(sys.modules) - before)
        from mla_plugins.sglang import plugin
        from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
        handler = AttentionBackendRegistry._handlers.get("mla_plugins")
        print(json.dumps({
            "registered": plugin._registered,
            "models": [m for m in added if m.startswith("sglang.srt.models")],
            "added": len(added),
            "handler": handler and f"{handler.__module__}.{handler.__qualname__}",
            "triton_kept": AttentionBackendRegistry._handlers.get("triton") is not None,
        }))
    """, snapshot=False, SGLANG_PLUGINS="")
    assert out["registered"]
    assert out["models"] == []
    assert out["handler"] == "mla_plugins.sglang.backend.deepseek_forward_method"
    assert out["triton_kept"]
