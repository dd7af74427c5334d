"""MLA_PLUGINS_VLLM_OVERRIDE=ROCM_AITER_MLA,ROCM_AITER_TRITON_MLA on vLLM 0.32 and 0.33: AITER's own FP8
prefill is off in the impl AND in the metadata builder (which would otherwise reserve the FP8
scratch and plan every prefill batch with get_ps_metadata_v1), for AiterMLAImpl and
AiterTritonMLAImpl.

What runs for real: vLLM's registry (`register_backend` through our register()),
`AiterMLAMetadataBuilder.__init__` (its gfx950 / fp8-KV / bf16 gate, its call of
`_init_fp8_prefill_ps_buffers`), `AiterMLAMetadataBuilder.build` (its
`if self._fp8_prefill_enabled ...: self._build_fp8_prefill_ps_metadata(...)`),
`AiterMLAImpl.__init__` and `AiterTritonMLAImpl.__init__`, the fake AMD AITER (num_kv_splits).
Stood in: the parents' `__init__`/`build` (`MLACommonMetadataBuilder`, `MLACommonImpl`:
they need a running engine; the stand-ins set the attributes the AITER classes read), vLLM's
compiled libraries, the GPU's properties (gfx950) and the platform's compute-unit count read
from them (0.33), and the AITER decode helpers the builder calls for its decode buffers
(`aiter.dtypes`, `get_mla_metadata_info_v1`: small shapes).
"""

from __future__ import annotations

import json

from .conftest import run_python

SCRIPT = r"""
import json, logging, sys, types
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
import torch
from tests.fakes import fake_aiter

dest = fake_aiter.write_package(DEST, "num_kv_splits")
init_py = dest / "aiter" / "__init__.py"
with open(init_py, "a") as f:  # decode-side names the builder and impls import (not under test)
    f.write('''
def flash_attn_varlen_func(*a, **k):
    raise NotImplementedError("fake")
class dtypes:
    fp8 = torch.float8_e4m3fn
    fp16 = torch.float16
    bf16 = torch.bfloat16
def get_mla_metadata_info_v1(*a, **k):
    return [((2,), torch.uint64), ((8,), torch.int32), ((8, 8), torch.int32),
            ((8,), torch.int32), ((8, 2), torch.int32), ((8,), torch.int32)]
''')
(dest / "aiter" / "ops" / "triton").mkdir(exist_ok=True)
(dest / "aiter" / "ops" / "triton" / "__init__.py").write_text("")
(dest / "aiter" / "ops" / "triton" / "mha.py").write_text(
    "def flash_attn_varlen_func(*a, **k):\n    raise NotImplementedError('fake')\n")
sys.path.insert(0, str(dest))

from tests.fakes import gfx950
gfx950.stand_in()

from mla_plugins.vllm import register
register()
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
from vllm.model_executor.layers.attention import mla_attention as common
from vllm.v1.attention.backends.mla import rocm_aiter_mla as ram
from vllm.v1.attention.backends.mla.aiter_triton_mla import AiterTritonMLAImpl

H = 16
def builder_parent_init(self, kv_cache_spec, layer_names, vllm_config, device, metadata_cls=None,
                        supports_dcp_with_varlen=False):
    self.num_heads, self.dcp_world_size, self.reorder_batch_threshold = H, 1, 1
    self.mla_dims = types.SimpleNamespace(kv_lora_rank=512, qk_nope_head_dim=128,
                                          qk_rope_head_dim=64, v_head_dim=128)
    self.q_data_type = torch.bfloat16  # 0.33's builder reads it (the parent sets the model dtype)
common.MLACommonMetadataBuilder.__init__ = builder_parent_init
gfx950.answer_compute_units()

def impl_parent_init(self, num_heads, head_size, scale, num_kv_heads, *args, **mla):
    self.num_heads, self.scale, self.dcp_world_size, self.v_head_dim = num_heads, scale, 1, 128
    self.qk_nope_head_dim, self.qk_rope_head_dim = mla["qk_nope_head_dim"], mla["qk_rope_head_dim"]
common.MLACommonImpl.__init__ = impl_parent_init

planned = []
def parent_build(self, common_prefix_len, cm, fast_build=False):
    return types.SimpleNamespace(decode=None, prefill=types.SimpleNamespace(chunked_context=None))
common.MLACommonMetadataBuilder.build = parent_build
def build_fp8(self, metadata, cm):
    planned.append(type(self).__name__)
ram.AiterMLAMetadataBuilder._build_fp8_prefill_ps_metadata = build_fp8
reserved = []
original_init_buffers = ram.AiterMLAMetadataBuilder._init_fp8_prefill_ps_buffers
def init_buffers(self, *a, **k):
    reserved.append(type(self).__name__)
ram.AiterMLAMetadataBuilder._init_fp8_prefill_ps_buffers = init_buffers

cfg = types.SimpleNamespace(
    parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1),
    speculative_config=None,
    compilation_config=types.SimpleNamespace(
        cudagraph_mode=types.SimpleNamespace(has_full_cudagraphs=lambda: False)),
    model_config=types.SimpleNamespace(dtype=torch.bfloat16, max_model_len=1024),
    scheduler_config=types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=1024),
    cache_config=types.SimpleNamespace(cache_dtype="fp8", num_gpu_blocks=None),
)
spec = types.SimpleNamespace(block_size=1, dtype=torch.float8_e4m3fn, page_size_bytes=576)
result = {}
for slot in ("ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA"):
    backend = E[slot].get_class()
    builder = backend.get_builder_cls()(spec, ["layer.0"], cfg, torch.device("cpu"))
    builder.build(0, types.SimpleNamespace(causal=True))
    impl = backend.get_impl_cls()(H, 576, 0.1, 1, None, None, "fp8", None, "decoder", None,
                                  q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                  qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
    result[slot] = {"backend": backend.__name__, "builder": type(builder).__name__,
                    "impl": type(impl).__name__, "impl_bases": [c.__name__ for c in type(impl).__mro__[1:3]],
                    "builder_fp8": builder._fp8_prefill_enabled, "impl_fp8": impl._fp8_prefill_enabled}
# vLLM's own classes in the same process: the gate is on here, so "off" above is ours
builtin = ram.AiterMLAMetadataBuilder(spec, ["layer.0"], cfg, torch.device("cpu"))
builtin.build(0, types.SimpleNamespace(causal=True))
builtin_impl = ram.AiterMLAImpl(H, 576, 0.1, 1, None, None, "fp8", None, "decoder", None,
                                q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
result["builtin"] = {"builder_fp8": builtin._fp8_prefill_enabled, "impl_fp8": builtin_impl._fp8_prefill_enabled}
result["planned_by"] = planned
result["reserved_by"] = reserved
print(json.dumps(result))
"""


def test_override_turns_fp8_prefill_off_in_builder_and_both_impls(tmp_path):
    proc = run_python(SCRIPT.replace("DEST", repr(str(tmp_path))),
                      env={"MLA_PLUGINS_VLLM_OVERRIDE": "ROCM_AITER_MLA,ROCM_AITER_TRITON_MLA"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # vLLM's own builder and impl would run (and plan) the FP8 path in this configuration
    assert got["builtin"] == {"builder_fp8": True, "impl_fp8": True}, got
    assert got["planned_by"] == ["AiterMLAMetadataBuilder"], got  # only the built-in planned
    assert got["reserved_by"] == ["AiterMLAMetadataBuilder"], got  # and reserved FP8 scratch
    for slot, impl_base in (("ROCM_AITER_MLA", "AiterMLAImpl"),
                            ("ROCM_AITER_TRITON_MLA", "AiterTritonMLAImpl")):
        cell = got[slot]
        assert cell["backend"].startswith("MLAPlugins"), cell
        assert cell["builder"] == "MLAPluginsAiterMLAMetadataBuilder", cell
        assert cell["impl_bases"][0] == impl_base, cell
        assert cell["builder_fp8"] is False and cell["impl_fp8"] is False, cell
