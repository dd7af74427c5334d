"""Environment variables, read at call time so a test or a framework process can set them late.

MLA_PLUGINS_KERNEL   pin a kernel by name for every call that says kernel="auto"
MLA_PLUGINS_FP8      1 forces FP8 prefill in the framework adapters, 0 forces bf16/fp16
MLA_PLUGINS_SHIM     0 leaves the frameworks' built-in AITER call sites untouched
MLA_PLUGINS_TRACE    file that every process appends one JSON line per prefill call to
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(name: str) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: found {raw!r}, expected one of 1/0, true/false, yes/no, on/off")


def pinned_kernel() -> str | None:
    """The kernel named by MLA_PLUGINS_KERNEL, or None ('' and 'auto' mean no pin)."""
    name = os.environ.get("MLA_PLUGINS_KERNEL", "").strip()
    return None if name in ("", "auto") else name


def fp8_requested(kv_cache_dtype: str | None = None) -> bool:
    """The adapters' fp8 rule: MLA_PLUGINS_FP8 decides when set, else an fp8 KV cache does."""
    forced = _flag("MLA_PLUGINS_FP8")
    if forced is not None:
        return forced
    return bool(kv_cache_dtype) and str(kv_cache_dtype).startswith("fp8")


def shim_enabled() -> bool:
    """False only when MLA_PLUGINS_SHIM=0 (or false/no/off)."""
    return _flag("MLA_PLUGINS_SHIM") is not False


def trace_path() -> str | None:
    return os.environ.get("MLA_PLUGINS_TRACE") or None
