"""Fake of `fa3_fwd/_C.abi3.so` (PyPI fa3-fwd 0.0.3): importing it registers `fa3_fwd::fwd`.

The schema is the one extracted from the real library (tests/fakes/fa3/schemas.py
FA3_FWD_0_0_3: defaults and alias annotations as compiled); the body is FA3's `mha_fwd`
(tests/fakes/fa3/kernel.py, from hopper/flash_api.cpp 673-1197). The build flags the library
was compiled with are the ones its own `fa3_fwd_config.CONFIG` records (FP16, PAGEDKV, LOCAL and
BACKWARD disabled): an fp16 call fails with the real "This flash attention build does not
support FP16.". It also registers `get_scheduler_metadata` with the schema the real library
registers (schemas.py FA3_FWD_0_0_3_METADATA; body kernel.py's `scheduler_metadata`). The real
wheel also registers `fwd_combine`, which the provider does not call; not faked. The real kernel is
CUDA-only, Hopper-only and tiles its work (see kernel.py); this one runs on the CPU in float64.

Test hooks: `BUILD.legacy_empty_lse = True` makes rows that see no key get lse +inf, as FA3
before its 2025-01-07 refactor wrote; `BUILD.flags` is read at every call.
"""

import fa3_fwd_config

from tests.fakes.fa3 import kernel, schemas

BUILD = kernel.Build("fa3_fwd", schemas.FA3_FWD_0_0_3,
                     flags=dict(fa3_fwd_config.CONFIG["build_flags"]),
                     metadata_schema=schemas.FA3_FWD_0_0_3_METADATA)
kernel.register(BUILD)
