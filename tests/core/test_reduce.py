"""`mla_reduce` against the LSE-merge formula, computed independently in float64."""

from __future__ import annotations

import pytest
import torch

import mla_plugins
from mla_plugins.core.reference import relative_error
from tests.core.helpers import poisoned


def random_groups(gen, heads, dv, tile_q, *, n_tiles, total_q, neg_inf_frac=0.2, pad=0, final_map=True):
    """Random split tiles of 2..6 pieces over disjoint output rows, pieces in shuffled slots."""
    starts = sorted(torch.randperm(total_q // tile_q, generator=gen)[:n_tiles].tolist())
    counts = torch.randint(2, 7, (n_tiles,), generator=gen).tolist()
    n_pieces = sum(counts)
    slots = torch.randperm(n_pieces + 3, generator=gen)[:n_pieces].tolist()  # unused slots too
    P = (n_pieces + 3) * tile_q
    partial_out = torch.randn(P, heads, dv, generator=gen)
    partial_lse = torch.randn(P, heads, generator=gen) * 3
    partial_lse[torch.rand(P, heads, generator=gen) < neg_inf_frac] = float("-inf")
    indptr, fmap, pmap = [0], [], []
    for t, (s, c) in enumerate(zip(starts, counts, strict=True)):
        rows = tile_q if t % 2 == 0 or not final_map else tile_q - 17  # short last tiles too
        fmap.append([s * tile_q, s * tile_q + rows])
        pmap.extend(slot * tile_q for slot in slots[indptr[-1] : indptr[-1] + c])
        indptr.append(indptr[-1] + c)
    indptr += [indptr[-1]] * pad  # AITER allows trailing padding
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    fmap_t = i32(fmap).reshape(-1, 2)
    if pad:
        fmap_t = torch.cat([fmap_t, torch.zeros(pad, 2, dtype=torch.int32)])
    return partial_out, partial_lse, i32(indptr), fmap_t, i32(pmap)


def formula(partial_out, partial_lse, indptr, fmap, pmap, total_q, heads, dv):
    """Direct float64 loop: final_lse = log sum exp(lse_j); out = sum exp(lse_j - final) O_j."""
    out = torch.full((total_q, heads, dv), float("nan"), dtype=torch.float64)
    lse = torch.full((total_q, heads), float("nan"), dtype=torch.float64)
    for t in range(indptr.numel() - 1):
        s0, s1 = int(indptr[t]), int(indptr[t + 1])
        if s1 - s0 < 2:
            continue
        q0, q1 = fmap[t].tolist()
        for r in range(q0, q1):
            rows = [int(pmap[j]) + r - q0 for j in range(s0, s1)]
            lse_j = partial_lse[rows].double()  # [n, H]
            o = partial_out[rows].double()  # [n, H, Dv]
            final = torch.logsumexp(lse_j, dim=0)
            w = torch.where(torch.isfinite(final), torch.exp(lse_j - final), 0.0)
            out[r] = (w[..., None] * o).sum(0)
            lse[r] = final
    return out, lse


@pytest.mark.parametrize("heads,dv", [(1, 128), (16, 128), (8, 512)])
@pytest.mark.parametrize("pad", [0, 3])
def test_reduce_matches_formula(heads, dv, pad):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    tile_q, total_q = 32, 32 * 12
    po, pl, indptr, fmap, pmap = random_groups(gen, heads, dv, tile_q, n_tiles=5, total_q=total_q, pad=pad)
    out = poisoned((total_q, heads, dv), torch.bfloat16)
    final_lse = poisoned((total_q, heads), torch.float32)
    mla_plugins.mla_reduce(po, pl, indptr, fmap, pmap, tile_q, 0, out, final_lse)
    exp_out, exp_lse = formula(po, pl, indptr, fmap, pmap, total_q, heads, dv)
    written = ~torch.isnan(exp_lse)
    # rows outside split tiles are not the reduce's: they keep their poison
    assert torch.isnan(final_lse[~written]).all()
    assert not torch.isnan(out[written]).any() and not torch.isnan(final_lse[written]).any()
    assert relative_error(out[written], exp_out[written]) <= 1e-2
    fin = torch.isfinite(exp_lse) & written
    assert torch.equal(torch.isfinite(final_lse[written]), fin[written])
    assert (final_lse[written & ~fin] == float("-inf")).all()
    assert (out[written & ~fin] == 0).all()
    assert relative_error(final_lse[fin], exp_lse[fin]) <= 1e-6


def test_reduce_without_final_map_uses_aiter_rule():
    """No final map: tile t covers rows [t*rows, (t+1)*rows), rows from the first two pieces."""
    gen = torch.Generator().manual_seed(1)
    heads, dv, rows = 4, 128, 16
    po = torch.randn(8 * rows, heads, dv, generator=gen)
    pl = torch.randn(8 * rows, heads, generator=gen)
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    pmap = torch.tensor([0, 16, 32, 48, 64], dtype=torch.int32)
    out = poisoned((2 * rows, heads, dv), torch.float16)
    mla_plugins.mla_reduce(po, pl, indptr, None, pmap, rows, 0, out)
    fmap = torch.tensor([[0, rows], [rows, 2 * rows]], dtype=torch.int32)
    exp_out, _ = formula(po, pl, indptr, fmap, pmap, 2 * rows, heads, dv)
    assert relative_error(out, exp_out) <= 1e-2


def test_single_piece_groups_are_skipped():
    po = torch.randn(64, 2, 128)
    pl = torch.randn(64, 2)
    out = poisoned((32, 2, 128), torch.bfloat16)
    mla_plugins.mla_reduce(po, pl, torch.tensor([0, 1], dtype=torch.int32),
                           torch.tensor([[0, 32]], dtype=torch.int32),
                           torch.tensor([0], dtype=torch.int32), 32, 0, out)
    assert torch.isnan(out).all()
