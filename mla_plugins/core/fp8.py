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

Per (sequence, head) (`head_quantize`: the FlashAttention-3 provider, whose FP8 kernel takes
one descale per (sequence, head), `[batch, heads]`): the block rule with one block per
sequence. It couples no two requests either.

Rotation (incoherent processing, `fp8_rotate`, off by default, for a 192-wide query/key
head): before the cast, q and k are multiplied by the same fixed orthonormal matrix
R = diag(signs) (H12 ⊗ H16) / sqrt(192) (Paley's Hadamard matrix of order 12 times
Sylvester's of order 16: every entry is ±1/sqrt(192)). q R (k R)^T = q k^T, so every logit,
the output and the lse are those of the unrotated inputs in exact arithmetic; what changes is
the rounding: a feature far larger than the others (keys and queries of real models carry
such outlier features) is spread evenly over all 192 rotated features, so the logit stops
being dominated by a few coarsely rounded products. v and the output are not rotated.
Kernels compute (x @ M) * ROTATION_SCALE in float32 with M the ±1 matrix (`rotation_pm1`,
exact in bf16/fp16/fp8); the torch kernel and the reference rotate in float64 (exact sums of
bf16 inputs) and round to float32. The scale of a rotated block is not the amax of the
rotated values but the bound every one of them obeys, |(x R)_i| <= sum_j |x_j| / sqrt(192)
(`l1_bound`), taken over the block's rows: known from the unrotated input, so a kernel sets
the scale before it rotates (the per-(sequence, head) rule reads the sequence once for its
scales and once to rotate and cast) and a large finite input cannot overflow it the way a
sum of squares would. Measured (benchmarks/NOTES.md): no loss against the exact amax.

Outlier features corrected (`fp8_outliers`, off by default; not with the rotation, which
mixes the features this corrects one by one): q, k and v go through the block rule above
unchanged, and for each (sequence, head) the `OUTLIER_FEATURES` (8) features f of largest
amax(|q_f|) * amax(|k_f|) over the sequence's q rows and k rows (`outlier_features`: float32
amaxes, NaN propagated; a NaN score counts as +inf; ties to the lower feature index) get the
products their fp8 rounding lost added back. With u = the value the cast rounds (`block_cast`:
x * (1 / scale), NaN -> 0, clamped to +-max) split as h = fp8(u) (the fp8 byte itself) and
l = fp8(u - h), the 32-wide fp8 side tiles hold (`side_cast`, 8 columns a group, the selected
features in ascending order) q: [h, l, l, 0] and k: [l, h, l, 0], so that q_side k_side^T =
sum_f qh kl + ql kh + ql kl, which the fp8 product's qh kh completes to (qh + ql)(kh + kl):
each outlier product to ~8 significant bits instead of 4, in one more 32-deep fp8
tensor-core step per key block, in the fp8 product's units (the same scales), accumulated
with it. A logit is then the fp8 product plus the corrections of the few large features: with
the issue-22 recipe (five features x30) 0.031 against the rotation's 0.11 and plain fp8's 0.37
(benchmarks/NOTES.md). The selection reads one sequence's rows only, so one request's values
never change another's rounding; the logits, so the lse, are those of the inputs up to
rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

#: rows per scale block, counted from each sequence's start: queries, and keys/values
Q_BLOCK = 64
KV_BLOCK = 128

#: the query/key head width the rotation is defined for (128 "nope" + 64 "rope" features)
ROTATION_DIM = 192
#: the magnitude of every entry of the rotation: 1 / sqrt(192)
ROTATION_SCALE = ROTATION_DIM ** -0.5
#: feature j's sign (bit j), drawn once (random.Random(20261202)) and frozen: random signs keep
#: outliers on neighbouring features from adding up in the same rotated feature
ROTATION_SIGNS = 0x91E76681002295C1CB44DECA7D02098321203E18328A85B2


def _paley12() -> list[list[int]]:
    """Paley's Hadamard matrix of order 12 (from the quadratic residues mod 11)."""
    p = 11
    residues = {(i * i) % p for i in range(1, p)}

    def chi(a: int) -> int:
        return 0 if a % p == 0 else (1 if a % p in residues else -1)

    h = [[1] * 12] + [[-1] + [chi(j - i) for j in range(p)] for i in range(p)]
    for i in range(12):  # S + I, S skew-symmetric
        h[i][i] = 1
    return h


@functools.cache
def _pm1_rows() -> tuple[tuple[int, ...], ...]:
    """The ±1 matrix M = diag(signs) (H12 ⊗ H16): row j is input feature j."""
    h16 = [[1]]
    while len(h16) < 16:
        h16 = [r + r for r in h16] + [r + [-x for x in r] for r in h16]
    h12 = _paley12()
    rows = []
    for j in range(ROTATION_DIM):
        sign = -1 if (ROTATION_SIGNS >> j) & 1 else 1
        a, b = divmod(j, 16)
        rows.append(tuple(sign * h12[a][c // 16] * h16[b][c % 16] for c in range(ROTATION_DIM)))
    return tuple(rows)


def rotation_pm1(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """M [192, 192] with entries ±1 (exact in every float format): x R = (x @ M) * ROTATION_SCALE."""
    return torch.tensor(_pm1_rows(), dtype=dtype, device=device)


def rotation_matrix(dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """R [192, 192], orthonormal: R @ R.T == I."""
    return rotation_pm1(torch.float64, device).mul_(ROTATION_SCALE).to(dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """float32 x @ R over the last dim (192): summed in float64, where the sums of bf16/fp16
    inputs are exact, so a row's result never depends on the rows beside it."""
    m = rotation_pm1(torch.float64, x.device)
    return (x.double() @ m).mul_(ROTATION_SCALE).float()


def l1_bound(x: torch.Tensor) -> torch.Tensor:
    """float32 [...]: sum_j |x_j| * ROTATION_SCALE over the last dim, which bounds every
    rotated value |(x R)_i| of the row (NaN propagates, inf stays inf)."""
    return x.float().abs().sum(dim=-1).mul_(ROTATION_SCALE)


#: features of each (sequence, head) whose fp8 rounding `fp8_outliers` corrects, and the width
#: of the side tiles that carry the corrections (three 8-column groups and one of zeros: one
#: 32-deep fp8 tensor-core step)
OUTLIER_FEATURES = 8
OUTLIER_WIDTH = 32


def rotation_applies(head_dim_qk: int, fp8_rotate: bool | None, outliers: bool = False) -> bool:
    """Whether q and k are rotated: `fp8_rotate` (None: MLA_PLUGINS_FP8_ROTATE, default off),
    for the 192-wide head the rotation is defined for, and never with `outliers` (fp8_outliers
    corrects features one by one, which the rotation mixes). An explicit True with another
    head width, or with `outliers`, raises ValueError naming the argument."""
    if fp8_rotate is None:
        from .settings import fp8_rotate_enabled

        return head_dim_qk == ROTATION_DIM and not outliers and fp8_rotate_enabled()
    if fp8_rotate and head_dim_qk != ROTATION_DIM:
        raise ValueError(
            f"fp8_rotate: found True with query/key head dim {head_dim_qk}, expected head dim "
            f"{ROTATION_DIM} (the rotation is defined for 128 + 64 features); pass "
            "fp8_rotate=None or False"
        )
    if fp8_rotate and outliers:
        raise ValueError(
            "fp8_rotate: found True with fp8_outliers, expected one of the two (the outlier "
            "corrections are per feature, and the rotation mixes the features); pass "
            "fp8_rotate=None or False, or fp8_outliers=False"
        )
    return bool(fp8_rotate)


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
                 block: int, rotated: bool = False) -> torch.Tensor:
    """float32 [T, H]: the scale of each row's (block, head) for x [T, H, D], blocks of
    `block` rows (Q_BLOCK, KV_BLOCK, or a block longer than any sequence for one scale per
    sequence); rows past cu_seqlens[-1], if any, get 1. `rotated`: x is the unrotated input
    of a rotated operand, and the block's scale is the largest `l1_bound` of its rows."""
    cu = [int(c) for c in cu_seqlens]
    total, heads = x.shape[0], x.shape[1]
    rows, nblk = _row_blocks(cu, block, x.device)
    used = cu[-1] if cu else 0
    # [T, H]; NaN propagates
    row_amax = l1_bound(x[:used]) if rotated else x[:used].abs().float().amax(dim=-1)
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
    x: torch.Tensor, cu_seqlens: Sequence[int], fp8_dtype: torch.dtype, *, block: int,
    rotate_: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [T, H, D], per-row scales float32 [T, H]) under the block rule, blocks of
    `block` rows (Q_BLOCK for q, KV_BLOCK for k and v). `rotate_`: x_fp8 holds x R (q and k
    under the rotation), scaled by the `l1_bound` rule.

    x_fp8 is always finite: where x * (1 / scale) is NaN (a block holding a NaN or an inf, whose
    scale is NaN or inf) it is 0. The block's scale still carries the NaN/inf into every
    result computed from the block, and a kernel that reads a neighbour's masked-off fp8
    values (a tile or a TMA box past a sequence's end) multiplies zeros, not NaN.
    """
    scale = block_scales(x, cu_seqlens, fp8_dtype, block=block, rotated=rotate_)
    values = rotate(x) if rotate_ else x
    return block_cast(values, scale, fp8_max(fp8_dtype)).to(fp8_dtype), scale


def block_cast(x: torch.Tensor, scale: torch.Tensor, limit: float) -> torch.Tensor:
    """float32 x * (1 / scale) per row ([T, H] scales), NaN -> 0, clamped to +-limit: the
    values the fp8 cast rounds (kernels storing fp16 under the interpreter store these)."""
    inv = 1.0 / scale[..., None]
    return (x.float() * inv).nan_to_num_(nan=0.0).clamp_(-limit, limit)


def block_dequantize(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x_fp8 * its per-row scale ([T, H] broadcast over the features)."""
    return x_fp8.float() * scale[..., None]


def block_fake_quantize_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, fp8_dtype, *,
                            rotate_: bool = False, per_sequence: bool = False,
                            outliers: bool = False):
    """float32 (q, k, v) quantized and dequantized by the block rule: what the block-scaled
    fp8 kernels compute from (the torch kernel and the float64 reference use it).

    rotate_: q and k come back rotated (q R, k R: the same logits, the rotation's rounding).
    per_sequence: one scale per (sequence, head) (`head_quantize`'s rule) instead of blocks.
    outliers: q and k come back [T, H, D + OUTLIER_WIDTH], the outlier features' corrections
    beside them (`split_fake_quantize_qk`; not with rotate_); v as without.
    """
    qb, kb = (SEQUENCE_BLOCK, SEQUENCE_BLOCK) if per_sequence else (Q_BLOCK, KV_BLOCK)
    if outliers:
        if rotate_:
            raise ValueError("rotate_: found True with outliers, expected one of the two "
                             "(rotation_applies)")
        qs, ks = split_fake_quantize_qk(q, k, cu_seqlens_q, cu_seqlens_k, fp8_dtype,
                                        per_sequence=per_sequence)
        return qs, ks, block_dequantize(*block_quantize(v, cu_seqlens_k, fp8_dtype, block=kb))
    return (block_dequantize(*block_quantize(q, cu_seqlens_q, fp8_dtype, block=qb, rotate_=rotate_)),
            block_dequantize(*block_quantize(k, cu_seqlens_k, fp8_dtype, block=kb, rotate_=rotate_)),
            block_dequantize(*block_quantize(v, cu_seqlens_k, fp8_dtype, block=kb)))


#: a block longer than any sequence: the block rule with one scale per (sequence, head)
SEQUENCE_BLOCK = 1 << 62


def head_quantize(x: torch.Tensor, cu_seqlens: Sequence[int], fp8_dtype: torch.dtype, *,
                  rotate_: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [T, H, D], scales float32 [B, H]): one scale per (sequence, head), FA3's
    descale layout; an empty sequence's scale is 1. The torch statement of what the FA3
    provider's quantization kernel computes."""
    x8, rows = block_quantize(x, cu_seqlens, fp8_dtype, block=SEQUENCE_BLOCK, rotate_=rotate_)
    cu = [int(c) for c in cu_seqlens]
    scales = torch.ones(len(cu) - 1, x.shape[1], device=x.device)
    for b in range(len(cu) - 1):
        if cu[b + 1] > cu[b]:
            scales[b] = rows[cu[b]]
    return x8, scales


def outliers_apply(head_dim_qk: int, fp8_outliers: bool | None, fp8: bool = True) -> bool:
    """Whether the fp8 rounding of q's and k's outlier features is corrected: in fp8 only (`fp8`),
    `fp8_outliers` (None: MLA_PLUGINS_FP8_OUTLIERS, default off). Another type than bool or
    None raises TypeError whatever the mode, and in fp8 a head narrower than
    OUTLIER_FEATURES + 1 features ValueError, naming the argument."""
    if fp8_outliers is not None and not isinstance(fp8_outliers, bool):
        raise TypeError(f"fp8_outliers: found {type(fp8_outliers).__name__}, expected bool or None")
    if not fp8:
        return False
    if fp8_outliers is None:
        from .settings import fp8_outliers_enabled

        return head_dim_qk > OUTLIER_FEATURES and fp8_outliers_enabled()
    if fp8_outliers and head_dim_qk <= OUTLIER_FEATURES:
        raise ValueError(
            f"fp8_outliers: found True with query/key head dim {head_dim_qk}, expected more than "
            f"{OUTLIER_FEATURES} features; pass fp8_outliers=None or False"
        )
    return bool(fp8_outliers)


def outlier_features(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: Sequence[int],
                     cu_seqlens_k: Sequence[int]) -> torch.Tensor:
    """int64 [B, H, OUTLIER_FEATURES]: each (sequence, head)'s features of largest
    amax(|q_f|) * amax(|k_f|) over its rows (float32; NaN scores count as +inf; ties to the
    lower index), in ascending feature order. q [Tq, H, D], k [Tk, H, D]."""
    cq, ck = [int(c) for c in cu_seqlens_q], [int(c) for c in cu_seqlens_k]
    heads, dim = q.shape[1], q.shape[2]
    out = torch.empty(len(cq) - 1, heads, OUTLIER_FEATURES, dtype=torch.int64, device=q.device)

    def amax(x, a, b):
        if b <= a:
            return torch.zeros(heads, dim, device=x.device)
        return x[a:b].abs().float().amax(dim=0)  # NaN propagates

    for b in range(len(cq) - 1):
        score = amax(q, cq[b], cq[b + 1]) * amax(k, ck[b], ck[b + 1])
        score = torch.where(torch.isnan(score), float("inf"), score)
        top = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :OUTLIER_FEATURES]
        out[b] = top.sort(dim=-1).values
    return out


def _row_selection(features: torch.Tensor, cu_seqlens: Sequence[int], total: int) -> torch.Tensor:
    """int64 [T, H, OUTLIER_FEATURES]: every row's sequence's selected features (rows past
    cu_seqlens[-1], if any, select features 0..7 of nothing: they are zero rows)."""
    cu = torch.tensor([int(c) for c in cu_seqlens], dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    rows = features[torch.cat([seq, seq.new_zeros(total - len(seq))]).to(features.device)]
    if len(seq) < total:
        rows[len(seq):] = torch.arange(OUTLIER_FEATURES, device=features.device)
    return rows


def side_cast(u: torch.Tensor, operand: str, dtype: torch.dtype) -> torch.Tensor:
    """[T, H, OUTLIER_WIDTH] in `dtype` (the fp8 format; fp16 where the Triton interpreter,
    which has no fp8, runs the kernels): the selected features' values as the cast rounds
    them, u [T, H, OUTLIER_FEATURES] (`block_cast`'s, ascending feature order), split as
    h = dtype(u), l = dtype(u - h); `operand` "q": [h, l, l, 0], "k": [l, h, l, 0] (8 columns
    a group). |u - h| is at most half a step of h, so l never overflows."""
    hi = u.to(dtype)
    lo = (u - hi.float()).to(dtype)
    groups = {"q": (hi, lo, lo), "k": (lo, hi, lo)}[operand]
    return torch.cat([*groups, torch.zeros_like(hi)], dim=-1)


def split_quantize(x: torch.Tensor, cu_seqlens: Sequence[int], features: torch.Tensor,
                   fp8_dtype: torch.dtype, *, block: int, operand: str,
                   side_dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_fp8 [T, H, D], scales float32 [T, H], side [T, H, OUTLIER_WIDTH]): the block rule
    on x (q or k, `operand`), unchanged, and the corrections of its sequence's selected
    `features` (`side_cast`, in `side_dtype`, the fp8 format by default), in the same
    block's units."""
    scale = block_scales(x, cu_seqlens, fp8_dtype, block=block)
    u = block_cast(x, scale, fp8_max(fp8_dtype))
    picked = torch.gather(u, 2, _row_selection(features, cu_seqlens, x.shape[0]))
    return u.to(fp8_dtype), scale, side_cast(picked, operand, side_dtype or fp8_dtype)


def split_dequantize(x8: torch.Tensor, scale: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """float32 [T, H, D + OUTLIER_WIDTH]: the dequantized fp8 part, then the side tile
    dequantized by the same scale. The logit of q' and k' so built, over all those columns,
    is the fp8 product plus the corrections, as a kernel adds them."""
    return torch.cat([block_dequantize(x8, scale), block_dequantize(side, scale)], dim=-1)


def split_fake_quantize_qk(q, k, cu_seqlens_q, cu_seqlens_k, fp8_dtype, *,
                           per_sequence: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (q', k') [T, H, D + OUTLIER_WIDTH] under `fp8_outliers` (split_dequantize's
    layout): what the fp8 kernels compute q k^T from when the outlier features' rounding is
    corrected."""
    qb, kb = (SEQUENCE_BLOCK, SEQUENCE_BLOCK) if per_sequence else (Q_BLOCK, KV_BLOCK)
    features = outlier_features(q, k, cu_seqlens_q, cu_seqlens_k)
    res = []
    for x, cu, blk, operand in ((q, cu_seqlens_q, qb, "q"), (k, cu_seqlens_k, kb, "k")):
        res.append(split_dequantize(*split_quantize(x, cu, features, fp8_dtype, block=blk,
                                                    operand=operand)))
    return res[0], res[1]
