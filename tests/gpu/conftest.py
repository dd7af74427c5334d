"""GPU tests: skipped without a CUDA/ROCm device; float64 references computed on the device.

The CPU reference (`core/reference.py`) is exact but too slow for 8192-token sequences
with 128 heads; `reference_on_device` is the same definition in float64 on the GPU,
a few heads at a time.
"""

from __future__ import annotations

import pytest
import torch


def reference_on_device(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=True,
                        heads_per_step=8):
    """(out float64 [total_q, H, Dv], lse float64 [total_q, H]) on q's device.

    Bottom-right causal; rows that see no key get 0 and -inf.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    heads = q.shape[1]
    out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if q_len == 0 or k_len == 0:
            continue
        for h0 in range(0, heads, heads_per_step):
            h1 = min(heads, h0 + heads_per_step)
            qs = q[cq[b]:cq[b + 1], h0:h1].double().transpose(0, 1)
            ks = k[ck[b]:ck[b + 1], h0:h1].double().transpose(0, 1)
            vs = v[ck[b]:ck[b + 1], h0:h1].double().transpose(0, 1)
            s = torch.matmul(qs, ks.transpose(1, 2)) * scale
            if causal:
                i = torch.arange(q_len, device=q.device)[:, None]
                j = torch.arange(k_len, device=q.device)[None, :]
                s.masked_fill_(j > i + (k_len - q_len), float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)
            seen = torch.isfinite(row_lse)
            p = torch.exp(s - torch.where(seen, row_lse, 0.0)[..., None])
            p = torch.where(seen[..., None], p, 0.0)
            out[cq[b]:cq[b + 1], h0:h1] = torch.matmul(p, vs).transpose(0, 1)
            lse[cq[b]:cq[b + 1], h0:h1] = row_lse.transpose(0, 1)
            del s, p
    return out, lse


def scale_outliers(q, k, scale=10.0):
    """Features 7 and 128-131 of q and k `scale` times the others, in place (keys and
    queries of real models carry a few such features: field-findings section 7)."""
    for x in (q, k):
        x[..., 7] *= scale
        x[..., 128:132] *= scale


def quantize_outliers(q, k, v, cq, ck, fp8_dtype=torch.float8_e4m3fn):
    """The Triton provider's fp8_outliers quantization of a batch (triton_quant.
    quantize_qkv_outliers, every side row zeroed first): (q8, q scales, k8, sel [B, H, 8],
    (q_side, k_side))."""
    from mla_plugins.core.kernels import triton_quant as tq

    (q8, qs, k8, _, _), sel, sides = tq.quantize_qkv_outliers(
        q, k, v, cq, ck, len(cq) - 1, max(cq.diff().tolist()), max(ck.diff().tolist()), fp8_dtype)
    return q8, qs, k8, sel, sides


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 on the device; NaN if actual has a NaN."""
    a = actual.double()
    if torch.isnan(a).any():
        return float("nan")
    denom = expected.norm().item()
    return (a - expected).norm().item() / (denom if denom > 0 else 1.0)


@pytest.fixture
def device():
    return torch.device("cuda")


def make_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, fp8=True, softmax_scale=None,
                fp8_rotate=None):
    """A PrefillInputs for calling a provider directly (the public API builds the same,
    `fp8_rotate` resolved as `mla_prefill` resolves it)."""
    from mla_plugins.core.device import fp8_dtype_for
    from mla_plugins.core.fp8 import rotation_applies
    from mla_plugins.core.kernels.base import PrefillInputs

    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return PrefillInputs(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        softmax_scale=q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
        causal=causal, fp8=fp8, fp8_dtype=fp8_dtype_for(q.device),
        max_seqlen_q=max((b - a for a, b in zip(cq, cq[1:], strict=False)), default=0),
        max_seqlen_k=max((b - a for a, b in zip(ck, ck[1:], strict=False)), default=0),
        fp8_rotate=fp8 and rotation_applies(q.shape[2], fp8_rotate),
    )
