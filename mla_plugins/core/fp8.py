"""FP8 quantization rules, the one place every kernel takes them from.

Block-scaled (the Triton, Gluon and torch kernels, and the float64 reference with
`fp8_dtype`): each sequence's rows are cut into blocks from the sequence's own start,
`Q_BLOCK` (64) rows for q and `KV_BLOCK` (128) rows for k and v; each (block, head) gets one
scale: scale = amax(|x|) over the block's rows and the head's features /
max_finite(fp8_dtype), 1 when the block is all zeros, NaN when it holds a NaN, inf when it
holds an inf. x_fp8 = clamp(x * (1 / scale)) in fp8 (1 / scale correctly rounded in float32:
a multiply per element, which every kernel reproduces bit for bit), dequantized = x_fp8 *
scale. So a block never shares a scale with another sequence (or another head): an inf, a
NaN or a huge finite value changes only the blocks it is in, as it would in bf16. Kernels
whose q tiles start at multiples of Q_BLOCK and whose key splits start at multiples of
KV_BLOCK from the sequence start (the plan's tile_q and kv_granularity) apply one scale per
64-row q block and per 128-key block inside the attention: a 128-key block is one step of
the Gluon kernel's key loop (one k and one v scale per step), two of the portable kernel's.

Per-tensor (`quantize_fp8`, the AITER provider, whose kernel API takes one scale per
tensor): the same scale over the whole tensor, with the same NaN-aware amax, and the cast
x / scale (torch's division, which the provider's in-place staging reproduces): a NaN
anywhere makes the scale NaN (it used to turn it into 1 silently and clamp everyone at
the fp8 maximum). Per-tensor scales couple every sequence of a packed batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: rows per scale block, counted from each sequence's start: queries, and keys/values
Q_BLOCK = 64
KV_BLOCK = 128


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """amax / fp8 max; 1 where amax is 0; NaN stays NaN, inf stays inf."""
    amax = amax.float()
    return torch.where(amax == 0, torch.ones_like(amax), amax / fp8_max(fp8_dtype))


def fp8_scale(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 scalar tensor on x's device: per-tensor scale (torch's amax propagates NaN)."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return scale_from_amax(amax, fp8_dtype)


def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, scale): x_fp8 has x's shape in `fp8_dtype`, scale is a float32 scalar tensor."""
    scale = fp8_scale(x, fp8_dtype)
    limit = fp8_max(fp8_dtype)
    # The clamp only guards rounding at the top of the range (x / scale <= limit in exact math).
    q = (x.float() / scale).clamp_(-limit, limit).to(fp8_dtype)
    return q, scale


def dequantize_fp8(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() * scale


def _row_blocks(cu_seqlens: Sequence[int], block: int, device) -> tuple[torch.Tensor, int]:
    """Block index of every row ([T] int64) and the number of blocks."""
    idx, base = [], 0
    for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False):
        n = b - a
        idx.append(torch.arange(n, dtype=torch.int64) // block + base)
        base += -(-n // block)
    rows = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
    return rows.to(device), base


def block_scales(x: torch.Tensor, cu_seqlens: Sequence[int], fp8_dtype: torch.dtype, *,
                 block: int) -> torch.Tensor:
    """float32 [T, H]: the scale of each row's (block, head) for x [T, H, D], blocks of
    `block` rows (Q_BLOCK or KV_BLOCK); rows past cu_seqlens[-1], if any, get 1."""
    cu = [int(c) for c in cu_seqlens]
    total, heads = x.shape[0], x.shape[1]
    rows, nblk = _row_blocks(cu, block, x.device)
    used = cu[-1] if cu else 0
    row_amax = x[:used].abs().float().amax(dim=-1)  # [T, H]; NaN propagates
    nan = torch.isnan(row_amax)
    index = rows[:, None].expand(-1, heads)
    blk_amax = torch.zeros(nblk, heads, device=x.device)
    blk_amax.scatter_reduce_(0, index, torch.where(nan, 0.0, row_amax), "amax", include_self=True)
    blk_nan = torch.zeros(nblk, heads, device=x.device)
    blk_nan.scatter_reduce_(0, index, nan.float(), "amax", include_self=True)
    blk_amax = torch.where(blk_nan > 0, float("nan"), blk_amax)
    out = torch.ones(total, heads, device=x.device)
    out[:used] = scale_from_amax(blk_amax, fp8_dtype)[rows]
    return out


def block_quantize(
    x: torch.Tensor, cu_seqlens: Sequence[int], fp8_dtype: torch.dtype, *, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [T, H, D], per-row scales float32 [T, H]) under the block rule, blocks of
    `block` rows (Q_BLOCK for q, KV_BLOCK for k and v).

    x_fp8 is always finite: where x * (1 / scale) is NaN (a block holding a NaN or an inf, whose
    scale is NaN or inf) it is 0. The block's scale still carries the NaN/inf into every
    result computed from the block, and a kernel that reads a neighbour's masked-off fp8
    values (a tile or a TMA box past a sequence's end) multiplies zeros, not NaN.
    """
    scale = block_scales(x, cu_seqlens, fp8_dtype, block=block)
    return block_cast(x, scale, fp8_max(fp8_dtype)).to(fp8_dtype), scale


def block_cast(x: torch.Tensor, scale: torch.Tensor, limit: float) -> torch.Tensor:
    """float32 x * (1 / scale) per row ([T, H] scales), NaN -> 0, clamped to +-limit: the
    values the fp8 cast rounds (kernels storing fp16 under the interpreter store these)."""
    inv = 1.0 / scale[..., None]
    return (x.float() * inv).nan_to_num_(nan=0.0).clamp_(-limit, limit)


def block_dequantize(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x_fp8 * its per-row scale ([T, H] broadcast over the features)."""
    return x_fp8.float() * scale[..., None]


def block_fake_quantize_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, fp8_dtype):
    """float32 (q, k, v) quantized and dequantized by the block rule: what the block-scaled
    fp8 kernels compute from (the torch kernel and the float64 reference use it)."""
    return (block_dequantize(*block_quantize(q, cu_seqlens_q, fp8_dtype, block=Q_BLOCK)),
            block_dequantize(*block_quantize(k, cu_seqlens_k, fp8_dtype, block=KV_BLOCK)),
            block_dequantize(*block_quantize(v, cu_seqlens_k, fp8_dtype, block=KV_BLOCK)))
