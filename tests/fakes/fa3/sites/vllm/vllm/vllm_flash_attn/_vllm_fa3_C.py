"""Fake of `vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so` (vLLM's FA3 build, vllm-flash-attention
617264c1): importing it registers `_vllm_fa3_C::fwd` with the schema of
flash_api_torch_lib.cpp 255-291 verbatim (tests/fakes/fa3/schemas.py VLLM_FA3: no defaults,
`Tensor!` aliases, float softmax_scale, s_aux and the context-parallel arguments, `-> Tensor[]`),
body FA3's `mha_fwd` as vLLM's fork has it (kernel.py; vllm flash_api.cpp 737-1312: the
HDIMDIFF build-flag checks in the forward, the cp_world_size checks). vLLM ships no build-flag
module: flags unknown, none modelled. It also registers `get_scheduler_metadata`
(flash_api_torch_lib.cpp 293-316, schemas.py VLLM_FA3_METADATA), laid out as vLLM's fork lays it
out (hopper/flash_api.cpp 584-725: no batch sort, a split vector only where the batch splits).

Used two ways: from this stand-in package in the core session (the real vllm_flash_attn
Python beside it does `from . import _vllm_fa3_C`), and in the vllm session loaded under the
name `vllm.vllm_flash_attn._vllm_fa3_C` into sys.modules before the REAL installed
`vllm.vllm_flash_attn` is imported (tests/fakes/fa3/__init__.py `install_vllm_fa3_C`).
"""

from tests.fakes.fa3 import kernel, schemas

BUILD = kernel.Build("_vllm_fa3_C", schemas.VLLM_FA3, hdimdiff_checks_in_fwd=True,
                     metadata_schema=schemas.VLLM_FA3_METADATA, metadata_layout="vllm")
kernel.register(BUILD)
