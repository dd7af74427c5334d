"""Fake of `sgl_kernel/flash_ops.abi3.so` (sglang-kernel 0.4.10, the release SGLang 0.5.23 pins):
importing it registers `sgl_kernel::fwd` with the schema extracted from the compiled library
(tests/fakes/fa3/schemas.py SGL_KERNEL_0_4_10: no defaults at all, `Tensor(a!)? out`, and
`sinks`, `sparse_mask_fine`, `only_qv` after `sm_margin`), body FA3's `mha_fwd`
(tests/fakes/fa3/kernel.py). sgl-kernel ships no build-flag module: flags unknown, none
modelled. It also registers `get_scheduler_metadata` with the schema the real library
registers (schemas.py SGL_KERNEL_0_4_10_METADATA; body kernel.py's `scheduler_metadata`, laid
out as FA3's: sgl-flash-attn's sgl-kernel branch, hopper/flash_api.cpp 971-984, the newest
source of that fork to read; the wheel's own commit is newer). sgl-kernel's FA3 also runs on sm80/86/89 (flash_attn.py `is_fa3_supported`); its
fp8 and different-V-head-dim kernels are sm_90 only. What the real kernel adds: see kernel.py.
"""

from tests.fakes.fa3 import kernel, schemas

BUILD = kernel.Build("sgl_kernel", schemas.SGL_KERNEL_0_4_10,
                     metadata_schema=schemas.SGL_KERNEL_0_4_10_METADATA)
kernel.register(BUILD)
