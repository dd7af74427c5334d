"""Fake FlashAttention-3 builds for the CPU, written from the real sources (tests only).

Four real builds, each as the module structure mla_plugins' FA3 provider imports
(mla_plugins/core/kernels/flash_attn.py CANDIDATES), under `sites/<build>/` (put that
directory on sys.path, as a site-packages holding the build):

    fa3_fwd       PyPI fa3-fwd 0.0.3: fa3_fwd_interface.py (imports fa3_fwd._C),
                  fa3_fwd/_C.py (registers fa3_fwd::fwd), fa3_fwd_config.py (verbatim)
    flash_attn_3  FA3's own hopper/ build: flash_attn_interface.py (imports flash_attn_3._C),
                  flash_attn_3/_C.py (flash_attn_3::fwd), flash_attn_config.py (as setup.py
                  writes it for a default build)
    sgl_kernel    sglang-kernel 0.4.10: sgl_kernel/flash_attn.py (verbatim), flash_ops.py
                  (sgl_kernel::fwd), debug_utils.py / __init__.py stand-ins, version.py verbatim
    vllm          for the core session only (no vLLM there): a stand-in `vllm` with
                  `vllm.platforms`, and vLLM 0.32's vllm_flash_attn/__init__.py and
                  flash_attn_interface.py verbatim beside the fake _vllm_fa3_C.py
                  (_vllm_fa3_C::fwd); in the vllm session `install_vllm_fa3_C()` puts only
                  that fake library in front of the REAL vLLM
    unknown       fa3_fwd with a forward schema no release has (a required argument
                  inserted): the provider's "unknown schema" path

The op schemas are verbatim (schemas.py); every op's CPU kernel is kernel.py's `forward`
(FA3's mha_fwd: its checks and messages, its edge values, its math in float64). Ops register
once per namespace and process: `cleanup()` destroys them and forgets the modules imported
from `sites/`, so the next test can import another build (or the same one afresh).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from . import kernel

SITES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sites")
BUILDS = ("fa3_fwd", "flash_attn_3", "sgl_kernel", "vllm", "unknown")
VLLM_FA3_C = "vllm.vllm_flash_attn._vllm_fa3_C"


def site(build: str) -> str:
    """The directory to put on sys.path for `build` (one of BUILDS)."""
    if build not in BUILDS:
        raise ValueError(f"unknown fake FA3 build {build!r}; one of {BUILDS}")
    return os.path.join(SITES, build)


def _from_sites(module) -> bool:
    paths = [getattr(module, "__file__", None)]
    try:  # a package's directories (a namespace package has no __file__)
        paths += list(module.__dict__.get("__path__") or [])
    except TypeError:  # torch's op namespaces answer __path__ with something else
        pass
    return any(isinstance(p, str) and os.path.abspath(p).startswith(SITES + os.sep) for p in paths)


def install_vllm_fa3_C():
    """Load sites/vllm/.../_vllm_fa3_C.py as `vllm.vllm_flash_attn._vllm_fa3_C` (registers
    `_vllm_fa3_C::fwd`), for the REAL vLLM's `from . import _vllm_fa3_C` to find. Returns it."""
    path = os.path.join(SITES, "vllm", "vllm", "vllm_flash_attn", "_vllm_fa3_C.py")
    spec = importlib.util.spec_from_file_location(VLLM_FA3_C, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[VLLM_FA3_C] = module
    spec.loader.exec_module(module)
    return module


def cleanup() -> None:
    """Destroy every fake op and forget every module imported from `sites/`."""
    kernel.unregister_all()
    for name, module in list(sys.modules.items()):
        if module is not None and _from_sites(module):
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent and parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
                delattr(sys.modules[parent], child)
    importlib.invalidate_caches()
