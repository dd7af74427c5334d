"""The wheel a user installs (issue 23): built from a copy of the tree with `python -m build`
(no isolation: the session's pinned setuptools, no network), checked by `twine check
--strict`, installed into a fresh virtual environment and imported there in a fresh process.

The fresh environment gets the wheel and nothing else (`pip install --no-deps --no-index`);
its dependencies (torch, pluggy, rich, importlib-metadata) are read from this session's
environment through a path file, as `--system-site-packages` would give them from a system
Python, so nothing is downloaded. The child runs outside the source tree, so
`import mla_plugins` can only find the installed copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.core.test_hardening_packaging import IGNORE, ROOT

VERSION = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
ENTRY_POINTS = {
    ("vllm.general_plugins", "mla_plugins"): "mla_plugins.vllm:register",
    ("sglang.srt.plugins", "mla_plugins"): "mla_plugins.sglang:register",
    ("console_scripts", "mla-plugins"): "mla_plugins.cli:main",
}


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    out = tmp / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)])
    (whl,) = out.glob("mla_plugins-*.whl")
    (sdist,) = out.glob("mla_plugins-*.tar.gz")
    return whl, sdist


def test_build_names_the_version(dist):
    whl, sdist = dist
    assert whl.name == f"mla_plugins-{VERSION}-py3-none-any.whl"
    assert sdist.name == f"mla_plugins-{VERSION}.tar.gz"


def test_twine_check_passes(dist):
    proc = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist)])
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_wheel_has_every_module_and_no_tests(dist):
    whl, _ = dist
    names = set(zipfile.ZipFile(whl).namelist())
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mla_plugins").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert tree and tree <= names, sorted(tree - names)
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/")) or "/fakes/" in n], names
    assert f"mla_plugins-{VERSION}.dist-info/entry_points.txt" in names


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory):
    """A fresh venv holding the wheel; returns (venv, what a fresh interpreter there saw)."""
    whl, _ = dist
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    # this session's pip installs into it (--python): the venv needs no pip of its own
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(whl)])
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    # the dependencies, from this session's environment (appended: the wheel's copy comes first)
    (site / "_session_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    probe = textwrap.dedent("""
        import json, sys, importlib.metadata as md
        import mla_plugins
        dist = md.distribution("mla-plugins")
        eps = {(ep.group, ep.name): ep.value for ep in dist.entry_points}
        loaded = {f"{ep.group}:{ep.name}": callable(ep.load()) for ep in dist.entry_points}
        print(json.dumps({"version": mla_plugins.__version__, "file": mla_plugins.__file__,
                          "dist_version": dist.version, "dist_path": str(dist.locate_file("")),
                          "entry_points": [[g, n, v] for (g, n), v in eps.items()],
                          "loaded": loaded, "frameworks": sorted(m for m in ("vllm", "sglang")
                                                                 if m in sys.modules)}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = _run([str(py), "-c", probe], cwd=str(venv.parent), env=env)
    return venv, json.loads(proc.stdout.strip().splitlines()[-1]), env


def test_installed_wheel_imports_from_the_venv(installed):
    venv, got, _ = installed
    assert got["version"] == got["dist_version"] == VERSION
    assert Path(got["file"]).resolve().is_relative_to(venv.resolve()), got["file"]
    assert not Path(got["file"]).resolve().is_relative_to(ROOT.resolve()), got["file"]
    assert Path(got["dist_path"]).resolve().is_relative_to(venv.resolve()), got["dist_path"]
    assert got["frameworks"] == [], "importing the plugins' entry points imported a framework"


def test_installed_metadata_declares_the_entry_points(installed):
    _, got, _ = installed
    eps = {(g, n): v for g, n, v in got["entry_points"]}
    for key, value in ENTRY_POINTS.items():
        assert eps.get(key) == value, (key, eps)
        assert got["loaded"][f"{key[0]}:{key[1]}"], key


def test_installed_console_script_runs(installed):
    venv, _, env = installed
    script = venv / "bin" / "mla-plugins"
    assert script.exists()
    proc = _run([str(script), "--help"], cwd=str(venv.parent), env=env)
    assert "check" in proc.stdout and "doctor" in proc.stdout, proc.stdout
