"""The kernel registry: built-ins and entry-point plugins on pluggy, and the dispatcher.

`kernel="auto"` takes the first kernel (by priority) that supports the inputs and logs
why the others did not: silent fallback. A pinned kernel (`kernel="triton"` or
MLA_PLUGINS_KERNEL=triton) that cannot run them raises one error listing every reason:
loud failure on request.
"""

from __future__ import annotations

import logging
import threading

import pluggy

from . import hookspecs
from .kernels.base import Inputs, Kernel, KernelInfo
from .settings import pinned_kernel

try:  # the backport follows the newest entry-point API on every Python
    import importlib_metadata
except ImportError:  # pragma: no cover - stdlib fallback where the backport is absent
    import importlib.metadata as importlib_metadata

logger = logging.getLogger("mla_plugins.registry")

ENTRY_POINT_GROUP = "mla_plugins.kernels"


class KernelNotSupportedError(ValueError):
    """No kernel (or not the pinned one) can run the given inputs; the message lists why."""


class KernelRegistry:
    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        from . import kernels as builtins

        self._pm.register(builtins, name="builtin")
        #: entry point name -> error text, for plugins that failed to load
        self.load_errors: dict[str, str] = {}
        if load_entry_points:
            self._load_entry_points()
        self._kernels: list[Kernel] | None = None
        self._logged: set[tuple] = set()

    def _load_entry_points(self) -> None:
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self._pm.get_plugin(ep.name) is not None:
                continue
            try:
                self._pm.register(ep.load(), name=ep.name)
            except Exception as exc:  # a broken third-party plugin must not take the built-ins down
                self.load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
                logger.warning("kernel plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)

    def register(self, plugin, name: str | None = None) -> None:
        """Register a plugin object (module or instance with `mla_plugins_kernels`)."""
        self._pm.register(plugin, name=name)
        self._kernels = None

    def kernels(self) -> list[Kernel]:
        if self._kernels is None:
            found: dict[str, Kernel] = {}
            for batch in self._pm.hook.mla_plugins_kernels():
                for kernel in batch or []:
                    if kernel.name in found:
                        logger.warning("kernel name %r is provided twice; keeping the first", kernel.name)
                        continue
                    found[kernel.name] = kernel
            self._kernels = sorted(found.values(), key=lambda k: (k.priority, k.name))
        return self._kernels

    def get(self, name: str) -> Kernel:
        for kernel in self.kernels():
            if kernel.name == name:
                return kernel
        known = ", ".join(k.name for k in self.kernels())
        raise KernelNotSupportedError(
            f"kernel: found {name!r}, expected 'auto' or one of: {known}"
        )

    def select(self, inputs: Inputs, kernel: str = "auto") -> Kernel:
        if not isinstance(kernel, str):
            raise TypeError(f"kernel: found {type(kernel).__name__}, expected a kernel name (str)")
        name = kernel if kernel != "auto" else (pinned_kernel() or "auto")
        if name != "auto":
            chosen = self.get(name)
            reasons = chosen.not_supported_reasons(inputs)
            if reasons:
                source = "kernel=" if kernel != "auto" else "MLA_PLUGINS_KERNEL="
                raise KernelNotSupportedError(
                    f"{source}{name!r} cannot run {describe(inputs)}: "
                    + "; ".join(reasons)
                    + ". Use kernel='auto' to fall back to a kernel that can."
                )
            return chosen
        rejected: dict[str, list[str]] = {}
        for candidate in self.kernels():
            reasons = candidate.not_supported_reasons(inputs)
            if not reasons:
                self._log_choice(inputs, candidate, rejected)
                return candidate
            rejected[candidate.name] = reasons
        raise KernelNotSupportedError(
            f"no kernel can run {describe(inputs)}:\n"
            + "\n".join(f"  {n}: " + "; ".join(r) for n, r in rejected.items())
        )

    def rejections(self, inputs: Inputs) -> dict[str, list[str]]:
        """Every kernel's reasons against `inputs` ([] for the ones that can run them)."""
        return {k.name: k.not_supported_reasons(inputs) for k in self.kernels()}

    def _log_choice(self, inputs: Inputs, chosen: Kernel, rejected: dict[str, list[str]]) -> None:
        key = (inputs.op, chosen.name, describe(inputs))
        level = logging.DEBUG if key in self._logged else logging.INFO
        self._logged.add(key)
        skipped = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items()) or "none"
        logger.log(level, "%s: using kernel %r for %s (skipped: %s)", inputs.op, chosen.name, describe(inputs), skipped)

    def infos(self, device) -> list[KernelInfo]:
        return [k.info(device) for k in self.kernels()]


def describe(inputs: Inputs) -> str:
    parts = [f"{inputs.op} on {inputs.device}", f"dtype {str(inputs.dtype).removeprefix('torch.')}",
             f"{inputs.num_heads} heads"]
    if inputs.op != "reduce":
        parts.append(f"head dims {inputs.head_dim_qk}/{inputs.head_dim_v}")
        parts.append("fp8" if inputs.fp8 else "no fp8")
    else:
        parts.append(f"value head dim {inputs.head_dim_v}")
    return "(" + ", ".join(parts) + ")"


_registry: KernelRegistry | None = None
_lock = threading.Lock()


def get_registry() -> KernelRegistry:
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                _registry = KernelRegistry()
    return _registry


def reset_registry() -> None:
    """Forget the registry so the next call rediscovers plugins (tests, after installs)."""
    global _registry
    with _lock:
        _registry = None
