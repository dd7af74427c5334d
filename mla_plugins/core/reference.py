"""Dense float64 attention, the yardstick of every test and of `mla-plugins check`.

Straight from the definition, one sequence at a time; nothing is shared with the kernels.
"""

from __future__ import annotations

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    fp8_dtype: torch.dtype | None = None,
    fp8_rotate: bool = False,
    fp8_per_sequence: bool = False,
    fp8_outliers: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out float64 [total_q, H, Dv], lse float64 [total_q, H]) on the CPU.

    Causal is bottom-right aligned: row i of a sequence sees keys j <= i + k_len - q_len.
    Rows that see no key get 0 and -inf. With `fp8_dtype`, q, k and v are first quantized
    and dequantized by core/fp8.py's block rule (what the fp8 kernels compute from), then
    everything runs in float64 as without it. `fp8_rotate`: q and k are rotated before the
    cast (the rotation leaves every logit unchanged; only the rounding differs);
    `fp8_per_sequence`: one scale per (sequence, head), the FA3 provider's rule;
    `fp8_outliers`: each (sequence, head)'s outlier features' fp8 rounding corrected (core/fp8.py).
    """
    # the input's width: under fp8_outliers the fake-quantized q and k are wider (side tiles)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if fp8_dtype is not None:
        from .fp8 import block_fake_quantize_qkv

        q, k, v = block_fake_quantize_qkv(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(),
                                          cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), fp8_dtype,
                                          rotate_=fp8_rotate, per_sequence=fp8_per_sequence,
                                          outliers=fp8_outliers)
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]]
        vs = v[ck[b] : ck[b + 1]]
        q_len, k_len = qs.shape[0], ks.shape[0]
        if q_len == 0 or k_len == 0:
            continue
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if causal:
            i = torch.arange(q_len)[:, None]
            j = torch.arange(k_len)[None, :]
            s = s.masked_fill(j > i + (k_len - q_len), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [h, i]
        seen = torch.isfinite(row_lse)
        p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, row_lse, 0.0)[..., None]), 0.0)
        out[cq[b] : cq[b + 1]] = torch.einsum("hij,jhd->ihd", p, vs)
        lse[cq[b] : cq[b + 1]] = row_lse.transpose(0, 1)
    return out, lse


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (NaN if actual has a NaN)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if torch.isnan(a).any():
        return float("nan")
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)
