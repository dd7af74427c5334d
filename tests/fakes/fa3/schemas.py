"""The forward-op schemas of the four real FA3 builds, verbatim, and one that no release has.

Each string is byte for byte what the build registers (split here at its commas only):
- FA3_HEAD: Dao-AILab flash-attention hopper/flash_api.cpp 1674-1708 (`TORCH_LIBRARY(flash_attn_3, m)`,
  `m.def("fwd(" ...)`: the concatenated literals);
- FA3_FWD_0_0_3: the PyPI wheel fa3-fwd 0.0.3, `fa3_fwd/_C.abi3.so` (C_schemas.txt line 1, extracted
  from the compiled library); the same text as FA3_HEAD;
- VLLM_FA3: vllm-flash-attention 617264c1 flash_api_torch_lib.cpp 255-291 (`ops.def("fwd(" ...)`,
  registered under `_vllm_fa3_C`): no defaults, `Tensor!` aliases, float softmax_scale, no
  attention_chunk, s_aux and the context-parallel arguments, `-> Tensor[]`;
- SGL_KERNEL_0_4_10: sglang-kernel 0.4.10 `flash_ops.abi3.so` (flash_ops_schemas.txt line 1): no
  defaults, `Tensor(a!)? out`, and sinks / sparse_mask_fine / only_qv at the end.

UNKNOWN: FA3_HEAD with a required argument inserted after `v` (no default: a caller that does
not know it cannot call the op), for the provider's "unknown schema" path.

Each build's `get_scheduler_metadata` schema (the op that precomputes what FA3's
prepare-varlen kernel computes at every call), verbatim the same way:
- FA3_HEAD_METADATA: Dao-AILab flash-attention hopper/flash_api.cpp 1737-1761 (the same text in
  hopper/flash_api_stable.cpp 1956-1980, the stable-ABI build fa3-fwd's library comes from:
  its `boxed_mha_fwd_get_scheduler_metadata` symbol);
- FA3_FWD_0_0_3_METADATA: fa3-fwd 0.0.3 `fa3_fwd/_C.abi3.so`, the string the library registers
  (`strings _C.abi3.so | grep '^get_scheduler_metadata('`); the same text as FA3_HEAD_METADATA;
- VLLM_FA3_METADATA: vllm-flash-attention 617264c1 hopper/flash_api_torch_lib.cpp 293-316
  (`ops.def("get_scheduler_metadata(" ...)`): no defaults, and no attention_chunk (its fwd has
  none either);
- SGL_KERNEL_0_4_10_METADATA: sglang-kernel 0.4.10 `sgl_kernel/flash_ops.abi3.so`, the string
  the library registers: defaults from max_seqlen_k_new on, attention_chunk present.

UNKNOWN_METADATA: FA3_HEAD_METADATA with an argument no release has (`bool deterministic`,
with a default) before sm_margin: the provider must run without metadata rather than guess
what the argument changes in the schedule.
"""

FA3_HEAD = (
    'fwd(Tensor q,'
    'Tensor k,'
    'Tensor v,'
    'Tensor(k_new!)? k_new = None,'
    'Tensor(v_new!)? v_new = None,'
    'Tensor? q_v = None,'
    'Tensor(out!)? out = None,'
    'Tensor? cu_seqlens_q = None,'
    'Tensor? cu_seqlens_k = None,'
    'Tensor? cu_seqlens_k_new = None,'
    'Tensor? seqused_q = None,'
    'Tensor? seqused_k = None,'
    'int? max_seqlen_q = None,'
    'int? max_seqlen_k = None,'
    'Tensor? page_table = None,'
    'Tensor? kv_batch_idx = None,'
    'Tensor? leftpad_k = None,'
    'Tensor? rotary_cos = None,'
    'Tensor? rotary_sin = None,'
    'Tensor? seqlens_rotary = None,'
    'Tensor? q_descale = None,'
    'Tensor? k_descale = None,'
    'Tensor? v_descale = None,'
    'float? softmax_scale = None,'
    'bool is_causal = False,'
    'int window_size_left = -1,'
    'int window_size_right = -1,'
    'int attention_chunk = 0,'
    'float softcap = 0.0,'
    'bool is_rotary_interleaved = False,'
    'Tensor? scheduler_metadata = None,'
    'int num_splits = 0,'
    'bool? pack_gqa = None,'
    'int sm_margin = 0) -> (Tensor(out!),'
    ' Tensor,'
    ' Tensor,'
    ' Tensor)'
)

FA3_FWD_0_0_3 = (
    'fwd(Tensor q,'
    'Tensor k,'
    'Tensor v,'
    'Tensor(k_new!)? k_new = None,'
    'Tensor(v_new!)? v_new = None,'
    'Tensor? q_v = None,'
    'Tensor(out!)? out = None,'
    'Tensor? cu_seqlens_q = None,'
    'Tensor? cu_seqlens_k = None,'
    'Tensor? cu_seqlens_k_new = None,'
    'Tensor? seqused_q = None,'
    'Tensor? seqused_k = None,'
    'int? max_seqlen_q = None,'
    'int? max_seqlen_k = None,'
    'Tensor? page_table = None,'
    'Tensor? kv_batch_idx = None,'
    'Tensor? leftpad_k = None,'
    'Tensor? rotary_cos = None,'
    'Tensor? rotary_sin = None,'
    'Tensor? seqlens_rotary = None,'
    'Tensor? q_descale = None,'
    'Tensor? k_descale = None,'
    'Tensor? v_descale = None,'
    'float? softmax_scale = None,'
    'bool is_causal = False,'
    'int window_size_left = -1,'
    'int window_size_right = -1,'
    'int attention_chunk = 0,'
    'float softcap = 0.0,'
    'bool is_rotary_interleaved = False,'
    'Tensor? scheduler_metadata = None,'
    'int num_splits = 0,'
    'bool? pack_gqa = None,'
    'int sm_margin = 0) -> (Tensor(out!),'
    ' Tensor,'
    ' Tensor,'
    ' Tensor)'
)

VLLM_FA3 = (
    'fwd(Tensor!  q,'
    '    Tensor   k,'
    '    Tensor   v,'
    '    Tensor?  k_new,'
    '    Tensor?  v_new,'
    '    Tensor?  q_v,'
    '    Tensor!? out,'
    '    Tensor?  cu_seqlens_q,'
    '    Tensor?  cu_seqlens_k,'
    '    Tensor?  cu_seqlens_k_new,'
    '    Tensor?  seqused_q,'
    '    Tensor?  seqused_k,'
    '    int?     max_seqlen_q,'
    '    int?     max_seqlen_k,'
    '    Tensor?  page_table,'
    '    Tensor?  kv_batch_idx,'
    '    Tensor?  leftpad_k,'
    '    Tensor?  rotary_cos,'
    '    Tensor?  rotary_sin,'
    '    Tensor?  seqlens_rotary,'
    '    Tensor?  q_descale,'
    '    Tensor?  k_descale,'
    '    Tensor?  v_descale,'
    '    float    softmax_scale,'
    '    bool     is_causal,'
    '    int      window_size_left,'
    '    int      window_size_right,'
    '    float    softcap,'
    '    bool     is_rotary_interleaved,'
    '    Tensor?  scheduler_metadata,'
    '    int      num_splits,'
    '    bool?    pack_gqa,'
    '    int      sm_margin,'
    '    Tensor?  s_aux,'
    '    int      cp_world_size,'
    '    int      cp_rank,'
    '    Tensor?  cp_tot_seqused_k) -> Tensor[]'
)

SGL_KERNEL_0_4_10 = (
    'fwd(Tensor   q,'
    '    Tensor   k,'
    '    Tensor   v,'
    '    Tensor?  k_new,'
    '    Tensor?  v_new,'
    '    Tensor?  q_v,'
    '    Tensor(a!)?  out,'
    '    Tensor?  cu_seqlens_q,'
    '    Tensor?  cu_seqlens_k,'
    '    Tensor?  cu_seqlens_k_new,'
    '    Tensor?  seqused_q,'
    '    Tensor?  seqused_k,'
    '    int?     max_seqlen_q,'
    '    int?     max_seqlen_k,'
    '    Tensor?  page_table,'
    '    Tensor?  kv_batch_idx,'
    '    Tensor?  leftpad_k,'
    '    Tensor?  rotary_cos,'
    '    Tensor?  rotary_sin,'
    '    Tensor?  seqlens_rotary,'
    '    Tensor?  q_descale,'
    '    Tensor?  k_descale,'
    '    Tensor?  v_descale,'
    '    float?   softmax_scale,'
    '    bool     is_causal,'
    '    int      window_size_left,'
    '    int      window_size_right,'
    '    int      attention_chunk,'
    '    float    softcap,'
    '    bool     is_rotary_interleaved,'
    '    Tensor?  scheduler_metadata,'
    '    int      num_splits,'
    '    bool?    pack_gqa,'
    '    int      sm_margin,'
    '    Tensor?  sinks,'
    '    Tensor?  sparse_mask_fine,'
    '    bool     only_qv) -> (Tensor(a!),'
    ' Tensor,'
    ' Tensor,'
    ' Tensor)'
)

UNKNOWN = FA3_HEAD.replace("Tensor v,", "Tensor v,int num_kv_splits,", 1)

FA3_HEAD_METADATA = (
    'get_scheduler_metadata(int batch_size,'
    'int max_seqlen_q,'
    'int max_seqlen_k,'
    'int num_heads,'
    'int num_heads_k,'
    'int headdim,'
    'int headdim_v,'
    'ScalarType qkv_dtype,'
    'Tensor seqused_k,'
    'Tensor? cu_seqlens_q = None,'
    'Tensor? cu_seqlens_k = None,'
    'Tensor? cu_seqlens_k_new = None,'
    'Tensor? seqused_q = None,'
    'Tensor? leftpad_k = None,'
    'int? page_size = None,'
    'int max_seqlen_k_new = 0,'
    'bool is_causal = False,'
    'int window_size_left = -1,'
    'int window_size_right = -1,'
    'int attention_chunk = 0,'
    'bool has_softcap = False,'
    'int num_splits = 0,'
    'bool? pack_gqa = None,'
    'int sm_margin = 0) -> Tensor'
)

FA3_FWD_0_0_3_METADATA = (
    'get_scheduler_metadata(int batch_size,'
    'int max_seqlen_q,'
    'int max_seqlen_k,'
    'int num_heads,'
    'int num_heads_k,'
    'int headdim,'
    'int headdim_v,'
    'ScalarType qkv_dtype,'
    'Tensor seqused_k,'
    'Tensor? cu_seqlens_q = None,'
    'Tensor? cu_seqlens_k = None,'
    'Tensor? cu_seqlens_k_new = None,'
    'Tensor? seqused_q = None,'
    'Tensor? leftpad_k = None,'
    'int? page_size = None,'
    'int max_seqlen_k_new = 0,'
    'bool is_causal = False,'
    'int window_size_left = -1,'
    'int window_size_right = -1,'
    'int attention_chunk = 0,'
    'bool has_softcap = False,'
    'int num_splits = 0,'
    'bool? pack_gqa = None,'
    'int sm_margin = 0) -> Tensor'
)

VLLM_FA3_METADATA = (
    'get_scheduler_metadata(    int      batch_size,'
    '    int      max_seqlen_q,'
    '    int      max_seqlen_k,'
    '    int      num_heads,'
    '    int      num_heads_k,'
    '    int      headdim,'
    '    int      headdim_v,'
    '    ScalarType qkv_dtype,'
    '    Tensor   seqused_k,'
    '    Tensor?  cu_seqlens_q,'
    '    Tensor?  cu_seqlens_k,'
    '    Tensor?  cu_seqlens_k_new,'
    '    Tensor?  seqused_q,'
    '    Tensor?  leftpad_k,'
    '    int?     page_size,'
    '    int      max_seqlen_k_new,'
    '    bool     is_causal,'
    '    int      window_size_left,'
    '    int      window_size_right,'
    '    bool     has_softcap,'
    '    int      num_splits,'
    '    bool?    pack_gqa,'
    '    int      sm_margin) -> Tensor'
)

SGL_KERNEL_0_4_10_METADATA = (
    'get_scheduler_metadata(    int      batch_size,'
    '    int      max_seqlen_q,'
    '    int      max_seqlen_k,'
    '    int      num_heads,'
    '    int      num_heads_k,'
    '    int      headdim,'
    '    int      headdim_v,'
    '    ScalarType qkv_dtype,'
    '    Tensor   seqused_k,'
    '    Tensor?  cu_seqlens_q,'
    '    Tensor?  cu_seqlens_k,'
    '    Tensor?  cu_seqlens_k_new,'
    '    Tensor?  seqused_q,'
    '    Tensor?  leftpad_k,'
    '    int?     page_size,'
    '    int      max_seqlen_k_new = 0,'
    '    bool     is_causal = False,'
    '    int      window_size_left = -1,'
    '    int      window_size_right = -1,'
    '    int      attention_chunk = 0,'
    '    bool     has_softcap = False,'
    '    int      num_splits = 0,'
    '    bool?    pack_gqa = None,'
    '    int      sm_margin = 0) -> Tensor'
)

UNKNOWN_METADATA = FA3_HEAD_METADATA.replace("int sm_margin = 0)", "bool deterministic = False,int sm_margin = 0)", 1)
