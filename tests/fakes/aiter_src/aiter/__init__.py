"""Fake AMD AITER, written by tests/fakes/fake_aiter.py (see its docstring for the variants).

Mirrors the import-time behaviour of `aiter/__init__.py` (ROCm/aiter v0.1.16:60-101,
v0.1.20.post1:60-107): `AITER_AOT_IMPORT=1` imports only `aiter.jit.core`,
`AITER_TRITON_ONLY=1` (read from v0.1.16 on; v0.1.15.x has no such switch) imports no
C++/HIP op, and otherwise `from .ops.attention import *` registers the torch ops
`aiter::mla_reduce_v1`, `aiter::get_ps_metadata_v1` and `aiter::mla_prefill_ps_asm_fwd`
exactly as `torch_guard.torch_compile_guard` does.
"""

import logging
import os
import sys

import torch  # noqa: F401  (the real package imports torch first)

from . import _fake_config as _cfg
from ._kernels import all_calls, calls  # noqa: F401  (test hooks, not AITER API)

logger = logging.getLogger("aiter")

if _cfg.IMPORT_RAISES == "ImportError":
    raise ImportError(_cfg.IMPORT_MESSAGE)
if _cfg.IMPORT_RAISES == "SystemExit":
    raise SystemExit(_cfg.IMPORT_MESSAGE)

AITER_AOT_IMPORT = os.getenv("AITER_AOT_IMPORT", "0") == "1"
if _cfg.HAS_TRITON_ONLY_SWITCH:
    AITER_TRITON_ONLY = (
        os.getenv("AITER_TRITON_ONLY", _cfg.TRITON_ONLY_DEFAULT) == "1" or sys.platform == "win32"
    )
else:
    AITER_TRITON_ONLY = False

if AITER_TRITON_ONLY:
    logger.info("Triton ops only: CK and HIP ops (and their JIT build) are skipped.")
elif AITER_AOT_IMPORT:
    from .jit import core as core
else:
    from .jit import core as core
    from .ops.attention import *  # noqa: F403
