"""The kernel registry: built-ins and entry-point plugins on pluggy, and the dispatcher.

`kernel="auto"` takes the first kernel (by priority) that supports the inputs and logs
why the others did not: silent fallback. A pinned kernel (`kernel="triton"` or
MLA_PLUGINS_KERNEL=triton) that cannot run them raises one error listing every reason:
loud failure on request.

Third-party plugins are isolated from each other and from the built-ins: a plugin that
fails to import, whose hook raises or returns something else than a list of kernels, loses
its own kernels only (`load_errors`, one warning); a capability check that raises becomes
that kernel's rejection reason, naming its plugin; a third-party kernel cannot take the
name of a built-in one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

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


BUILTIN_PLUGIN = "builtin"


class KernelRegistry:
    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        from . import kernels as builtins

        self._pm.register(builtins, name=BUILTIN_PLUGIN)
        self._load_errors: dict[str, str] = {}
        if load_entry_points:
            self._load_entry_points()
        self._kernels: list[Kernel] | None = None
        #: kernel name -> name of the plugin that provided it
        self._providers: dict[str, str] = {}
        self._logged: set[tuple] = set()

    def _load_entry_points(self) -> None:
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self._pm.get_plugin(ep.name) is not None:
                continue
            try:
                self._pm.register(ep.load(), name=ep.name)
            except (Exception, SystemExit) as exc:  # the built-ins are registered already
                self._plugin_failed(ep.name, f"failed to load ({ep.value})", exc)

    @property
    def load_errors(self) -> dict[str, str]:
        """Plugin name -> error text, for plugins that failed to load or whose hook failed."""
        self.kernels()
        return self._load_errors

    def _plugin_failed(self, plugin: str, what: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        self._load_errors[plugin] = text
        logger.warning("kernel plugin %r %s: %s; its kernels are not used", plugin, what, text)

    def register(self, plugin, name: str | None = None) -> None:
        """Register a plugin object (module or instance with `mla_plugins_kernels`)."""
        self._pm.register(plugin, name=name)
        self._kernels = None

    def _collect(self) -> dict[str, Kernel]:
        """Call each plugin's hook on its own, so that one plugin that raises or returns
        something else than a list of kernels loses only its own kernels. The built-ins are
        collected first and their names cannot be taken; among third-party plugins the first
        registered keeps a name."""
        impls = self._pm.hook.mla_plugins_kernels.get_hookimpls()
        impls.sort(key=lambda impl: impl.plugin_name != BUILTIN_PLUGIN)  # stable
        found: dict[str, Kernel] = {}
        self._providers = {}
        for impl in impls:
            plugin = impl.plugin_name
            try:
                batch = impl.function()
            except (Exception, SystemExit) as exc:
                self._plugin_failed(plugin, "raised in mla_plugins_kernels()", exc)
                continue
            if batch is None:
                continue
            if not isinstance(batch, (list, tuple)):
                self._plugin_failed(
                    plugin, "returned no list from mla_plugins_kernels()",
                    f"found {type(batch).__name__} {batch!r:.80}, expected a list of "
                    "mla_plugins.Kernel instances",
                )
                continue
            for kernel in batch:
                problem = _kernel_problem(kernel)
                if problem:
                    self._plugin_failed(plugin, "returned an unusable kernel", problem)
                    continue
                if kernel.name in found:
                    owner = self._providers[kernel.name]
                    logger.warning(
                        "kernel plugin %r provides kernel name %r, which %s already provides; "
                        "keeping %s", plugin, kernel.name,
                        "mla-plugins" if owner == BUILTIN_PLUGIN else f"plugin {owner!r}",
                        "the built-in" if owner == BUILTIN_PLUGIN else "the first",
                    )
                    continue
                found[kernel.name] = kernel
                self._providers[kernel.name] = plugin
        return found

    def kernels(self) -> list[Kernel]:
        if self._kernels is None:
            found = self._collect()
            self._kernels = sorted(found.values(), key=lambda k: (k.priority, k.name))
        return self._kernels

    def provider(self, kernel: Kernel) -> str:
        """Name of the plugin that provided `kernel` ('builtin' for mla-plugins' own)."""
        self.kernels()
        return self._providers.get(kernel.name, "?")

    def reasons(self, kernel: Kernel, inputs: Inputs) -> list[str]:
        """`kernel.not_supported_reasons(inputs)`, where a check that raises or answers
        something else than a list of strings is itself the reason (naming the plugin)."""
        try:
            reasons = kernel.not_supported_reasons(inputs)
        except (Exception, SystemExit) as exc:
            return [
                f"its capability check raised {type(exc).__name__}: {exc} (kernel plugin "
                f"{self.provider(kernel)!r}; fix or uninstall that plugin)"
            ]
        if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
            return [
                f"its capability check returned {reasons!r:.80}, expected a list of str "
                f"(kernel plugin {self.provider(kernel)!r})"
            ]
        return list(reasons)

    def get(self, name: str, *, source: str = "kernel") -> Kernel:
        for kernel in self.kernels():
            if kernel.name == name:
                return kernel
        known = ", ".join(k.name for k in self.kernels())
        raise KernelNotSupportedError(
            f"{source}: found {name!r}, expected 'auto' or one of: {known}"
        )

    def select(self, inputs: Inputs, kernel: str = "auto") -> Kernel:
        if not isinstance(kernel, str):
            raise TypeError(f"kernel: found {type(kernel).__name__}, expected a kernel name (str)")
        name = kernel if kernel != "auto" else (pinned_kernel() or "auto")
        if name != "auto":
            chosen = self.get(name, source="kernel" if kernel != "auto" else "MLA_PLUGINS_KERNEL")
            reasons = self.reasons(chosen, inputs)
            if reasons:
                source = "kernel=" if kernel != "auto" else "MLA_PLUGINS_KERNEL="
                raise KernelNotSupportedError(
                    f"{source}{name!r} cannot run {describe(inputs)}: "
                    + "; ".join(reasons)
                    + ". Use kernel='auto' to fall back to a kernel that can."
                )
            return chosen
        return self.choose(inputs)[0]

    def choose(self, inputs: Inputs, kernel: str = "auto", *, allow_bf16: bool = False
               ) -> tuple[Kernel, bool]:
        """(kernel, fp8) for `inputs`: a pinned kernel (argument or MLA_PLUGINS_KERNEL) as
        `select` checks it, in the mode asked; kernel="auto" the fastest of the kernels that
        can run the inputs by the device's measured dispatch table (core/dispatch.py), in
        priority order without one. `allow_bf16`: an fp8 request may run in bf16 where bf16
        measured faster for the batch (the automatic choice only)."""
        name = kernel if kernel != "auto" else (pinned_kernel() or "auto")
        fp8 = bool(getattr(inputs, "fp8", False))
        if name != "auto":
            return self.select(inputs, kernel), fp8
        rejected: dict[str, list[str]] = {}
        fitting: list[Kernel] = []
        for candidate in self.kernels():
            reasons = self.reasons(candidate, inputs) or self.auto_reasons(candidate, inputs)
            if reasons:
                rejected[candidate.name] = reasons
            else:
                fitting.append(candidate)
        if not fitting:
            raise KernelNotSupportedError(
                f"no kernel can run {describe(inputs)}:\n"
                + "\n".join(f"  {n}: " + "; ".join(r) for n, r in rejected.items())
            )
        chosen, mode = fitting[0], fp8
        seqlens = getattr(inputs, "seqlens_host", None)
        if inputs.op in ("plan", "prefill") and seqlens is not None:
            from .dispatch import rank, table_for

            table = table_for(inputs.device)
            if table is not None:
                variants = [(k.name, fp8) for k in fitting]
                if fp8 and allow_bf16:
                    plain = replace(inputs, fp8=False)
                    variants += [(k.name, False) for k in self.kernels()
                                 if not (self.reasons(k, plain) or self.auto_reasons(k, plain))]
                from .fp8 import rotation_applies

                rotate = (inputs.fp8_rotate if inputs.op == "prefill"
                          else rotation_applies(inputs.head_dim_qk, None,
                                                inputs.fp8 and getattr(inputs, "fp8_outliers", False)))
                best = rank(table, *seqlens, inputs.num_heads, inputs.causal, variants, rotate)[0]
                chosen, mode = self.get(best[0]), best[1]
        self._log_choice(inputs, chosen, rejected, mode)
        return chosen, mode

    def rejections(self, inputs: Inputs) -> dict[str, list[str]]:
        """Every kernel's reasons against `inputs` ([] for the ones that can run them)."""
        return {k.name: self.reasons(k, inputs) or self.auto_reasons(k, inputs) for k in self.kernels()}

    def auto_reasons(self, kernel: Kernel, inputs: Inputs) -> list[str]:
        """Why kernel="auto" passes over a kernel that could run `inputs` if pinned
        (`Kernel.auto_reasons`; the Triton interpreter on a CPU, say)."""
        try:
            return list(kernel.auto_reasons(inputs))
        except (Exception, SystemExit) as exc:
            return [f"its auto_reasons() raised {type(exc).__name__}: {exc} (kernel plugin "
                    f"{self.provider(kernel)!r})"]

    def _log_choice(self, inputs: Inputs, chosen: Kernel, rejected: dict[str, list[str]],
                    fp8: bool | None = None) -> None:
        key = (inputs.op, chosen.name, describe(inputs), fp8)
        level = logging.DEBUG if key in self._logged else logging.INFO
        self._logged.add(key)
        skipped = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items()) or "none"
        mode = " in bf16 (measured faster than fp8 for this batch)" if (
            fp8 is False and getattr(inputs, "fp8", False)) else ""
        logger.log(level, "%s: using kernel %r%s for %s (skipped: %s)", inputs.op, chosen.name, mode,
                   describe(inputs), skipped)

    def infos(self, device) -> list[KernelInfo]:
        infos = []
        for k in self.kernels():
            try:
                info = k.info(device)
            except (Exception, SystemExit) as exc:
                info = KernelInfo(
                    k.name, False,
                    [f"its info() raised {type(exc).__name__}: {exc} (kernel plugin "
                     f"{self.provider(k)!r})"],
                )
            infos.append(info)
        return infos


def _kernel_problem(kernel) -> str | None:
    """Why `kernel` cannot be registered, or None."""
    if not isinstance(kernel, Kernel):
        return f"found {type(kernel).__name__} {kernel!r:.80}, expected an mla_plugins.Kernel instance"
    name = getattr(kernel, "name", None)
    if not isinstance(name, str) or not name.strip() or name == "auto":
        return f"found kernel name {name!r}, expected a non-empty str other than 'auto'"
    priority = getattr(kernel, "priority", None)
    if isinstance(priority, bool) or not isinstance(priority, (int, float)):
        return f"kernel {name!r}: found priority {priority!r}, expected a number"
    return None


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
