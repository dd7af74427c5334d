"""Fake of `flash_attn_3/_C*.so`, the extension FlashAttention-3's hopper/setup.py builds
(`CUDAExtension(name=f"{PACKAGE_NAME}._C")`, setup.py 691-693): importing it registers
`flash_attn_3::fwd` (flash_api.cpp 1673-1708, `TORCH_LIBRARY(flash_attn_3, m)`), schema verbatim
(tests/fakes/fa3/schemas.py FA3_HEAD), body FA3's `mha_fwd` (tests/fakes/fa3/kernel.py).

Build flags: those `flash_attn_config.CONFIG` records (setup.py 102-131 writes it from the same
FLASH_ATTENTION_DISABLE_* variables the compile flags come from; a default build disables
nothing). It also registers `get_scheduler_metadata` (flash_api.cpp 1737-1761, schemas.py
FA3_HEAD_METADATA; body kernel.py's `scheduler_metadata`). The real build also registers `bwd`
and `fwd_combine` (flash_api.cpp 1709-1736), not faked. What the real kernel adds: see kernel.py.
"""

import flash_attn_config

from tests.fakes.fa3 import kernel, schemas

BUILD = kernel.Build("flash_attn_3", schemas.FA3_HEAD,
                     flags=dict(flash_attn_config.CONFIG["build_flags"]),
                     metadata_schema=schemas.FA3_HEAD_METADATA)
kernel.register(BUILD)
