"""Launching the Triton kernels of a plan again without Triton's per-launch binder.

Triton's `kernel[grid](...)` costs 16-44 µs of host time per launch on the H200 machines
(benchmarks: the binder re-derives every argument's specialization, builds tensor
descriptors, looks the kernel up); a prefill is 2-3 launches per layer. But a plan fixes
almost everything a launch needs: grid, strides of the workspace buffers, work_info, the
compiled kernel. So the first call of a plan runs the ordinary host code (`run_prefill`,
the reduce) while a `Recorder` notes each launch: the compiled kernel, the grid and the
final argument list its C launcher takes. Later calls replay that list, substituting only
the pointers of the call's own tensors (q, k, v, out, lse) and rebuilding the TMA
descriptors that point into them; everything else is constant.

A recording is only used when that is safe, else the call keeps the ordinary path:
- every tensor a launch takes lies in the call's tensors, the workspace or the plan's own
  buffers (a temporary allocated by the host code would be freed after the first call);
- the host code ran no torch operation on the GPU between launches (a fill or copy would
  be skipped by the replay);
- the kernels need no global scratch from Triton's allocator, and the C launcher is the one
  this module knows (Triton 3.x on CUDA);
- a later call must match the recorded one in everything the host code decided from: the
  dtypes, strides and 16-byte alignment of its tensors, the softmax scale, the mode.

Replaying is capturable in a CUDA graph like the ordinary launches are.
"""

from __future__ import annotations

import inspect
import logging
import threading

import torch

logger = logging.getLogger("mla_plugins.core.kernels.triton_launch")

#: tests and benchmarks switch replays off to compare with the ordinary path
ENABLED = True

_local = threading.local()
_wrapped: set[int] = set()
_wrap_lock = threading.Lock()


class _NotReplayable(Exception):
    pass


def wrap_kernels(*modules) -> None:
    """Route the launches of the JIT functions in `modules` through the recorder (once)."""
    with _wrap_lock:
        for module in modules:
            for value in list(vars(module).values()):
                if not (hasattr(value, "device_caches") and hasattr(value, "run")
                        and callable(getattr(value, "run", None))):
                    continue
                if id(value) in _wrapped:
                    continue
                _wrapped.add(id(value))
                value.run = _recording_run(value, value.run)


def _recording_run(jit_fn, original):
    def run(*args, grid, warmup, **kwargs):
        kernel = original(*args, grid=grid, warmup=warmup, **kwargs)
        recorder = getattr(_local, "recorder", None)
        if recorder is not None and not warmup:
            recorder.note(jit_fn, kernel, grid, args, kwargs)
        return kernel

    run.__wrapped__ = original
    return run


class _Desc:
    """What `make_tensordesc_arg` reads of a TensorDescriptor, with a substituted base."""

    __slots__ = ("base", "padding", "shape", "strides")

    def __init__(self, base, shape, strides, padding):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


class _Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class Launch:
    """One recorded launch: the C launcher and its arguments, pointers to substitute."""

    __slots__ = ("coop", "descs", "function", "grid", "launch", "metadata", "pdl", "slots", "template")

    def __init__(self, launch, function, metadata, grid, coop, pdl, template, slots, descs):
        self.launch, self.function, self.metadata, self.grid = launch, function, metadata, grid
        self.coop, self.pdl, self.template, self.slots, self.descs = coop, pdl, template, slots, descs

    def __call__(self, stream: int, ptrs: dict[str, int]) -> None:
        args = self.template.copy() if (self.slots or self.descs) else self.template
        for index, name, offset in self.slots:
            args[index] = ptrs[name] + offset
        for desc in self.descs:
            index, name, offset, shape, strides, padding, meta, make, last = desc
            ptr = ptrs[name] + offset
            if last[0] == ptr:  # the caching allocator often hands a layer the same address
                expanded = last[1]
            else:
                expanded = make(_Desc(_Ptr(ptr), shape, strides, padding), meta)
                if expanded and hasattr(expanded[0], "data_ptr") and not isinstance(expanded[0], int):
                    expanded[0] = expanded[0].data_ptr()
                last[0], last[1] = ptr, expanded
            args[index : index + len(expanded)] = expanded
        g = self.grid
        self.launch(g[0], g[1], g[2], stream, self.function, self.coop, self.pdl, None, None,
                    self.metadata, None, None, None, *args)


class Recorder:
    """Notes the launches of one ordinary call, then turns them into a `Replay`."""

    def __init__(self, varying: dict[str, torch.Tensor | None], constant: list[torch.Tensor]) -> None:
        self.varying = {n: t for n, t in varying.items() if t is not None}
        self.constant = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                         for t in constant if t is not None]
        self.notes: list = []
        self.problem: str | None = None
        self._mode = None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if recorder.problem is None and not _harmless(func, args, kwargs):
                    recorder.problem = f"a torch operation on the GPU between launches ({func})"
                return func(*args, **kwargs)

        self._mode = _Watch()
        self._mode.__enter__()
        _local.recorder = self
        return self

    def __exit__(self, *exc):
        _local.recorder = None
        self._mode.__exit__(*exc)
        return False

    def note(self, jit_fn, kernel, grid, args, kwargs) -> None:
        if self.problem is not None:
            return
        try:
            self.notes.append(self._launch(jit_fn, kernel, grid, args, kwargs))
        except _NotReplayable as exc:
            self.problem = str(exc)
        except Exception as exc:  # an unknown Triton: keep the ordinary path
            self.problem = f"{type(exc).__name__}: {exc}"

    def replay(self) -> Replay | None:
        if self.problem is not None or not self.notes:
            logger.debug("launches not replayable, ordinary path kept: %s", self.problem or "none recorded")
            return None
        return Replay(self.notes)

    # -- one launch ----------------------------------------------------------------------
    def _where(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(name, byte offset) of a call tensor holding t's data, None for a constant one."""
        ptr = t.data_ptr()
        if t.numel() == 0:
            return None
        for name, base in self.varying.items():
            if ptr == base.data_ptr():
                return name, 0
        for name, base in self.varying.items():
            if base.numel() and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                raise _NotReplayable(f"a launch argument inside {name} but not {name} itself")
        for start, size in self.constant:
            if start <= ptr < start + size:
                return None
        raise _NotReplayable(f"a launch argument ({tuple(t.shape)} {t.dtype}) outside the "
                             "call's tensors, the workspace and the plan")

    def _launch(self, jit_fn, kernel, grid, args, kwargs) -> Launch:
        from triton.backends.nvidia import driver as nv
        from triton.runtime.driver import driver

        if hasattr(kernel, "result"):
            kernel = kernel.result()
        launcher = kernel.run
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            raise _NotReplayable("the kernel needs Triton's global scratch")
        device = driver.active.get_current_device()
        binder = jit_fn.device_caches[device][4]
        bound = binder(*args, **kwargs)[0]
        values = list(bound.values())
        if callable(grid):
            grid = grid(bound)
        grid = (tuple(grid) + (1, 1))[:3]
        launch = launcher.launch
        desc_meta = None
        if getattr(launch, "__closure__", None):  # wrap_handle_tensordesc's inner(): unwrap it
            cells = inspect.getclosurevars(launch).nonlocals
            launch, desc_meta = cells["launcher"], list(cells["tensordesc_meta"])
        signature = list(kernel.src.signature.values())
        if len(signature) != len(values):
            raise _NotReplayable("signature and arguments differ in length")
        template, slots, descs = [], [], []
        desc_index = 0
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc_types = (TensorDescriptor,)
        try:  # Gluon's host descriptor: the same fields make_tensordesc_arg reads
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

            desc_types += (GluonDescriptor,)
        except ImportError:  # pragma: no cover - a Triton without Gluon
            pass

        for sig, value in zip(signature, values, strict=True):
            if isinstance(sig, str) and sig.startswith("tensordesc"):
                if not isinstance(value, desc_types):
                    raise _NotReplayable("a tensordesc argument that is no host TensorDescriptor")
                meta = desc_meta[desc_index] if desc_meta else None
                desc_index += 1
                expanded = nv.make_tensordesc_arg(value, meta)
                where = self._where(value.base)
                if expanded and isinstance(expanded[0], torch.Tensor):
                    expanded[0] = expanded[0].data_ptr()
                if where is not None:
                    descs.append((len(template), where[0], where[1], list(value.shape),
                                  list(value.strides), value.padding, meta, nv.make_tensordesc_arg,
                                  [None, None]))
                template.extend(expanded)
            elif isinstance(value, torch.Tensor):
                where = self._where(value)
                if where is not None:
                    slots.append((len(template), where[0], where[1]))
                template.append(value.data_ptr())
            else:
                template.append(value)
        return Launch(launch, kernel.function, kernel.packed_metadata, grid,
                      launcher.launch_cooperative_grid, launcher.launch_pdl, template, slots, descs)


class Replay:
    """The launches of one call of a plan, to run again on other tensors of the same layout."""

    __slots__ = ("launches",)

    def __init__(self, launches: list[Launch]) -> None:
        self.launches = launches

    def __call__(self, device_index: int, ptrs: dict[str, int]) -> None:
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        for launch in self.launches:
            launch(stream, ptrs)


#: aten ops that move no data: the host code may run them between launches
def _harmless(func, args, kwargs) -> bool:
    if getattr(func, "is_view", False):
        return True
    name = func.__name__ if hasattr(func, "__name__") else str(func)
    if name.split(".")[0] in ("empty", "empty_strided", "new_empty", "new_empty_strided", "detach",
                              "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel",
                              "sym_storage_offset", "is_same_size"):
        return True
    # work on host tensors only decides things on the host (plan data): not replayed, not needed
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                return False
    return True


def alignment(t: torch.Tensor | None):
    return None if t is None else (t.data_ptr() % 16 == 0)


__all__ = ["ENABLED", "Recorder", "Replay", "alignment", "wrap_kernels"]
