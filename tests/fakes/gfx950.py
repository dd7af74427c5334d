"""What a ROCm gfx950 (MI355X) host answers where vLLM's ROCm code asks, for the CPU tests
that run vLLM's real AITER classes: the GPU's properties, vLLM's GPU op libraries (empty
modules: the CPU wheel's own `vllm._C` dies with SIGILL beside them, and the CUDA build's
does not load beside the CPU torch) and, from vLLM 0.33, the platform's compute-unit count.
"""

from __future__ import annotations

import sys
import types

#: torch.cuda.get_device_properties on an MI355X (vllm.platforms.rocm reads gcnArchName)
PROPS = types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-", name="AMD Instinct MI355X",
                              major=9, minor=5, total_memory=288 << 30, multi_processor_count=256)
#: the op libraries vllm.platforms.rocm / .cuda import for their side effects
VLLM_GPU_LIBRARIES = ("vllm._C", "vllm._C_stable_libtorch", "vllm._rocm_C")


def stand_in() -> list:
    """Patch torch.cuda.get_device_properties to answer PROPS and put empty modules in place
    of VLLM_GPU_LIBRARIES, before vLLM is imported. Returns the list that records each
    properties query (its positional arguments)."""
    import torch

    queries = []

    def get_device_properties(*args, **kwargs):
        queries.append(args)
        return PROPS

    torch.cuda.get_device_properties = get_device_properties
    for name in VLLM_GPU_LIBRARIES:
        sys.modules[name] = types.ModuleType(name)
    return queries


def answer_compute_units() -> None:
    """vLLM 0.33's AiterMLAImpl.__init__ calls current_platform.num_compute_units(): answer as
    vLLM's ROCm platform does (platforms/rocm.py: the device's multi_processor_count), not as
    the CPU platform the test runs on (its thread count). Call it after plugins are loaded
    (it resolves vLLM's current platform)."""
    import torch
    from vllm.platforms import current_platform

    current_platform.num_compute_units = (
        lambda device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count)
