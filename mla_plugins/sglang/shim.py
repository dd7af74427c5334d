"""AITER shim for SGLang's built-in aiter backend (`sglang.srt.layers.attention.aiter_backend`).

That module does `from aiter import mla_reduce_v1` and calls it positionally: with 8
arguments up to 0.5.12 (`..., tile_q, output, final_lse`) and 9 from 0.5.15
(`..., tile_q, 0, output, final_lse`), so each release breaks against the AITER on the
other side of ROCm/aiter#3391. The shim binds that module's `mla_reduce_v1` to
`mla_plugins.aiter_mla_reduce_v1`, which accepts both forms and calls the installed AITER
in its own convention.

Why not SGLang's `HookRegistry` (REPLACE on `...aiter_backend.mla_reduce_v1`): after
patching, it rewrites every module attribute that is the same object, `aiter.mla_reduce_v1`
itself included, so our drop-in (which calls `aiter.mla_reduce_v1`) would call itself; it
also imports the backend module at plugin-load time. The shim instead rebinds the one
module attribute, when that module is imported (an import hook) or now if it already is.

Active only when AMD AITER with a known convention is importable; `MLA_PLUGINS_SHIM=0`
turns it off. Logged once per process.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

import mla_plugins

logger = logging.getLogger("mla_plugins.sglang.shim")

TARGET_MODULE = "sglang.srt.layers.attention.aiter_backend"
ATTR = "mla_reduce_v1"

_logged = False


def _bind(module) -> bool:
    """Point `module.mla_reduce_v1` at the drop-in; True if it changed."""
    global _logged
    current = getattr(module, ATTR, None)
    if current is mla_plugins.aiter_mla_reduce_v1:
        return False
    setattr(module, ATTR, mla_plugins.aiter_mla_reduce_v1)
    if not _logged:
        _logged = True
        status = mla_plugins.probe_aiter()
        logger.info(
            "mla_plugins: %s.%s -> mla_plugins.aiter_mla_reduce_v1 (AITER %s %s: %s; it %s). "
            "Set MLA_PLUGINS_SHIM=0 to leave it alone.",
            TARGET_MODULE, ATTR, status.distribution, status.version, status.reduce_convention,
            status.action(),
        )
    return True


class _BindOnImport(importlib.abc.MetaPathFinder):
    """Runs `_bind` right after the aiter backend module executes, then steps aside."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _bind(module)

        loader.exec_module = exec_module
        return spec


def install_aiter_shim() -> str:
    """Install the shim if it applies here; returns what it did, for logs and tests.

    "disabled" (MLA_PLUGINS_SHIM=0), "no-aiter" (no usable AMD AITER: nothing to fix),
    "bound" (the module was imported: rebound now), "deferred" (rebinds on import),
    "already" (nothing left to do).
    """
    if not mla_plugins.shim_enabled():
        logger.info("mla_plugins: MLA_PLUGINS_SHIM=0, SGLang's aiter backend is left as it is")
        return "disabled"
    status = mla_plugins.probe_aiter()
    if not status.usable:
        logger.debug("mla_plugins: no AITER shim for SGLang: %s", status.reason)
        return "no-aiter"
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        return "bound" if _bind(module) else "already"
    if not any(isinstance(f, _BindOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _BindOnImport())
    return "deferred"
