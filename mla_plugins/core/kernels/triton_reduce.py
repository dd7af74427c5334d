"""Phase 2 of the Triton kernel: the LSE merge of split-KV pieces (`core/reduce.py`'s contract).

A split tile's pieces are `tile_q`-row slots of the partial buffers, so one piece of one
tile is a contiguous `[rows, H, Dv]` block: a program takes `BLOCK_E` consecutive
(row, head) pairs of one tile and walks its pieces twice, first over their lse (4 bytes
a pair) for the max, then over their outputs with weights `exp(lse_j - max)`. Each
output element is read once per piece and written once, so the kernel runs at memory
speed; the bytes it must move are `pieces * rows * H * (4 * Dv + 4) + rows * H * 2 * Dv`.

Like the torch reduce: groups with fewer than two pieces (trailing padding of
`reduce_indptr`) are skipped; a row whose pieces all have lse -inf gets out 0 and lse
-inf; without `reduce_final_map`, tile t covers rows `[t * n, (t + 1) * n)` with
`n = partial_map[start + 1] - partial_map[start]` (AITER's rule).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the provider reports "triton is not installed"
    triton = None

if triton is not None:

    # the tile count follows the batch: not specialized, one variant per model
    @triton.jit(do_not_specialize=["num_final_rows"])
    def _reduce_kernel(
        PartO, PartLse, Indptr, FinalMap, PartialMap, Out, FinalLse,
        num_final_rows, heads,
        spo_r, spo_h, spl_r, spl_h, so_t, so_h, sfl_t, sfl_h, sfm,
        HAS_FINAL_MAP: tl.constexpr, HAS_FINAL_LSE: tl.constexpr,
        DV: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        t = tl.program_id(0)
        start = tl.load(Indptr + t)
        end = tl.load(Indptr + t + 1)
        if HAS_FINAL_MAP:
            ok_tile = t < num_final_rows
            q0 = tl.load(FinalMap + t * sfm, mask=ok_tile, other=0)
            q1 = tl.load(FinalMap + t * sfm + 1, mask=ok_tile, other=0)
        else:
            ok_tile = end - start >= 2
            first = tl.load(PartialMap + start, mask=ok_tile, other=0)
            second = tl.load(PartialMap + start + 1, mask=ok_tile, other=0)
            n = tl.maximum(second - first, 0)
            q0 = t * n
            q1 = q0 + n
        rows = q1 - q0
        if ok_tile & (end - start >= 2):
            step = tl.num_programs(1) * BLOCK_E
            for e0 in range(tl.program_id(1) * BLOCK_E, rows * heads, step):
                _merge_block(PartO, PartLse, PartialMap, Out, FinalLse, start, end, q0, e0,
                             rows * heads, heads, spo_r, spo_h, spl_r, spl_h, so_t, so_h, sfl_t, sfl_h,
                             HAS_FINAL_LSE, DV, BLOCK_E)

    @triton.jit
    def _merge_block(
        PartO, PartLse, PartialMap, Out, FinalLse, start, end, q0, e0, n_pairs, heads,
        spo_r, spo_h, spl_r, spl_h, so_t, so_h, sfl_t, sfl_h,
        HAS_FINAL_LSE: tl.constexpr, DV: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        """Merge pairs [e0, e0 + BLOCK_E) of one tile; a pair is (row r, head h), e = r * H + h."""
        e = e0 + tl.arange(0, BLOCK_E)
        ok = e < n_pairs
        r = e // heads
        h = e % heads
        cols = tl.arange(0, DV)
        m = tl.full([BLOCK_E], float("-inf"), dtype=tl.float32)
        for j in range(start, end):
            base = tl.load(PartialMap + j)
            lse = tl.load(PartLse + (base + r).to(tl.int64) * spl_r + h * spl_h, mask=ok,
                          other=float("-inf"))
            m = tl.maximum(m, lse)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.zeros([BLOCK_E], dtype=tl.float32)
        acc = tl.zeros([BLOCK_E, DV], dtype=tl.float32)
        for j in range(start, end):
            base = tl.load(PartialMap + j)
            row = (base + r).to(tl.int64)
            lse = tl.load(PartLse + row * spl_r + h * spl_h, mask=ok, other=float("-inf"))
            w = tl.exp(lse - m_safe)
            # pieces that saw no key (w = 0) are not read: their rows may hold anything
            o = tl.load(PartO + row[:, None] * spo_r + h.to(tl.int64)[:, None] * spo_h + cols[None, :],
                        mask=(ok & (w > 0))[:, None], other=0.0)
            s += w
            acc += w[:, None] * o
        seen = s > 0
        out = acc * tl.where(seen, 1.0 / tl.where(seen, s, 1.0), 0.0)[:, None]
        orow = (q0 + r).to(tl.int64)
        tl.store(Out + orow[:, None] * so_t + h.to(tl.int64)[:, None] * so_h + cols[None, :],
                 out.to(Out.dtype.element_ty), mask=ok[:, None])
        if HAS_FINAL_LSE:
            final = tl.where(seen, m_safe + tl.log(tl.where(seen, s, 1.0)), float("-inf"))
            tl.store(FinalLse + orow * sfl_t + h * sfl_h, final, mask=ok)


def reduce(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    tile_q: int,
    out: torch.Tensor,
    final_lse: torch.Tensor | None,
    block_e: int = 16,
    num_warps: int = 4,
) -> None:
    """In place: out [total_q, H, Dv] (and final_lse [total_q, H]) from the pieces.

    partial_out fp32 [P, H, Dv], partial_lse fp32 [P, H]; tiles have at most `tile_q`
    rows (`reduce_final_map` may name fewer). Needs a unit stride in the last dim of
    partial_out and out.
    """
    groups = reduce_indptr.numel() - 1
    heads, dv = out.shape[1], out.shape[2]
    if groups <= 0 or reduce_partial_map.numel() == 0 or heads == 0:
        return
    if reduce_final_map is not None:
        groups = min(groups, reduce_final_map.shape[0])
    if groups <= 0:
        return
    # programs per tile sized for tile_q rows; they loop if a final map names longer tiles
    grid = (groups, triton.cdiv(tile_q * heads, block_e))
    fm = reduce_final_map if reduce_final_map is not None else reduce_indptr
    fl = final_lse if final_lse is not None else partial_lse
    _reduce_kernel[grid](
        partial_out, partial_lse, reduce_indptr, fm, reduce_partial_map, out, fl,
        reduce_final_map.shape[0] if reduce_final_map is not None else 0, heads,
        partial_out.stride(0), partial_out.stride(1), partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1), fl.stride(0), fl.stride(1),
        fm.stride(0) if reduce_final_map is not None else 0,
        HAS_FINAL_MAP=reduce_final_map is not None, HAS_FINAL_LSE=final_lse is not None,
        DV=dv, BLOCK_E=block_e, num_warps=num_warps,
    )
