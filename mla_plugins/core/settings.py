"""Environment variables, read at call time so a test or a framework process can set them late.

MLA_PLUGINS_KERNEL                    pin a kernel by name for every call that says kernel="auto"
MLA_PLUGINS_FP8                       on forces FP8 prefill in the framework adapters, off forces
                                      bf16/fp16; unset: fp8 iff the KV cache is fp8
MLA_PLUGINS_SHIM                      off leaves the frameworks' built-in AITER call sites untouched
MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL  vLLM: on keeps chunked prefill for MLA models on the CPU
MLA_PLUGINS_TRACE                     file that every process appends one JSON line per prefill to
MLA_PLUGINS_GLUON                     off keeps the portable Triton fp8 kernel on Hopper instead
                                      of the Gluon one (default on)
MLA_PLUGINS_FP8_ROTATE                on rotates q and k before the fp8 cast (core/fp8.py;
                                      default off: its measured cost)
MLA_PLUGINS_FP8_OUTLIERS              on keeps each (sequence, head)'s outlier features of q
                                      and k out of the fp8 cast (core/fp8.py; default off)

Every on/off variable is parsed here, by `flag`, with the same spellings (1/0, true/false,
yes/no, on/off, any case, surrounding blanks ignored; unset or empty = the default). Any
other value logs one warning per process and variable and counts as the default: these
variables are read inside framework processes that did not necessarily select us, where
an exception would become a traceback in someone else's start-up.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("mla_plugins.settings")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
SPELLINGS = "1/0, true/false, yes/no, on/off"

#: every on/off variable and its default (None: unset means "decide from the context")
FLAGS: dict[str, bool | None] = {
    "MLA_PLUGINS_FP8": None,
    "MLA_PLUGINS_SHIM": True,
    "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL": False,
    "MLA_PLUGINS_GLUON": True,
    # off: the rotation's cost in fp8 end to end is over issue 22's bounds at the small
    # shapes through FA3 (+6.7-11.9% on an H100, stop 34; the large shapes -0.1-+2.5% there,
    # +1.6-8.2% on the H200 at stop 30) and +8-30% through the Triton provider
    # (benchmarks/NOTES.md); MLA_PLUGINS_FP8_ROTATE=1 or fp8_rotate=True takes it (4x lower
    # error with outlier features)
    "MLA_PLUGINS_FP8_ROTATE": False,
    # off: its cost (+22-108% of fp8 end to end on an H100, stop 45, benchmarks/NOTES.md),
    # and only the torch and Triton providers keep the outlier features out (FA3's and
    # AITER's APIs cannot), so turning it on changes which kernel runs
    "MLA_PLUGINS_FP8_OUTLIERS": False,
}

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def parse_flag(raw: str | None) -> bool | None:
    """True/False for a known spelling, None for unset/empty; raises ValueError otherwise."""
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"found {raw!r}, expected one of {SPELLINGS}")


def flag(name: str, default: bool | None = None) -> bool | None:
    """The on/off variable `name`: its value, or `default` when unset, empty or unreadable.

    An unreadable value (e.g. "maybe") logs one warning per process and value, and never
    raises: these are read inside framework processes.
    """
    raw = os.environ.get(name)
    try:
        value = parse_flag(raw)
    except ValueError as exc:
        key = (name, raw or "")
        with _warned_lock:
            first = key not in _warned
            _warned.add(key)
        if first:
            meaning = {True: "on", False: "off", None: "unset"}[default]
            logger.warning("mla-plugins: %s: %s; treating it as %s", name, exc, meaning)
        return default
    return default if value is None else value


def pinned_kernel() -> str | None:
    """The kernel named by MLA_PLUGINS_KERNEL, or None ('' and 'auto' mean no pin)."""
    name = os.environ.get("MLA_PLUGINS_KERNEL", "").strip()
    return None if name in ("", "auto") else name


def fp8_requested(kv_cache_dtype: str | None = None) -> bool:
    """The adapters' fp8 rule: MLA_PLUGINS_FP8 decides when set, else an fp8 KV cache does."""
    forced = flag("MLA_PLUGINS_FP8", FLAGS["MLA_PLUGINS_FP8"])
    if forced is not None:
        return forced
    return bool(kv_cache_dtype) and str(kv_cache_dtype).startswith("fp8")


def shim_enabled() -> bool:
    """False only when MLA_PLUGINS_SHIM is off (0/false/no/off)."""
    return bool(flag("MLA_PLUGINS_SHIM", FLAGS["MLA_PLUGINS_SHIM"]))


def cpu_chunked_prefill_requested() -> bool:
    """vLLM adapter: True when MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL is on."""
    return bool(
        flag("MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL", FLAGS["MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL"])
    )


def gluon_enabled() -> bool:
    """Whether the Hopper fp8 path may use the Gluon kernel (kernels/gluon_attention.py)."""
    return bool(flag("MLA_PLUGINS_GLUON", FLAGS["MLA_PLUGINS_GLUON"]))


def fp8_rotate_enabled() -> bool:
    """Whether fp8 rotates q and k by default (core/fp8.py; `fp8_rotate=` overrides per call)."""
    return bool(flag("MLA_PLUGINS_FP8_ROTATE", FLAGS["MLA_PLUGINS_FP8_ROTATE"]))


def fp8_outliers_enabled() -> bool:
    """Whether fp8 keeps the outlier features out of the cast by default (core/fp8.py;
    `fp8_outliers=` overrides per call)."""
    return bool(flag("MLA_PLUGINS_FP8_OUTLIERS", FLAGS["MLA_PLUGINS_FP8_OUTLIERS"]))


def trace_path() -> str | None:
    return os.environ.get("MLA_PLUGINS_TRACE") or None
