"""Plan invariants: every output row produced once; pieces cover a tile's visible keys once."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_plugins
from mla_plugins.core.reference import reference_attention, relative_error
from tests.core.helpers import BF16_TOL, cu_seqlens, random_batch


def visible_keys(q_len, k_len, row_end, causal):
    return min(max(k_len - q_len + row_end, 0), k_len) if causal else k_len


def check_plan(plan, lens_q, lens_k, heads, causal):
    cq, ck = cu_seqlens(lens_q).tolist(), cu_seqlens(lens_k).tolist()
    info = plan.work_info.tolist()
    indptr = plan.work_indptr.tolist()
    assert indptr[0] == 0 and indptr[-1] == len(info) and indptr == sorted(indptr)
    assert len(indptr) == plan.num_workers + 1

    # per (tile, head) the pieces: rows produced once, keys covered once
    by_tile = defaultdict(list)
    for b, loc, q0, q1, kv0, kv1, kv_offset, hr in info:
        assert cq[b] <= q0 < q1 <= cq[b + 1]
        assert q1 - q0 <= plan.tile_q
        assert ck[b] <= kv0 <= kv1 <= ck[b + 1]
        assert kv_offset == ck[b] + (lens_k[b] - lens_q[b]) - cq[b]
        if loc >= 0:
            assert loc % plan.tile_q == 0 and loc + (q1 - q0) <= plan.partial_rows()
        for h in range(hr & 0xFFFF, hr >> 16):
            by_tile[(q0, q1, h)].append((kv0, kv1, loc))
    rows_seen = torch.zeros(cq[-1], heads, dtype=torch.int64)
    for (q0, q1, h), pieces in by_tile.items():
        rows_seen[q0:q1, h] += 1
        b = next(i for i in range(len(lens_q)) if cq[i] <= q0 < cq[i + 1])
        eff = visible_keys(lens_q[b], lens_k[b], q1 - cq[b], causal)
        spans = sorted((kv0, kv1) for kv0, kv1, _ in pieces)
        assert spans[0][0] == ck[b] and spans[-1][1] == ck[b] + eff
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end == start, "pieces must tile the visible keys exactly once"
        locs = [loc for *_, loc in pieces]
        if len(pieces) == 1:
            assert locs == [-1], "an unsplit tile is written straight to the output"
        else:
            assert all(loc >= 0 for loc in locs)
    assert (rows_seen == 1).all(), "every output row of every head is produced exactly once"

    # reduce maps: a group per split tile, never a group of one, rows exactly the split tiles
    rindptr = plan.reduce_indptr.tolist()
    fmap = plan.reduce_final_map.tolist()
    pmap = plan.reduce_partial_map.tolist()
    assert len(rindptr) == len(fmap) + 1 and rindptr[-1] == len(pmap) == plan.num_partial_tiles
    split_tiles = {(q0, q1): sorted(loc for *_, loc in pieces)
                   for (q0, q1, h), pieces in by_tile.items() if len(pieces) > 1}
    assert len(fmap) == len(split_tiles)
    for t, (q0, q1) in enumerate(fmap):
        assert rindptr[t + 1] - rindptr[t] >= 2
        assert sorted(pmap[rindptr[t] : rindptr[t + 1]]) == split_tiles[(q0, q1)]
    assert len(set(pmap)) == len(pmap), "pieces own distinct partial rows"

    # load balance: per-worker units differ by at most one within a cluster
    per_cluster = plan.num_workers // plan.num_clusters
    for c in range(plan.num_clusters):
        units = []
        for w in range(c * per_cluster, (c + 1) * per_cluster):
            items = info[indptr[w] : indptr[w + 1]]
            units.append(sum(-(-(kv1 - kv0) // plan.kv_granularity) if kv1 > kv0 else 0
                             for _, _, _, _, kv0, kv1, _, _ in items))
        assert max(units) - min(units) <= 1


@pytest.mark.parametrize("workers", [1, 2, 3, 7, 16, 132])
@pytest.mark.parametrize("causal", [True, False])
def test_plan_invariants(workers, causal):
    lens_q, lens_k = [0, 1, 255, 256, 257, 1000, 300], [0, 1, 255, 256, 400, 1000, 1100]
    heads = 16
    plan = mla_plugins.plan_prefill(cu_seqlens(lens_q), cu_seqlens(lens_k), num_heads=heads,
                                    causal=causal, num_workers=workers)
    check_plan(plan, lens_q, lens_k, heads, causal)
    if workers // math.gcd(heads, workers) > 1:
        assert plan.num_partial_tiles > 0, "several workers per cluster must split tiles"


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 400)), min_size=1, max_size=6),
    heads=st.sampled_from([1, 2, 3, 16, 128]),
    workers=st.integers(1, 40),
    tile_q=st.sampled_from([16, 64, 256]),
    gran=st.sampled_from([16, 128]),
    causal=st.booleans(),
)
def test_plan_properties(lens, heads, workers, tile_q, gran, causal):
    lens_q = [q for q, _ in lens]
    lens_k = [q + extra for q, extra in lens]  # k_len >= q_len: chunked prefill with a prefix
    plan = mla_plugins.plan_prefill(cu_seqlens(lens_q), cu_seqlens(lens_k), num_heads=heads,
                                    causal=causal, tile_q=tile_q, kv_granularity=gran,
                                    num_workers=workers)
    check_plan(plan, lens_q, lens_k, heads, causal)


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=4),
    workers=st.integers(2, 12),
    causal=st.booleans(),
)
def test_prefill_with_split_plans_matches_reference(lens, workers, causal):
    lens_q = [q for q, _ in lens]
    lens_k = [k for _, k in lens]  # any k_len, also shorter than q_len
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 3, dqk=24, dv=16)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=3, causal=causal, tile_q=64,
                                    kv_granularity=16, num_workers=workers)
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=causal, fp8=False, plan=plan,
                                       return_lse=True, kernel="torch")
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck, causal=causal)
    if q.shape[0]:
        assert relative_error(out, ref_out) <= BF16_TOL
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))


def test_plan_is_deterministic_and_reports_summary():
    cq, ck = cu_seqlens([512, 3]), cu_seqlens([900, 3])
    a = mla_plugins.plan_prefill(cq, ck, num_heads=16, num_workers=5)
    b = mla_plugins.plan_prefill(cq, ck, num_heads=16, num_workers=5)
    assert torch.equal(a.work_info, b.work_info)
    assert a.summary()["tiles"] == 3 and a.summary()["pieces"] == a.num_partial_tiles


def test_calls_without_a_plan_reuse_one_per_batch(monkeypatch):
    """Layer after layer of one batch plans once; another batch gets its own plan."""
    from mla_plugins.core import plan as plan_mod

    built = []
    original = plan_mod.build_core_plan
    monkeypatch.setattr(plan_mod, "build_core_plan", lambda *a, **k: built.append(1) or original(*a, **k))
    q, k, v, cq, ck = random_batch([300, 17], [310, 40], 2)
    ref_out, _ = reference_attention(q, k, v, cq, ck)
    for _ in range(3):  # fresh offset tensors each "layer", same lengths
        out = mla_plugins.mla_prefill(q, k, v, cq.clone(), ck.clone(), fp8=False, kernel="torch")
        assert relative_error(out, ref_out) <= BF16_TOL
    assert len(built) == 1
    q2, k2, v2, cq2, ck2 = random_batch([17, 300], [40, 310], 2)  # same totals, other lengths
    out = mla_plugins.mla_prefill(q2, k2, v2, cq2, ck2, fp8=False, kernel="torch")
    assert len(built) == 2
    assert relative_error(out, reference_attention(q2, k2, v2, cq2, ck2)[0]) <= BF16_TOL
