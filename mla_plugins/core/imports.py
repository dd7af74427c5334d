"""`after_import`: run code right after a framework module executes, without importing it.

The adapters patch framework modules (vLLM's AITER MLA backend, SGLang's aiter backend and
its DeepSeek handler registry) that only the processes running a model import, and whose
import pulls in aiter or model code. A plugin's `register()` runs in every framework process,
so it must not import them itself: it asks to be called when the framework does.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType

logger = logging.getLogger("mla_plugins.imports")

#: module name -> [(callback, what)] still waiting for that module's import
_pending: dict[str, list[tuple[Callable[[ModuleType], object], str]]] = {}
_lock = threading.Lock()


def _call(callback: Callable[[ModuleType], object], module: ModuleType, what: str):
    try:
        return callback(module)
    except Exception:  # never break the framework's import of its own module
        logger.exception("mla-plugins: %s after importing %s failed; the module is left as it is",
                         what, module.__name__)
        return None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the real loader of a waited-for module so the callbacks run once it has executed."""

    def find_spec(self, fullname, path, target=None):
        with _lock:
            callbacks = _pending.pop(fullname, None)
        if not callbacks:
            return None
        spec = None
        for finder in sys.meta_path:  # the spec the import would have found without us
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            with _lock:  # nothing to wrap: wait for a later import of the name
                _pending.setdefault(fullname, []).extend(callbacks)
            return None
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            for callback, what in callbacks:
                _call(callback, module, what)

        spec.loader.exec_module = exec_module
        return spec


_finder = _AfterImport()


def after_import(module_name: str, callback: Callable[[ModuleType], object], *, what: str):
    """Call `callback(module)` right after `module_name` executes, or now if it already has.

    Returns the callback's result when it ran now, else None (it runs at the import). A
    callback that raises is logged (naming `what`) and never raised into the importer. The
    same callback registered twice for one module runs once.
    """
    module = sys.modules.get(module_name)
    if module is not None:
        return _call(callback, module, what)
    with _lock:
        waiting = _pending.setdefault(module_name, [])
        if all(cb is not callback for cb, _ in waiting):
            waiting.append((callback, what))
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return None
