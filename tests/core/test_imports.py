"""`mla_plugins.after_import`: callbacks run right after a module executes, never break its import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, logging, sys
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    import mla_plugins
    seen = []
    def record(module):
        seen.append((module.__name__, module.VALUE))   # the module has executed by now
        return "ran"
    def broken(module):
        raise RuntimeError("callback bug")
    deferred = mla_plugins.after_import("fakepkg.target", record, what="recording")
    mla_plugins.after_import("fakepkg.target", record, what="recording")  # twice: runs once
    mla_plugins.after_import("fakepkg.target", broken, what="a broken callback")
    assert "fakepkg.target" not in sys.modules   # registering imported nothing
    import fakepkg.target
    now = mla_plugins.after_import("fakepkg.target", record, what="recording")
    print(json.dumps({"deferred": deferred, "now": now, "seen": seen,
                      "value": fakepkg.target.VALUE}))
''')


def test_after_import_runs_after_the_module_and_never_breaks_it(tmp_path):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "target.py").write_text("VALUE = 41 + 1\n")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"deferred": None, "now": "ran", "value": 42,
                      "seen": [["fakepkg.target", 42], ["fakepkg.target", 42]]}
    assert "a broken callback after importing fakepkg.target failed" in proc.stderr
    assert "callback bug" in proc.stderr
