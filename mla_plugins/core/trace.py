"""MLA_PLUGINS_TRACE: one JSON line per prefill call, from whichever process ran it.

Adapters wrap their calls in `trace_context(framework, entry)`; `mla_prefill` records
the kernel it actually ran. Lines are appended with one O_APPEND write each, so the
processes of a multi-process engine can share one file.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os

from .settings import trace_path

_TRACE_KEY = b"MLA_PLUGINS_TRACE"
_POSIX = os.name == "posix"  # where os.environ keeps its variables as bytes in `_data`

logger = logging.getLogger("mla_plugins.trace")

#: trace paths already warned about: a prefill runs once per layer, so an unwritable path
#: would otherwise warn dozens of times per forward
_warned_paths: set[str] = set()

_context: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "mla_plugins_trace", default=None
)


class trace_context:  # noqa: N801 - used as a function: `with trace_context(...)`
    """Label the mla_prefill calls made inside the block, e.g. ("vllm", "new_tokens").

    Adapters enter it once per layer: when MLA_PLUGINS_TRACE is unset at entry it sets
    nothing (a generator-based context manager cost ~1-2 µs per layer even then)."""

    __slots__ = ("_label", "_token")

    def __init__(self, framework: str, entry: str) -> None:
        self._label = (framework, entry)
        self._token = None

    def __enter__(self) -> trace_context:
        if tracing():
            self._token = _context.set(self._label)
        return self

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            _context.reset(self._token)
            self._token = None


def tracing() -> bool:
    """Whether MLA_PLUGINS_TRACE is set now. Asked once per prefill call: on POSIX it reads
    os.environ's own bytes mapping (what os.environ.get decodes, ~40x cheaper), so a late
    os.environ / monkeypatch.setenv is seen as before."""
    data = getattr(os.environ, "_data", None) if _POSIX else None
    if type(data) is not dict:
        return trace_path() is not None
    return bool(data.get(_TRACE_KEY))


def record_prefill(*, kernel: str, fp8: bool, q_tokens: int, k_tokens: int, heads: int,
                   auto_bf16: bool = False) -> None:
    """One line per prefill call. `auto_bf16`: the call asked for fp8 and kernel="auto" ran
    it in bf16, which measured faster for the batch (the line says so: "fp8_asked")."""
    if not tracing():
        return
    framework, entry = _context.get() or ("direct", "mla_prefill")
    record = {"framework": framework, "entry": entry, "kernel": kernel, "fp8": fp8,
              "q_tokens": q_tokens, "k_tokens": k_tokens, "heads": heads}
    if auto_bf16:
        record["fp8_asked"] = True
        record["why"] = "bf16 measured faster than fp8 for this batch (kernel='auto')"
    _append(record)


def trace_event(framework: str, entry: str, **fields) -> None:
    """One more MLA_PLUGINS_TRACE line beside the prefill calls' (an adapter's planned batch:
    entry "plan"), with the pid of the process that wrote it."""
    _append({"framework": framework, "entry": entry, **fields})


def _append(record: dict) -> None:
    path = trace_path()
    if path is None:
        return
    line = json.dumps({**record, "pid": os.getpid()})
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:  # tracing must never break a prefill
        if path not in _warned_paths:
            _warned_paths.add(path)
            logger.warning(
                "MLA_PLUGINS_TRACE=%s: cannot append (%s); prefill calls are not traced in this "
                "process (warned once; point MLA_PLUGINS_TRACE at a writable file)", path, exc,
            )
