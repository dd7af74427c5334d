"""Install advice that is right for the torch at hand (CUDA, ROCm or CPU build).

On CUDA, PyPI's torch wheels depend on a matching `triton`; on ROCm, torch's Triton is the
`pytorch-triton-rocm` distribution (module name `triton`), which PyPI's CUDA `triton` would
replace; a CPU build of torch has no GPU for Triton to compile for.
"""

from __future__ import annotations

import torch


def torch_platform() -> str:
    """'rocm', 'cuda' or 'cpu': what this torch was built for (not whether a GPU is visible)."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    if getattr(torch.version, "cuda", None):
        return "cuda"
    return "cpu"


def triton_install_hint() -> str:
    platform = torch_platform()
    if platform == "rocm":
        rocm = ".".join(str(torch.version.hip).split(".")[:2])
        return (
            "ROCm: install the Triton built for this torch, pytorch-triton-rocm, from the PyTorch "
            f"index (pip install pytorch-triton-rocm --index-url https://download.pytorch.org/whl/rocm{rocm}); "
            "not 'mla-plugins[triton]': PyPI's triton is the CUDA build and replaces it"
        )
    if platform == "cuda":
        return (
            "CUDA: PyPI's torch wheels bring a matching triton; reinstall torch or "
            "pip install 'mla-plugins[triton]'"
        )
    return (
        f"this torch ({torch.__version__}) is a CPU build: Triton needs a CUDA or ROCm torch; "
        "the torch kernel runs here"
    )
