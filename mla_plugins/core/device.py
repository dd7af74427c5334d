"""What kind of device a tensor lives on, and what that implies (fp8 format, worker count)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

#: KFD's topology: one directory per node (CPUs have gfx_target_version 0)
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")

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


def _gfx_name(target_version: int) -> str:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) as a gfx name:
    90402 -> gfx942, 90500 -> gfx950, 110000 -> gfx1100."""
    major, rest = divmod(target_version, 10000)
    minor, step = divmod(rest, 100)
    return f"gfx{major}{minor:x}{step:x}"


def _kfd_archs(nodes: Path = KFD_NODES) -> list[str]:
    """gfx names of the GPU nodes, in node order (what ROCr enumerates), from sysfs."""
    found = []
    try:
        entries = sorted(nodes.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    except OSError:
        return []
    for node in entries:
        try:
            text = (node / "properties").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "gfx_target_version" and value.strip().isdigit() and int(value) > 0:
                found.append(_gfx_name(int(value)))
    return found


def _visible(archs: list[str]) -> list[str]:
    """Apply ROCR/HIP/CUDA_VISIBLE_DEVICES (plain index lists) in the order ROCm does."""
    for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value is None:
            continue
        picks = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdigit() for p in picks):
            return []  # UUIDs or other forms: leave it to the runtime
        archs = [archs[int(p)] for p in picks if int(p) < len(archs)]
    return archs


def _amdsmi_archs() -> list[str]:
    try:
        import amdsmi
    except Exception:  # noqa: BLE001  absent or broken: sysfs or the runtime decides
        return []
    try:
        amdsmi.amdsmi_init()
        try:
            return [str(amdsmi.amdsmi_get_gpu_asic_info(h).get("target_graphics_version", ""))
                    for h in amdsmi.amdsmi_get_processor_handles()]
        finally:
            amdsmi.amdsmi_shut_down()
    except Exception:  # noqa: BLE001
        return []


@functools.cache
def gcn_arch_no_context(index: int = 0) -> str | None:
    """The gfx name of ROCm device `index` read without creating a HIP context (KFD sysfs,
    then amdsmi), or None where neither answers (or off ROCm). When every GPU has the same
    arch (the usual node) the visible-devices mapping does not matter."""
    if not torch.version.hip:
        return None
    for archs in (_kfd_archs(), _amdsmi_archs()):
        archs = [a for a in archs if a.startswith("gfx")]
        if not archs:
            continue
        if len(set(archs)) == 1:
            return archs[0]
        visible = _visible(archs)
        if index < len(visible):
            return visible[index]
    return None


@functools.cache
def gcn_arch(index: int = 0) -> str | None:
    """The gfx name of a ROCm device ('gfx942', 'gfx950'), or None off ROCm.

    Read without a HIP context where possible; only then from torch, which creates one
    (callers: kernel capability checks, in the process that runs kernels).
    """
    if not torch.version.hip:
        return None
    arch = gcn_arch_no_context(index)
    if arch is not None:
        return arch
    if not torch.cuda.is_available():
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
