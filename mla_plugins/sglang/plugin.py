"""`register()`: what SGLang's plugin loader runs, in every SGLang process.

It extends the CLI choices before SGLang parses arguments, registers the backend factory
and the DeepSeek forward-method handler, and shims SGLang's built-in AITER backend.
It never raises: a plugin must not crash a framework that did not select it.

The DeepSeek handler registry lives in SGLang's model code
(`sglang.srt.models.deepseek_common.attention_backend_handler`), whose import pulls in
about 1,900 modules (quantization, AWQ/GGUF warnings included) and ~2 s: too much for
every SGLang process (main, tokenizer, detokenizer) whatever the model. So the handler is
registered when that module is imported (an import hook that runs right after it
executes, before DeepSeek's model classes can ask for a handler), or at once if it
already is.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys

import mla_plugins

logger = logging.getLogger("mla_plugins.sglang.plugin")

BACKEND_NAME = "mla_plugins"
#: SGLang releases this adapter supports: the plugin system first shipped in 0.5.11.
SUPPORTED_MIN = (0, 5, 11)
SUPPORTED_BELOW = (0, 6, 0)
SUPPORTED_RANGE = ">=0.5.11,<0.6"

_registered = False
_warned_unsupported = False


def _version_tuple(text: str) -> tuple[int, int, int]:
    """'0.5.15.post1' -> (0, 5, 15); missing parts count as 0."""
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def is_supported(version: str | None) -> bool:
    return version is not None and SUPPORTED_MIN <= _version_tuple(version) < SUPPORTED_BELOW


def allowed_by_sglang_plugins() -> bool:
    """SGLANG_PLUGINS is SGLang's allow-list of entry-point names; unset allows all."""
    raw = os.environ.get("SGLANG_PLUGINS", "")
    names = {x.strip() for x in raw.split(",") if x.strip()}
    return not names or BACKEND_NAME in names


def register() -> None:
    """Make `mla_plugins` an SGLang attention backend. Idempotent; never raises."""
    global _registered, _warned_unsupported
    if _registered:
        return
    if not allowed_by_sglang_plugins():
        logger.info("SGLANG_PLUGINS=%s excludes %r: not registering", os.environ.get("SGLANG_PLUGINS"),
                    BACKEND_NAME)
        return
    version = sglang_version()
    if not is_supported(version):
        if not _warned_unsupported:
            _warned_unsupported = True
            logger.warning(
                "mla_plugins: found sglang %s, supported %s; the %r attention backend and the AITER "
                "shim are not registered (SGLang is left unchanged). Install a supported SGLang or "
                "use another attention backend.", version or "(not installed)", SUPPORTED_RANGE, BACKEND_NAME)
        return
    try:
        _register_choices()
        _register_factory()
        _register_deepseek_handler()
    except Exception:
        logger.exception("mla_plugins: registering the %r backend in sglang %s failed; SGLang keeps "
                         "its own backends", BACKEND_NAME, version)
        return
    _registered = True
    logger.info("mla_plugins: registered attention backend %r in sglang %s", BACKEND_NAME, version)
    try:
        from .shim import install_aiter_shim

        install_aiter_shim()
    except Exception:
        logger.exception("mla_plugins: the AITER shim could not be installed; SGLang's aiter backend "
                         "is left as it is")


def _register_choices() -> None:
    from sglang.srt import server_args

    if BACKEND_NAME not in server_args.ATTENTION_BACKEND_CHOICES:
        server_args.add_attention_backend_choices([BACKEND_NAME])
    # MLA models keep the chunked prefix cache only for listed prefill backends; the list
    # moved from model_runner (0.5.11-0.5.15) to server_args/arg_groups (later releases).
    holder = server_args
    if not hasattr(holder, "CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS"):
        from sglang.srt.model_executor import model_runner as holder
    supported = holder.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS
    if BACKEND_NAME not in supported:
        holder.add_chunked_prefix_cache_attention_backend(BACKEND_NAME)


def _register_factory() -> None:
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    from .backend import create_backend

    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_backend:
        register_attention_backend(BACKEND_NAME)(create_backend)


HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"


def _add_deepseek_handler(module) -> None:
    from .backend import deepseek_forward_method

    registry = module.AttentionBackendRegistry
    # Unknown names fall back to the triton handler, which sends prefixed extends to the
    # absorbed MLA path; ours keeps every plain extend on the MHA path.
    if registry.get_handler(BACKEND_NAME) is not deepseek_forward_method:
        registry.register(BACKEND_NAME, deepseek_forward_method)


def _register_deepseek_handler() -> str:
    """"now" if SGLang's handler module is already imported, else "deferred" (on import)."""
    now = HANDLER_MODULE in sys.modules
    mla_plugins.after_import(HANDLER_MODULE, _add_deepseek_handler,
                             what="registering the DeepSeek handler (else SGLang's triton handler)")
    return "now" if now else "deferred"
