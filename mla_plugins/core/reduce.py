"""The LSE merge of split-KV pieces, as AITER's `mla_reduce_v1` computes it (torch, any device).

For split tile t with pieces j (rows `reduce_partial_map[s0 + j] + (r - q_start)`):
    final_lse[r, h] = log(sum_j exp(lse_j))          (max-subtracted)
    out[r, h, :]    = sum_j exp(lse_j - final_lse) * partial_out_j
Groups of fewer than two pieces and padding at the end of `reduce_indptr` are skipped, as
AITER skips them. Unlike AITER (which writes +inf), a row whose pieces all have lse -inf gets
lse -inf and output 0: it saw no key.
"""

from __future__ import annotations

import torch


def reduce_index(
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    tile_q: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_row, partial_row) int64 pairs, one per (output row, piece) of every split tile."""
    device = reduce_partial_map.device
    indptr = reduce_indptr.long()
    pmap = reduce_partial_map.long()
    starts, ends = indptr[:-1], indptr[1:]
    counts = ends - starts
    num_tiles = counts.numel()
    if reduce_final_map is not None:
        q0 = reduce_final_map[:, 0].long()
        rows = reduce_final_map[:, 1].long() - q0
    else:
        # AITER's rule without a final map: rows from the first two pieces, tiles back to back.
        first = pmap[starts.clamp(max=max(pmap.numel() - 2, 0))] if pmap.numel() else starts
        second = pmap[(starts + 1).clamp(max=max(pmap.numel() - 1, 0))] if pmap.numel() else starts
        rows = (second - first).clamp(min=0)
        q0 = torch.arange(num_tiles, device=device) * rows
    keep = (counts >= 2) & (rows > 0)
    counts = torch.where(keep, counts, torch.zeros_like(counts))
    # one entry per piece: its tile, its base row
    piece_tile = torch.repeat_interleave(torch.arange(num_tiles, device=device), counts)
    piece_first = torch.repeat_interleave(starts, counts)
    piece_rank = torch.arange(piece_tile.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    piece_base = pmap[piece_first + piece_rank]
    piece_rows = rows[piece_tile]
    # one entry per (piece, row)
    pair_piece = torch.repeat_interleave(torch.arange(piece_tile.numel(), device=device), piece_rows)
    offset = torch.arange(pair_piece.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(piece_rows, 0) - piece_rows, piece_rows
    )
    out_row = q0[piece_tile][pair_piece] + offset
    partial_row = piece_base[pair_piece] + offset
    return out_row, partial_row


def torch_reduce(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    tile_q: int,
    out: torch.Tensor,
    final_lse: torch.Tensor | None = None,
) -> None:
    """In place: merge the pieces into `out` [total_q, H, Dv] and `final_lse` [total_q, H]."""
    out_row, partial_row = reduce_index(reduce_indptr, reduce_final_map, reduce_partial_map, tile_q)
    if out_row.numel() == 0:
        return
    total_q, heads, dv = out.shape
    lse = partial_lse[partial_row].float()  # [pairs, H]
    o = partial_out[partial_row].float()  # [pairs, H, Dv]
    idx = out_row[:, None].expand(-1, heads)
    m = torch.full((total_q, heads), float("-inf"), device=out.device)
    m.scatter_reduce_(0, idx, lse, reduce="amax")
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe[out_row])  # exp(-inf) = 0 for pieces that saw no key
    s = torch.zeros((total_q, heads), device=out.device).index_add_(0, out_row, w)
    acc = torch.zeros((total_q, heads, dv), device=out.device).index_add_(0, out_row, w[..., None] * o)
    rows = torch.unique(out_row)
    s_rows = s[rows]
    seen = s_rows > 0
    merged = torch.where(seen[..., None], acc[rows] / torch.where(seen, s_rows, 1.0)[..., None], 0.0)
    out[rows] = merged.to(out.dtype)
    if final_lse is not None:
        final_lse[rows] = torch.where(seen, torch.log(torch.where(seen, s_rows, 1.0)) + m_safe[rows], float("-inf"))
