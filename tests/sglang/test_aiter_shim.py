"""The SGLang AITER shim's own contract, through SGLang's real plugin loader and its real
aiter backend module, with the faithful fake AITER (tests/fakes), each case in a fresh process:
- register() (SGLang's `load_plugins()`) probes no AITER; the shim waits for the module;
- when the module imports, the names it holds are rebound to the drop-ins (known AITER);
- a module whose `from aiter import (...)` failed holds no names: untouched, one log line;
- MLA_PLUGINS_SHIM=0: untouched.
The FP8 prefill itself, per release x AITER convention, is tests/sglang/test_aiter_matrix.py.
"""

from __future__ import annotations

import json
import os

from tests import forkserver
from tests.fakes import fake_aiter
from tests.sglang.test_aiter_matrix import REPO, _complete_for_sglang

SCRIPT = r"""
import json, logging, sys
_h = logging.StreamHandler(sys.stderr)
_h.setFormatter(logging.Formatter("LOG %(name)s %(levelname)s: %(message)s"))
logging.getLogger("mla_plugins").addHandler(_h)
logging.getLogger("mla_plugins").setLevel(logging.INFO)
from sglang.srt.plugins import load_plugins
load_plugins()                                   # mla_plugins' register(), as SGLang runs it
from mla_plugins.core import aiter as core_aiter
from mla_plugins.sglang import shim
r = {"probed_before_import": core_aiter._status is not None, "again": shim.install_aiter_shim()}
import sglang.srt.layers.attention.aiter_backend as ab
import mla_plugins
r["probed_after_import"] = core_aiter._status is not None
r["reduce"] = getattr(ab, "mla_reduce_v1", None) is mla_plugins.aiter_mla_reduce_v1
r["metadata"] = getattr(ab, "get_ps_metadata_v1", None) is mla_plugins.aiter_get_ps_metadata_v1
r["holds"] = [n for n in ("mla_reduce_v1", "get_ps_metadata_v1") if n in vars(ab)]
r["bound_now"] = shim.install_aiter_shim()       # the module is imported: binds (idempotent)
print(json.dumps(r))
"""


def run(tmp_path, variant, complete=True, **env):
    dest = tmp_path / "aiter"
    fake_aiter.write_package(dest, variant)
    if complete:
        _complete_for_sglang(dest)
    pythonpath = os.pathsep.join([str(dest), str(REPO), os.environ.get("PYTHONPATH", "")])
    # a fresh process, forked from one that has imported torch only (tests/forkserver.py)
    proc = forkserver.run(SCRIPT, cwd=REPO, path=[str(dest), str(REPO)],
                          env={**os.environ, "PYTHONPATH": pythonpath, "SGLANG_PLUGINS": "mla_plugins", **env},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["log"] = [ln for ln in proc.stderr.splitlines() if ln.startswith("LOG mla_plugins.sglang.shim")]
    return r


def test_register_defers_and_the_import_binds_both_names(tmp_path):
    r = run(tmp_path, "num_kv_splits")
    assert r["probed_before_import"] is False and r["again"] == "deferred", r
    assert r["probed_after_import"] is True, r
    assert r["reduce"] and r["metadata"] and r["bound_now"] == "bound", r
    assert len(r["log"]) == 1 and "mla_reduce_v1, get_ps_metadata_v1" in r["log"][0], r["log"]


def test_module_without_aiter_names_is_left_alone(tmp_path):
    """The fake without the unrelated kernels' names: SGLang's `from aiter import (...)` fails
    as a whole (as on an AITER missing one of them), so the module holds nothing to rebind."""
    r = run(tmp_path, "num_kv_splits", complete=False)
    assert r["holds"] == [] and not r["reduce"] and not r["metadata"], r
    assert len(r["log"]) == 1 and "left as it is" in r["log"][0] and "holds no" in r["log"][0], r["log"]


def test_shim_off_leaves_the_module_alone(tmp_path):
    r = run(tmp_path, "legacy", MLA_PLUGINS_SHIM="0")
    assert r["again"] == "disabled" and r["bound_now"] == "disabled", r
    assert r["holds"] == ["mla_reduce_v1", "get_ps_metadata_v1"] and not r["reduce"] and not r["metadata"], r
