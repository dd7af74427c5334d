"""What kind of device a tensor lives on, and what that implies (fp8 format, worker count)."""

from __future__ import annotations

import functools

import torch

#: Workers assumed on the CPU, where there are no multiprocessors to count. Six keeps the
#: per-item overhead low, and with the usual head counts (16, 128) it leaves three workers
#: per cluster, so tiles split and the reduce path runs on the CPU too.
CPU_WORKERS = 6


def device_kind(device: torch.device | str) -> str:
    """'cpu', 'cuda' (NVIDIA) or 'rocm' (AMD, torch built with HIP); other types verbatim."""
    device = torch.device(device)
    if device.type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    return device.type


@functools.cache
def gcn_arch(index: int = 0) -> str | None:
    """The gfx name of a ROCm device ('gfx942', 'gfx950'), or None off ROCm."""
    if not torch.version.hip or not torch.cuda.is_available():
        return None
    name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
    return name.split(":")[0] or None


def device_arch(device: torch.device | str) -> str | None:
    """gfx name on ROCm, 'sm_XY' on NVIDIA, None on the CPU."""
    device = torch.device(device)
    kind = device_kind(device)
    index = device.index if device.index is not None else 0
    if kind == "rocm":
        return gcn_arch(index)
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability(index)
        return f"sm_{major}{minor}"
    return None


def fp8_dtype_for(device: torch.device | str) -> torch.dtype:
    """The float8 format the device computes in: e4m3fnuz on gfx942 (MI300), e4m3fn elsewhere."""
    if device_kind(device) == "rocm" and device_arch(device) == "gfx942":
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_workers(device: torch.device | str) -> int:
    """Multiprocessor (SM / CU) count of a GPU; CPU_WORKERS on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_WORKERS
