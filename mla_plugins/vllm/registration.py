"""`register()`: the vLLM general plugin. Idempotent, cheap, never raises into vLLM."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
import time

import mla_plugins

logger = logging.getLogger("mla_plugins.vllm.registration")

BACKEND_NAME = "MLA_PLUGINS"
PREFILL_CLASS_PATH = "mla_plugins.vllm.prefill.MLAPluginsPrefillBackend"
ROCM_BACKEND_CLASS_PATH = "mla_plugins.vllm.rocm_backend.MLAPluginsAiterMLABackend"
ROCM_TRITON_BACKEND_CLASS_PATH = "mla_plugins.vllm.rocm_backend.MLAPluginsAiterTritonMLABackend"
#: [min, max) of the vLLM versions this adapter knows the internals of.
SUPPORTED_VLLM = ((0, 32), (0, 34))
OVERRIDE_ENV = "MLA_PLUGINS_VLLM_OVERRIDE"
CPU_CHUNKED_ENV = "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL"
#: whole attention-backend slots the override switch can take (prefill slots are read from vLLM)
WHOLE_BACKEND_SLOTS = {
    "ROCM_AITER_MLA": ROCM_BACKEND_CLASS_PATH,
    "ROCM_AITER_TRITON_MLA": ROCM_TRITON_BACKEND_CLASS_PATH,
}

_lock = threading.Lock()
_done = False
_warned_version = False


def _version_tuple(text: str) -> tuple[int, int] | None:
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _supported(version: str) -> bool:
    vt = _version_tuple(version)
    return vt is not None and SUPPORTED_VLLM[0] <= vt < SUPPORTED_VLLM[1]


def register() -> None:
    """vLLM general-plugin entry point. Safe to call any number of times in any process."""
    global _done
    with _lock:
        if _done:
            return
        start = time.perf_counter()
        try:
            did = _register()
        except Exception:  # a plugin must never crash a vLLM that did not ask for it
            logger.exception("mla-plugins: registering with vLLM failed; vLLM runs without it")
            did = ["failed"]
        _done = True
        logger.debug(
            "mla-plugins registered with vLLM in %.1f ms: %s",
            1e3 * (time.perf_counter() - start), "; ".join(did) or "nothing",
        )


def _register() -> list[str]:
    global _warned_version
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    # by structure, not version: every release whose AiterMLAImpl binds _mla_reduce_v1
    did = install_aiter_shim()
    if not _supported(version):
        if not _warned_version:
            _warned_version = True
            lo, hi = SUPPORTED_VLLM
            logger.warning(
                "mla-plugins: found vLLM %s, expected >= %d.%d and < %d.%d for its MLA prefill "
                "backend and %s; neither is registered (install a supported vLLM or an "
                "mla-plugins release that supports %s). Only the AITER reduce shim applies, "
                "where this vLLM's AiterMLAImpl has the layout it knows.",
                version, *lo, *hi, OVERRIDE_ENV, version,
            )
        return did + [f"no prefill backend (vLLM {version} unsupported)"]
    did += _register_prefill_backend()
    did += _apply_overrides(os.environ.get(OVERRIDE_ENV, ""))
    if mla_plugins.env_flag(CPU_CHUNKED_ENV, False):  # one parser for every on/off variable
        did += _keep_cpu_chunked_prefill()
    return did


def _register_prefill_backend() -> list[str]:
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
        register_mla_prefill_backend,
    )

    did = []
    custom = MLAPrefillBackendEnum.CUSTOM
    if not custom.is_overridden():
        register_mla_prefill_backend(custom, PREFILL_CLASS_PATH)
        did.append("MLA prefill backend CUSTOM")
    elif custom.get_path() != PREFILL_CLASS_PATH:
        logger.warning(
            "mla-plugins: vLLM's MLA prefill backend CUSTOM is already taken by %s; "
            "select mla-plugins as %s instead", custom.get_path(), BACKEND_NAME,
        )
    if BACKEND_NAME not in MLAPrefillBackendEnum.__members__:
        register_mla_prefill_backend(BACKEND_NAME, PREFILL_CLASS_PATH)
        member = MLAPrefillBackendEnum[BACKEND_NAME]
        # Enum members pickle by value, and vLLM's spawned engine core unpickles its config
        # before it loads plugins, where the value is unknown ("... is not a valid
        # MLAPrefillBackendEnum"). Pickle this member by name through a function that
        # registers it first, so the name survives the multi-process engine.
        member.__reduce_ex__ = _reduce_prefill_member
        did.append(f"MLA prefill backend {BACKEND_NAME}")
    return did


def _reduce_prefill_member(protocol):
    return _restore_prefill_member, (BACKEND_NAME,)


def _restore_prefill_member(name: str):
    """Unpickle MLAPrefillBackendEnum.<name> in a process that may not have run register() yet."""
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum

    if name not in MLAPrefillBackendEnum.__members__:
        _register_prefill_backend()
    return MLAPrefillBackendEnum[name]


def _apply_overrides(raw: str) -> list[str]:
    """Take the built-in slots named in MLA_PLUGINS_VLLM_OVERRIDE (comma-separated)."""
    names = [n.strip().upper() for n in raw.split(",") if n.strip()]
    if not names:
        return []
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
        register_mla_prefill_backend,
    )

    prefill_slots = [n for n in MLAPrefillBackendEnum.__members__ if n not in ("CUSTOM", BACKEND_NAME)]
    did = []
    for name in names:
        if name in prefill_slots:
            register_mla_prefill_backend(MLAPrefillBackendEnum[name], PREFILL_CLASS_PATH)
            did.append(f"prefill slot {name}")
        elif name in WHOLE_BACKEND_SLOTS:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

            register_backend(AttentionBackendEnum[name], WHOLE_BACKEND_SLOTS[name])
            did.append(f"attention backend slot {name}")
        else:
            logger.warning(
                "mla-plugins: %s names %r, which is no slot it can take; expected MLA prefill "
                "slots %s or whole-backend slots %s", OVERRIDE_ENV, name, prefill_slots,
                sorted(WHOLE_BACKEND_SLOTS),
            )
    return did


def _keep_cpu_chunked_prefill() -> list[str]:
    """Wrap CpuPlatform.check_and_update_config so it keeps the user's chunked-prefill settings.

    vLLM 0.32 turns chunked prefill off (and raises max_num_batched_tokens to
    max_model_len) for MLA models on CPUs without AMX. The config is rebuilt, and this
    hook rerun, in the engine-core process too, which is why it is done in register().
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(original, "_mla_plugins_keeps_chunked_prefill", False):
        return []

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        sched = vllm_config.scheduler_config
        kept = (sched.enable_chunked_prefill, sched.max_num_batched_tokens)
        original(cls, vllm_config)
        model = vllm_config.model_config
        if model is not None and model.use_mla and kept[0] and not sched.enable_chunked_prefill:
            sched.enable_chunked_prefill, sched.max_num_batched_tokens = kept
            logger.info(
                "mla-plugins: %s=1 keeps chunked prefill on (max_num_batched_tokens=%d) for "
                "this MLA model on CPU", CPU_CHUNKED_ENV, kept[1],
            )

    check_and_update_config._mla_plugins_keeps_chunked_prefill = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return ["CPU chunked prefill kept for MLA"]


#: the module whose AiterMLAImpl binds `self._mla_reduce_v1` from aiter (vLLM 0.22 and later)
AITER_MLA_MODULE = "vllm.v1.attention.backends.mla.rocm_aiter_mla"

_shim_logged: set[str] = set()


def _log_once(key: str, level: int, msg: str, *args) -> None:
    if key not in _shim_logged:
        _shim_logged.add(key)
        logger.log(level, msg, *args)


def install_aiter_shim() -> list[str]:
    """Shim vLLM's AiterMLAImpl reduce call, by structure, on any vLLM version.

    Cheap and GPU-free: runs in every vLLM process (API server, engine core, workers). It
    neither imports aiter nor asks torch about the GPU (on ROCm that creates a HIP context and
    vLLM falls back from fork to spawn). It wraps `AiterMLAImpl.__init__` when vLLM imports
    its AITER MLA module (now, if it already has); the wrapper probes AITER only after
    vLLM's own `__init__` has imported it, i.e. in the process that builds the model.
    """
    if not mla_plugins.shim_enabled():
        return ["AITER shim off (MLA_PLUGINS_SHIM=0)"]
    if importlib.util.find_spec("aiter") is None:  # the common case: no probe, no cost
        return []
    done = mla_plugins.after_import(AITER_MLA_MODULE, _wrap_aiter_mla_impl,
                                    what="wrapping AiterMLAImpl for the AITER shim")
    return [done or f"AITER shim waits for {AITER_MLA_MODULE}"]


def _structure_mismatch(impl) -> str | None:
    """Why `impl` is not the AiterMLAImpl this shim knows, or None when it is.

    Known: `__init__` stores `self._mla_reduce_v1` (bound from aiter) and
    `_mla_fp8_prefill_attn` calls it: vLLM 0.22 through 0.33. Read from the bytecode's
    attribute names, so no version string is involved.
    """
    if not isinstance(impl, type):
        return "it has no class AiterMLAImpl"
    init = getattr(impl.__init__, "__wrapped__", impl.__init__)
    prefill = getattr(impl, "_mla_fp8_prefill_attn", None)
    for what, fn in (("__init__", init), ("_mla_fp8_prefill_attn", prefill)):
        code = getattr(fn, "__code__", None)
        if code is None or "_mla_reduce_v1" not in code.co_names:
            return f"AiterMLAImpl.{what} does not use self._mla_reduce_v1"
    return None


def _wrap_aiter_mla_impl(module) -> str:
    version = getattr(sys.modules.get("vllm"), "__version__", "unknown")
    impl = getattr(module, "AiterMLAImpl", None)
    why = _structure_mismatch(impl)
    if why is not None:
        _log_once("structure", logging.INFO,
                  "mla-plugins: vLLM %s's AITER MLA reduce call left as it is: %s in %s "
                  "(a layout this mla-plugins does not know)", version, why, AITER_MLA_MODULE)
        return f"AITER shim not installed ({why})"
    original = impl.__init__
    if getattr(original, "_mla_plugins_shim", False):
        return "AITER shim already on AiterMLAImpl"

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # vLLM binds _mla_reduce_v1 from aiter only when its FP8 prefill is enabled; its own
        # __init__ has imported aiter by then, so the probe below imports nothing new.
        if "_mla_reduce_v1" in self.__dict__:
            _bind_reduce(self, version)

    __init__._mla_plugins_shim = True
    impl.__init__ = __init__
    return "AITER shim on AiterMLAImpl.__init__"


def _bind_reduce(impl_obj, version: str) -> None:
    """Point the instance's `_mla_reduce_v1` at the drop-in when AITER's convention is known."""
    aiter = sys.modules.get("aiter")
    bound = impl_obj.__dict__["_mla_reduce_v1"]
    if bound is mla_plugins.aiter_mla_reduce_v1:
        return
    if aiter is None or bound is not getattr(aiter, "mla_reduce_v1", None):
        _log_once("foreign", logging.INFO,
                  "mla-plugins: vLLM %s's AiterMLAImpl._mla_reduce_v1 is %r, not aiter.mla_reduce_v1; "
                  "left as it is", version, bound)
        return
    status = mla_plugins.probe_aiter()
    if not status.usable:
        _log_once("unknown", logging.WARNING,
                  "mla-plugins: vLLM %s's AiterMLAImpl._mla_reduce_v1 left as vLLM bound it: %s",
                  version, status.reason)
        return
    impl_obj._mla_reduce_v1 = mla_plugins.aiter_mla_reduce_v1
    _log_once("bound", logging.INFO,
              "mla-plugins: found %s %s (%s); vLLM %s's AiterMLAImpl._mla_reduce_v1 now calls "
              "mla_plugins.aiter_mla_reduce_v1, which %s", status.distribution or "aiter",
              status.version or "", status.reason, version, status.action())
