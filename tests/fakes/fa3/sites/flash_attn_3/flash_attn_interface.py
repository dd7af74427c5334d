"""Stand-in for FlashAttention-3's `flash_attn_interface.py` (hopper/, a top-level module:
setup.py 824 `py_modules=["flash_attn_interface", "flash_attn_config"]`).

Kept from the real file (lines 1-28, the CUDA branch): the import of `flash_attn_3._C`, which
registers the operators, and `flash_attn_3_gpu = torch.ops.flash_attn_3`. The real module then
defines the autograd wrappers over the custom ops `flash_attn_3::_flash_attn_forward` /
`_flash_attn_backward` (device_types="cuda": no CPU kernel); the provider binds the raw
`flash_attn_3::fwd` and never calls them. The ROCm branch (Triton through aiter) is not faked.
"""

import torch

# isort: off
# We need to import the CUDA kernels after importing torch
import flash_attn_3._C  # noqa: F401  Registers operators with PyTorch

# isort: on

flash_attn_3_gpu = torch.ops.flash_attn_3
