"""Stand-in for fa3-fwd 0.0.3's `fa3_fwd_interface.py` (its top-level module).

Kept from the real file (fa3_fwd_interface.py lines 1-15): the import of `fa3_fwd._C`, which
registers the operators, and `fa3_fwd_cuda = torch.ops.fa3_fwd`. The real module then defines
the autograd wrappers (`flash_attn_varlen_func` and friends over the custom ops
`fa3_fwd::_flash_attn_forward` / `_flash_attn_backward`, registered with device_types="cuda",
so they have no CPU kernel): the provider binds the raw `fa3_fwd::fwd` and never calls them.
`fa3_fwd` itself is a namespace package in the wheel (no __init__.py; RECORD lists
fa3_fwd/_C.abi3.so only), as here.
"""

import torch

# isort: off
# We need to import the CUDA kernels after importing torch
import fa3_fwd._C  # noqa: F401  Registers operators with PyTorch

# isort: on

fa3_fwd_cuda = torch.ops.fa3_fwd
