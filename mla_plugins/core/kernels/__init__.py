"""Built-in kernel providers: AITER (ROCm gfx950), FlashAttention-3 (Hopper, where the process
has one), Triton (CUDA, ROCm), torch (anywhere).

Each provider module is importable without its library; availability is a runtime answer
of `not_supported_reasons`, never an import error.
"""

from __future__ import annotations

import pluggy

from ..hookspecs import PROJECT_NAME
from .base import ConfigInputs, Kernel, KernelInfo, PrefillInputs, ReduceInputs

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookimpl
def mla_plugins_kernels() -> list[Kernel]:
    from .aiter_kernel import AiterKernel
    from .flash_attn import FlashAttnKernel
    from .torch_kernel import TorchKernel
    from .triton_kernel import TritonKernel

    return [AiterKernel(), FlashAttnKernel(), TritonKernel(), TorchKernel()]


__all__ = ["ConfigInputs", "Kernel", "KernelInfo", "PrefillInputs", "ReduceInputs", "hookimpl"]
