"""Scratch memory of the prefill: one buffer per device, reused across calls and layers.

A run needs scratch (split-KV partial buffers, the fp8 copies of k and v, ...): its kernel
describes it as named regions (`Kernel.workspace_layout`), `plan.workspace_bytes` says how
many bytes the plan's kernel needs, and `carve` cuts the regions out of one uint8 buffer.
Without a `workspace=` argument `mla_prefill` takes the device's shared buffer, which grows
(never shrinks) when a larger batch comes: a framework sizes it once (`reserve`) for its
largest batch, or hands over a buffer of its own memory manager (`set_workspace`), so that
its memory profile counts it. Views into the buffer are made once per plan, not per call.

The shared buffer is meant for one stream per device (as the frameworks run their layers):
calls on two streams at once must pass a workspace each. Growth allocates, so warm a plan up
once (or `reserve`) before capturing its calls in a CUDA graph.
"""

from __future__ import annotations

import itertools
import logging
import threading

import torch

logger = logging.getLogger("mla_plugins.core.workspace")

#: every region starts at a multiple of this (TMA and vector loads want 16 bytes; 256
#: keeps regions on their own cache lines)
ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def workspace_size(layout) -> int:
    """Bytes a layout [(name, shape, dtype), ...] takes, regions aligned to ALIGN."""
    return sum(_aligned(_nbytes(shape, dtype)) for _, shape, dtype in layout)


def carve(buffer: torch.Tensor, layout, *, name: str = "workspace",
          device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Views of `buffer` (uint8, 1-D) by region name, laid out as `workspace_size` counts."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        found = (f"{type(buffer).__name__}" if not isinstance(buffer, torch.Tensor)
                 else f"{buffer.dtype} {tuple(buffer.shape)}")
        raise TypeError(f"{name}: found {found}, expected a 1-D torch.uint8 tensor")
    if device is not None and buffer.device != device:
        raise ValueError(f"{name}: found device {buffer.device}, expected {device} (q's device)")
    if not buffer.is_contiguous():
        raise ValueError(f"{name}: found a non-contiguous tensor, expected a contiguous uint8 buffer")
    # regions are placed from the first ALIGN-aligned address of the buffer
    offset = (-buffer.data_ptr()) % ALIGN
    need = workspace_size(layout)
    if buffer.numel() < need + offset:
        raise ValueError(
            f"{name}: found {buffer.numel()} bytes, expected at least {need + offset} "
            f"(plan.workspace_bytes for the plan's kernel and compute mode, {need}, plus "
            f"{offset} to reach a {ALIGN}-byte aligned start)"
        )
    views = {}
    for region, shape, dtype in layout:
        n = _nbytes(shape, dtype)
        views[region] = buffer[offset : offset + n].view(dtype).view(shape)
        offset += _aligned(n)
    return views


class Workspace:
    """The shared scratch of one device, grown when a call needs more."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None
        #: bumped on every reallocation: views made before are of the previous buffer
        self.generation = 0
        self._own = True

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` from an aligned start (the same one while it suffices)."""
        if self.buffer is None or self.buffer.numel() < nbytes + (-self.buffer.data_ptr()) % ALIGN:
            self._grow(nbytes)
        return self.buffer

    def _grow(self, nbytes: int) -> None:
        old = 0 if self.buffer is None else self.buffer.numel()
        # a quarter more than asked, so a run of slowly growing batches reallocates rarely
        size = _aligned(max(nbytes + nbytes // 4, ALIGN)) + ALIGN  # + room to align the start
        if old and not self._own:
            logger.info("workspace on %s: %d bytes given by set_workspace, %d needed: growing "
                        "past it with an allocation of our own", self.device, old, nbytes)
        if torch.cuda.is_available() and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            logger.warning("workspace on %s grows inside a CUDA graph capture (%d -> %d bytes); "
                           "reserve() it before capturing", self.device, old, size)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.generation += 1
        self._own = True


_workspaces: dict[torch.device, Workspace] = {}
_lock = threading.Lock()
_tokens = itertools.count(1)


def next_token() -> int:
    """A number never handed out before (names one carving of a workspace)."""
    return next(_tokens)


def carve_views(layout, workspace: torch.Tensor | None, device: torch.device):
    """(shared workspace or None, its generation, views of `layout`): from the caller's
    `workspace` buffer when given, else from the device's shared one (grown as needed)."""
    if workspace is not None:
        return None, 0, carve(workspace, layout, name="workspace", device=device)
    shared = get_workspace(device)
    views = carve(shared.get(workspace_size(layout)), layout)
    return shared, shared.generation, views


def get_workspace(device: torch.device | str) -> Workspace:
    """The shared workspace of `device` (created empty on first use)."""
    device = torch.device(device)
    ws = _workspaces.get(device)
    if ws is None:
        with _lock:
            ws = _workspaces.setdefault(device, Workspace(device))
    return ws


def reserve(device: torch.device | str, nbytes: int) -> torch.Tensor:
    """Grow the shared workspace of `device` to at least `nbytes` now (e.g. at start-up, for
    the largest batch: `plan_prefill(...).workspace_bytes`), so no call allocates later."""
    return get_workspace(device).get(int(nbytes))


def set_workspace(device: torch.device | str, buffer: torch.Tensor) -> None:
    """Use `buffer` (uint8, 1-D, on `device`) as the shared workspace of `device`: memory a
    framework's own manager handed out. Calls that need more grow past it (logged)."""
    device = torch.device(device)
    carve(buffer, [], device=device)
    ws = get_workspace(device)
    ws.buffer = buffer
    ws.generation += 1
    ws._own = False


def release(device: torch.device | str | None = None) -> None:
    """Drop the shared workspace of `device` (every device when None)."""
    with _lock:
        for d in list(_workspaces):
            if device is None or d == torch.device(device):
                ws = _workspaces.pop(d)
                ws.generation += 1  # plans holding views of it make new ones


__all__ = ["ALIGN", "Workspace", "carve", "get_workspace", "next_token", "release", "reserve",
           "set_workspace", "workspace_size"]
