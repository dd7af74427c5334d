"""The AITER kernel: AMD's asm FP8 prefill (`mla_prefill_ps_asm_fwd`, gfx950 only) and its
reduce, called in whichever convention the installed AITER has.

Written to AITER's documented API (reference/aiter.md); no AMD GPU exists where this
project is tested, so its capability checks run here and its kernels only on ROCm.
AITER schedules its own work (`get_ps_metadata_v1`), so a plan passed to `mla_prefill`
is not used by this kernel.
"""

from __future__ import annotations

import bisect
import logging

import torch

from ..aiter import REDUCE_HEADS_DV128, aiter_mla_reduce_v1, probe_aiter
from ..device import device_arch, device_kind
from ..fp8 import dequantize_fp8, quantize_fp8
from .base import Inputs, Kernel, PrefillInputs, ReduceInputs

logger = logging.getLogger("mla_plugins.kernels.aiter")

TILE_Q = 256  # the asm kernel's query tile (mla_pfl_qh192_vh128_m32x8_n128x1)
KV_GRANULARITY = 128
#: value head dim -> head counts of mla_reduce_v1's router at v0.1.16
REDUCE_ROUTER = {128: REDUCE_HEADS_DV128, 512: (8, 16, 32, 48, 64, 80, 96, 112, 128)}


def padded_heads(num_heads: int) -> int | None:
    """The smallest head count the reduce supports that is >= num_heads (SGLang pads the same way)."""
    i = bisect.bisect_left(REDUCE_HEADS_DV128, num_heads)
    return REDUCE_HEADS_DV128[i] if i < len(REDUCE_HEADS_DV128) else None


class AiterKernel(Kernel):
    name = "aiter"
    description = "AMD AITER asm FP8 prefill + mla_reduce_v1 (ROCm gfx950)"
    priority = 0
    devices = frozenset({"rocm"})
    dtypes = frozenset({torch.bfloat16})  # the asm kernel writes bf16 only
    supports_fp8 = True
    supports_bf16_compute = False
    head_dims_qk = frozenset({192})
    head_dims_v = frozenset({128})
    archs = frozenset({"gfx950"})

    def environment_reasons(self) -> list[str]:
        status = probe_aiter()
        if not status.usable:
            return [status.reason]
        if not status.prefill_op:
            return ["this AITER has no mla_prefill_ps_asm_fwd (FP8 persistent prefill)"]
        return []

    def device_reasons(self, device: torch.device) -> list[str]:
        arch = device_arch(device)
        if arch not in self.archs:
            return [f"arch {arch} not supported (AITER's FP8 prefill exists for {sorted(self.archs)} only)"]
        return []

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        if inputs.op != "reduce":
            return super().not_supported_reasons(inputs)
        # The reduce alone has its own router: exact (H, Dv) pairs, bf16 or fp16 output.
        status = probe_aiter()
        reasons = [] if status.usable else [status.reason]
        kind = device_kind(inputs.device)
        if kind not in self.devices:
            reasons.append(f"device {kind} not supported (supports {sorted(self.devices)})")
        if inputs.dtype not in (torch.bfloat16, torch.float16):
            reasons.append(f"dtype {inputs.dtype} not supported (supports bfloat16, float16)")
        pairs = REDUCE_ROUTER.get(inputs.head_dim_v, ())
        if inputs.num_heads not in pairs:
            reasons.append(
                f"{inputs.num_heads} heads with value head dim {inputs.head_dim_v} not supported "
                f"by mla_reduce_v1 (supports {dict((d, list(h)) for d, h in REDUCE_ROUTER.items())})"
            )
        return reasons

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        if padded_heads(inputs.num_heads) is None:
            return [
                f"{inputs.num_heads} heads not supported (mla_reduce_v1 handles "
                f"{list(REDUCE_HEADS_DV128)} with Dv 128; fewer heads are padded up)"
            ]
        return []

    def run(self, inputs: PrefillInputs, plan, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        import aiter

        heads = inputs.num_heads
        padded = padded_heads(heads)
        q, k, v = inputs.q, inputs.k, inputs.v
        if padded != heads:
            pad = (0, 0, 0, padded - heads)
            q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
        q8, q_scale = quantize_fp8(q, inputs.fp8_dtype)
        k8, k_scale = quantize_fp8(k, inputs.fp8_dtype)
        v8, v_scale = quantize_fp8(v, inputs.fp8_dtype)
        device = q.device
        cu_q, cu_k = inputs.cu_seqlens_q, inputs.cu_seqlens_k
        batch = inputs.batch_size
        info = aiter.get_ps_metadata_info_v1(batch, padded, inputs.max_seqlen_q, TILE_Q)
        (work_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map) = (
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype in info
        )
        status = probe_aiter()
        extra = {}
        if lse is not None and "need_lse" in status.metadata_kwargs:
            extra["need_lse"] = True
        k_lens = (cu_k[1:] - cu_k[:-1]).cpu()
        aiter.get_ps_metadata_v1(
            cu_q.cpu(), cu_k.cpu(), k_lens, 1, padded,
            work_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map,
            qhead_granularity=1, qlen_granularity=TILE_Q, kvlen_granularity=KV_GRANULARITY,
            block_size=1, is_causal=inputs.causal, **extra,
        )
        rows = reduce_partial_map.size(0) * TILE_Q
        split_out = torch.empty((rows, padded, 128), dtype=torch.float32, device=device)
        split_lse = torch.empty((rows, padded), dtype=torch.float32, device=device)
        target = out if padded == heads else torch.empty((out.shape[0], padded, 128), dtype=out.dtype, device=device)
        final_lse = torch.full((out.shape[0], padded), float("nan"), device=device) if lse is not None else None
        kv_indices = torch.arange(inputs.k.shape[0], dtype=torch.int32, device=device)
        aiter.mla_prefill_ps_asm_fwd(
            q8, k8, v8, cu_q, cu_k, kv_indices, work_indptr, work_info,
            inputs.max_seqlen_q, inputs.softmax_scale, inputs.causal,
            split_out, split_lse, target, q_scale, k_scale, v_scale,
        )
        if int(reduce_indptr[-1]) > 0:
            aiter_mla_reduce_v1(
                split_out, split_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                TILE_Q, 0, target, final_lse,
            )
        if padded != heads:
            out.copy_(target[:, :heads])
        if lse is not None:
            lse.copy_(final_lse[:, :heads])
            # zero-padded heads leave the amax alone: these are exactly q's and k's fp8 values
            self._fill_unsplit_lse(inputs, lse, (q8[:, :heads], q_scale), (k8[:, :heads], k_scale))

    @staticmethod
    def _fill_unsplit_lse(
        inputs: PrefillInputs,
        lse: torch.Tensor,
        q_fp8: tuple[torch.Tensor, torch.Tensor],
        k_fp8: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """AITER's reduce writes lse only for split tiles: compute the rest (NaN marks them).

        A per-sequence logsumexp of the scores on the dequantized operands; costs one QK^T
        over the affected rows. An AITER whose planner takes `need_lse` leaves none.
        """
        missing = torch.isnan(lse)
        if not bool(missing.any()):
            return
        logger.debug("computing lse for %d rows AITER left unwritten", int(missing.any(-1).sum()))
        qf, kf = dequantize_fp8(*q_fp8), dequantize_fp8(*k_fp8)
        cq, ck = inputs.seqlens_host or (inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist())
        for b in range(len(cq) - 1):
            rows = missing[cq[b] : cq[b + 1]].any(-1).nonzero().flatten()
            if rows.numel() == 0:
                continue
            qs = qf[cq[b] : cq[b + 1]][rows].transpose(0, 1)
            ks = kf[ck[b] : ck[b + 1]].transpose(0, 1)
            s = torch.matmul(qs, ks.transpose(1, 2)) * inputs.softmax_scale
            if inputs.causal:
                k_len, q_len = ck[b + 1] - ck[b], cq[b + 1] - cq[b]
                j = torch.arange(k_len, device=s.device)[None, :]
                s = s.masked_fill(j > rows[:, None] + (k_len - q_len), float("-inf"))
            lse[cq[b] + rows] = torch.logsumexp(s, dim=-1).transpose(0, 1)

    def reduce(self, inputs: ReduceInputs) -> None:
        aiter_mla_reduce_v1(
            inputs.partial_out, inputs.partial_lse, inputs.reduce_indptr, inputs.reduce_final_map,
            inputs.reduce_partial_map, inputs.tile_q, inputs.num_kv_splits, inputs.out, inputs.final_lse,
        )
