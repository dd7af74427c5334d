# ruff: noqa: UP045  (Optional[...] as AITER v0.1.15/v0.1.16 spell it; the schema is the same)
"""The FP8 MLA prefill part of `aiter/ops/attention.py`, with AITER's own signatures.

Stubs as at ROCm/aiter v0.1.15 (get_ps_metadata_info_v1 :812, get_ps_metadata_v1 :856,
mla_prefill_ps_asm_fwd :877, mla_reduce_v1 :1144), v0.1.16 (:940, :984, :1005,
get_mla_decode_fwd_max_splits :1053, mla_reduce_v1 :1294) and v0.1.20.post1 (:1004,
:1048, :1069, :1117, :1450). The variant picks which `mla_reduce_v1` (8 arguments before
#3391, `num_kv_splits` at index 6 after it) and whether `get_ps_metadata_v1` takes
`need_lse` (#3606, modelled: its exact signature is not in any snapshot read).
"""

import math
from typing import Optional

import torch

from .. import _fake_config as _cfg
from ..jit.core import compile_ops


def get_ps_metadata_info_v1(
    batch_size: int,
    num_head_k: int,
    max_qlen: int,
    qlen_granularity: int = 256,
):
    """AITER's sizing formulas (plain Python in AITER too). The real one reads the CU count
    with torch.cuda.get_device_properties; the fake uses its configured CU count."""
    cu_num = _cfg.CU_COUNT
    num_clusters = math.gcd(num_head_k, cu_num)
    cus_per_cluster = cu_num // num_clusters
    max_qo_split_per_batch = math.ceil(max_qlen / qlen_granularity)
    qo_tile_cnt = batch_size * max_qo_split_per_batch
    max_works = (batch_size + cus_per_cluster - 1) * max_qo_split_per_batch * num_head_k
    if _cfg.NEED_LSE:
        # after #3606 every tile may go through the reduce (vLLM #57923 review thread)
        max_partials = qo_tile_cnt + cus_per_cluster - 1
    else:
        max_partials = (
            min(batch_size + cus_per_cluster - 1, (cus_per_cluster - 1) * 2) * max_qo_split_per_batch
        )
    return (
        (2, torch.uint64),  # work_metadata_ptrs
        (cu_num + 1, torch.int32),  # work_indptr
        ((max_works, 8), torch.int32),  # work_info
        (qo_tile_cnt + 1, torch.int32),  # reduce_indptr
        ((qo_tile_cnt, 2), torch.int32),  # reduce_final_map
        (max_partials, torch.int32),  # reduce_partial_map
    )


if _cfg.NEED_LSE:

    @compile_ops("module_ps_metadata")
    def get_ps_metadata_v1(
        seqlens_qo_indptr: torch.Tensor,
        pages_kv_indptr: torch.Tensor,
        context_lens: torch.Tensor,
        gqa_ratio: int,
        num_heads_k: int,
        work_metadata_ptrs: torch.Tensor,
        work_indptr: torch.Tensor,
        work_info: torch.Tensor,
        reduce_indptr: torch.Tensor,
        reduce_final_map: torch.Tensor,
        reduce_partial_map: torch.Tensor,
        qhead_granularity: int = 1,
        qlen_granularity: int = 256,
        kvlen_granularity: int = 16,
        block_size: int = 16,
        is_causal: bool = True,
        need_lse: bool = False,
    ) -> None: ...

else:

    @compile_ops("module_ps_metadata")
    def get_ps_metadata_v1(
        seqlens_qo_indptr: torch.Tensor,
        pages_kv_indptr: torch.Tensor,
        context_lens: torch.Tensor,
        gqa_ratio: int,
        num_heads_k: int,
        work_metadata_ptrs: torch.Tensor,
        work_indptr: torch.Tensor,
        work_info: torch.Tensor,
        reduce_indptr: torch.Tensor,
        reduce_final_map: torch.Tensor,
        reduce_partial_map: torch.Tensor,
        qhead_granularity: int = 1,
        qlen_granularity: int = 256,
        kvlen_granularity: int = 16,
        block_size: int = 16,
        is_causal: bool = True,
    ) -> None: ...


@compile_ops("module_mla_asm", ffi_type="ctypes")
def mla_prefill_ps_asm_fwd(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    work_indptr: Optional[torch.Tensor],
    work_info_set: Optional[torch.Tensor],
    max_seqlen_q: int,
    softmax_scale: float,
    is_causal: bool,
    splitData: torch.Tensor,
    splitLse: torch.Tensor,
    output: torch.Tensor,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None: ...


if _cfg.HAS_DECODE_MAX_SPLITS:

    def get_mla_decode_fwd_max_splits(
        num_head_qo: int, max_seqlen_qo: int, q_dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> int:
        """Added by #3391 (v0.1.16) in the same commit as num_kv_splits: cu_num * occupancy."""
        return _cfg.CU_COUNT


if _cfg.REDUCE_CONVENTION == "legacy":

    @compile_ops("module_mla_reduce")
    def mla_reduce_v1(
        partial_output: torch.Tensor,
        partial_lse: torch.Tensor,
        reduce_indptr: torch.Tensor,
        reduce_final_map: Optional[torch.Tensor],
        reduce_partial_map: torch.Tensor,
        max_seqlen_q: int,
        final_output: torch.Tensor,
        final_lse: Optional[torch.Tensor] = None,
    ) -> None: ...

elif _cfg.REDUCE_CONVENTION == "num_kv_splits":

    @compile_ops("module_mla_reduce")
    def mla_reduce_v1(
        partial_output: torch.Tensor,
        partial_lse: torch.Tensor,
        reduce_indptr: torch.Tensor,
        reduce_final_map: Optional[torch.Tensor],
        reduce_partial_map: torch.Tensor,
        max_seqlen_q: int,
        num_kv_splits: int,
        final_output: torch.Tensor,
        final_lse: Optional[torch.Tensor] = None,
    ) -> None: ...

else:  # "unknown": a hypothetical build whose num_kv_splits moved behind final_lse

    @compile_ops("module_mla_reduce")
    def mla_reduce_v1(
        partial_output: torch.Tensor,
        partial_lse: torch.Tensor,
        reduce_indptr: torch.Tensor,
        reduce_final_map: Optional[torch.Tensor],
        reduce_partial_map: torch.Tensor,
        max_seqlen_q: int,
        final_output: torch.Tensor,
        final_lse: Optional[torch.Tensor],
        num_kv_splits: int,
    ) -> None: ...
