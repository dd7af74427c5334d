"""The torch kernel: runs on any device and is the reference the other kernels are tested against.

Phase 1 walks the plan's work items on the host and does each as batched matmuls over
its heads, `[h, rows, Dqk] @ [h, Dqk, keys]`, with the softmax in float32; phase 2 is
the torch reduce of `core/reduce.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..fp8 import block_fake_quantize_qkv
from ..reduce import torch_reduce
from .base import Kernel, PrefillInputs, ReduceInputs

if TYPE_CHECKING:
    from ..plan import PrefillPlan


def _compute_operands(inputs: PrefillInputs, cq, ck) -> tuple[torch.Tensor, ...]:
    """float32 q, k, v; in fp8, quantized and dequantized by core/fp8.py's block rule (q and
    k rotated first when `inputs.fp8_rotate`; with `inputs.fp8_outliers` q and k are
    wider: the fp8 part, then the side tile), as the Triton and Gluon kernels compute."""
    if inputs.fp8:
        return block_fake_quantize_qkv(inputs.q, inputs.k, inputs.v, cq, ck, inputs.fp8_dtype,
                                       rotate_=inputs.fp8_rotate, outliers=inputs.fp8_outliers)
    return inputs.q.float(), inputs.k.float(), inputs.v.float()


def attend_slice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [h, R, Dqk] over k [h, K, Dqk], v [h, K, Dv], normalized over these keys.

    mask: bool [R, K] of visible keys or None. Returns (o [h, R, Dv], lse [h, R]);
    rows with no visible key get o = 0 and lse = -inf.
    """
    s = torch.matmul(q, k.transpose(1, 2)).mul_(scale)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    seen = denom > 0
    o = torch.matmul(p, v) / torch.where(seen, denom, torch.ones_like(denom))
    lse = torch.where(seen, torch.log(torch.where(seen, denom, torch.ones_like(denom))) + m, float("-inf"))
    return o, lse.squeeze(-1)


class TorchKernel(Kernel):
    name = "torch"
    description = "PyTorch matmuls, any device; the reference implementation"
    priority = 100
    devices = frozenset({"cpu", "cuda", "rocm"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    supports_fp8_outliers = True

    def prefill(
        self,
        inputs: PrefillInputs,
        plan: PrefillPlan,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        partial_out: torch.Tensor,
        partial_lse: torch.Tensor,
    ) -> None:
        cq, ck = plan.cu_seqlens_host
        q, k, v = _compute_operands(inputs, cq, ck)
        device = q.device
        for _, loc, q0, q1, kv0, kv1, kv_offset, heads in plan.work_info_cpu.tolist():
            h0, h1 = heads & 0xFFFF, heads >> 16
            rows = q1 - q0
            if rows <= 0:
                continue
            if kv1 > kv0:
                mask = None
                if plan.causal:
                    qi = torch.arange(q0, q1, device=device)[:, None]
                    kj = torch.arange(kv0, kv1, device=device)[None, :]
                    mask = kj <= qi + kv_offset
                o, item_lse = attend_slice(
                    q[q0:q1, h0:h1].transpose(0, 1),
                    k[kv0:kv1, h0:h1].transpose(0, 1),
                    v[kv0:kv1, h0:h1].transpose(0, 1),
                    inputs.softmax_scale,
                    mask,
                )
                o, item_lse = o.transpose(0, 1), item_lse.transpose(0, 1)
            else:
                o = torch.zeros((rows, h1 - h0, v.shape[-1]), device=device)
                item_lse = torch.full((rows, h1 - h0), float("-inf"), device=device)
            if loc < 0:
                out[q0:q1, h0:h1] = o.to(out.dtype)
                if lse is not None:
                    lse[q0:q1, h0:h1] = item_lse
            else:
                partial_out[loc : loc + rows, h0:h1] = o
                partial_lse[loc : loc + rows, h0:h1] = item_lse

    def reduce(self, inputs: ReduceInputs) -> None:
        torch_reduce(
            inputs.partial_out,
            inputs.partial_lse,
            inputs.reduce_indptr,
            inputs.reduce_final_map,
            inputs.reduce_partial_map,
            inputs.tile_q,
            inputs.out,
            inputs.final_lse,
        )
