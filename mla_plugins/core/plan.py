"""The split-KV work plan, in AITER's persistent-scheduling format (`get_ps_metadata_v1`).

Built on the host, like AITER's own planner: the query of every sequence is cut into
tiles of `tile_q` rows; each tile's visible keys are counted in units of
`kv_granularity` tokens; the heads are split into `gcd(num_heads, num_workers)`
clusters, each served by `num_workers / clusters` workers with an equal quota of units
(the first `total % workers` get one more). Walking the tiles in order, a worker that
can finish a tile emits one work item; otherwise it takes its remaining quota as a
piece of the tile, and the tile is merged later by the reduce.

`work_info` rows are 8 int32, as AITER's:
    [batch_idx, partial_o_loc, qo_start, qo_end, kv_start, kv_end, kv_offset, head_range]
- `qo_start, qo_end`: absolute rows of q / out covered by the item;
- `kv_start, kv_end`: absolute rows of k / v the item attends over;
- `kv_offset`: causal diagonal in absolute rows: with causal=True, query row `r` sees
  key `j` iff `j <= r + kv_offset` (bottom-right alignment of each sequence);
- `partial_o_loc`: -1 when the item finishes its tile alone (written straight to the
  output), otherwise the first row of its piece in the partial buffers
  (`tile_q * piece_index`);
- `head_range`: `head_lo | head_hi << 16`, heads `[head_lo, head_hi)`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .device import default_num_workers
from .validation import check_cu_seqlens, check_positive_int

WORK_INFO_FIELDS = (
    "batch_idx",
    "partial_o_loc",
    "qo_start",
    "qo_end",
    "kv_start",
    "kv_end",
    "kv_offset",
    "head_range",
)


@dataclass(frozen=True)
class PrefillPlan:
    """A work plan for one batch (tensors on the device of `cu_seqlens_q`).

    work_indptr:        int32 [num_workers + 1], CSR of work items per worker
    work_info:          int32 [num_items, 8], see the module docstring
    reduce_indptr:      int32 [T + 1], CSR over `reduce_partial_map` for the T split tiles
    reduce_final_map:   int32 [T, 2], output rows (q_start, q_end) of split tile t
    reduce_partial_map: int32 [num_partial_tiles], first partial-buffer row of each piece
    num_partial_tiles:  pieces; the partial buffers hold `num_partial_tiles * tile_q` rows
    """

    work_indptr: torch.Tensor
    work_info: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final_map: torch.Tensor
    reduce_partial_map: torch.Tensor
    num_partial_tiles: int
    tile_q: int
    kv_granularity: int
    num_workers: int
    num_heads: int
    num_clusters: int
    causal: bool
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_tiles: int
    #: host copy of work_info, so host-driven kernels need no device sync
    work_info_cpu: torch.Tensor
    #: host copies of the offsets, and which tensors (at which in-place version) they came
    #: from: `mla_prefill` given this plan and the same unmodified tensors skips reading them
    cu_seqlens_host: tuple[tuple[int, ...], tuple[int, ...]]
    source: tuple[torch.Tensor, int | None, torch.Tensor, int | None]

    def built_from(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> bool:
        """True when these are the very tensors the plan read, not modified in place since."""
        sq, vq, sk, vk = self.source
        return (sq is cu_seqlens_q and sk is cu_seqlens_k and vq is not None and vk is not None
                and _version(cu_seqlens_q) == vq and _version(cu_seqlens_k) == vk)

    @property
    def num_split_tiles(self) -> int:
        return self.reduce_final_map.shape[0]

    @property
    def num_items(self) -> int:
        return self.work_info.shape[0]

    def partial_rows(self) -> int:
        return self.num_partial_tiles * self.tile_q

    def summary(self) -> dict[str, int]:
        return {
            "tiles": self.num_tiles,
            "split_tiles": self.num_split_tiles,
            "pieces": self.num_partial_tiles,
            "work_items": self.num_items,
            "workers": self.num_workers,
            "clusters": self.num_clusters,
        }


def _version(t: torch.Tensor) -> int | None:
    """The in-place version counter, or None for inference tensors (torch.inference_mode
    tensors keep none, so a plan cannot vouch for them and they are read again)."""
    try:
        return t._version
    except RuntimeError:
        return None


_CACHE_SIZE = 16
_cache: OrderedDict[tuple, PrefillPlan] = OrderedDict()
_cache_lock = threading.Lock()


def cached_plan(inputs, params: dict) -> PrefillPlan:
    """`plan_prefill` for `mla_prefill` calls without a plan, remembered by batch.

    A framework calls the prefill once per layer with the same batch: the plan is built
    on the first layer and found by its sequence lengths (already on the host) after.
    """
    host = inputs.seqlens_host
    build = lambda: plan_prefill(  # noqa: E731
        inputs.cu_seqlens_q, inputs.cu_seqlens_k, num_heads=inputs.num_heads,
        causal=inputs.causal, **params,
    )
    if host is None:
        return build()
    key = (host, inputs.num_heads, inputs.causal, tuple(sorted(params.items())), str(inputs.device))
    with _cache_lock:
        plan = _cache.get(key)
        if plan is not None:
            _cache.move_to_end(key)
            return plan
    plan = build()
    with _cache_lock:
        _cache[key] = plan
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return plan


def _tile_order(n: int) -> list[int]:
    """Ping-pong order 0, n-1, 1, n-2, ...: pairs a cheap causal tile with an expensive one."""
    order = []
    lo, hi = 0, n - 1
    while lo <= hi:
        order.append(lo)
        if hi != lo:
            order.append(hi)
        lo, hi = lo + 1, hi - 1
    return order


def plan_prefill(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    num_heads: int,
    causal: bool = True,
    tile_q: int = 256,
    kv_granularity: int = 128,
    num_workers: int | None = None,
) -> PrefillPlan:
    """Plan the split-KV prefill of a varlen batch.

    cu_seqlens_q, cu_seqlens_k: int32 [B+1], starting at 0, non-decreasing.
    `num_workers` defaults to the multiprocessor count of their device (a fixed
    number on the CPU). The result is deterministic for given arguments.
    """
    cq, ck = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    check_positive_int("num_heads", num_heads)
    check_positive_int("tile_q", tile_q)
    check_positive_int("kv_granularity", kv_granularity)
    device = cu_seqlens_q.device
    if num_workers is None:
        num_workers = default_num_workers(device)
    check_positive_int("num_workers", num_workers)
    if num_heads >= 1 << 15:
        raise ValueError(f"num_heads: found {num_heads}, expected fewer than 32768")

    batch = len(cq) - 1

    # (batch, qo_start, qo_end, k_start, eff_kv, units, kv_offset) per tile
    tiles: list[tuple[int, int, int, int, int, int, int]] = []
    max_q = max_k = 0
    for b in range(batch):
        q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        max_q, max_k = max(max_q, q_len), max(max_k, k_len)
        kv_offset = ck[b] + (k_len - q_len) - cq[b]
        for i in _tile_order(-(-q_len // tile_q)):
            q0 = i * tile_q
            q1 = min(q0 + tile_q, q_len)
            eff = min(max(k_len - q_len + q1, 0), k_len) if causal else k_len
            units = -(-eff // kv_granularity)
            tiles.append((b, cq[b] + q0, cq[b] + q1, ck[b], eff, units, kv_offset))

    clusters = math.gcd(num_heads, num_workers)
    per_cluster = num_workers // clusters
    heads_per_cluster = num_heads // clusters
    total_units = sum(t[5] for t in tiles)
    base, extra = divmod(total_units, per_cluster)
    quota = [base + (1 if w < extra else 0) for w in range(per_cluster)]

    # One cluster's walk; the others repeat it on their own heads and workers.
    per_worker: list[list[list[int]]] = [[] for _ in range(per_cluster)]
    groups: list[tuple[int, int, list[int]]] = []  # (qo_start, qo_end, piece rows)
    pieces = 0
    w, remaining = 0, quota[0]
    for b, q0, q1, k0, eff, units, kv_offset in tiles:
        done = 0
        if units == 0:
            # Rows that see no key still need out = 0 and lse = -inf.
            per_worker[w].append([b, -1, q0, q1, k0, k0, kv_offset])
            continue
        tile_pieces: list[int] = []
        while done < units:
            while remaining == 0 and w < per_cluster - 1:
                w += 1
                remaining = quota[w]
            left = units - done
            take = left if left <= remaining or w == per_cluster - 1 else remaining
            kv0 = k0 + done * kv_granularity
            kv1 = k0 + min((done + take) * kv_granularity, eff)
            finishes = done + take == units
            if finishes and done == 0:
                loc = -1
            else:
                loc = pieces * tile_q
                pieces += 1
                tile_pieces.append(loc)
            per_worker[w].append([b, loc, q0, q1, kv0, kv1, kv_offset])
            done += take
            remaining = max(remaining - take, 0)
        if tile_pieces:
            groups.append((q0, q1, tile_pieces))

    # The clusters repeat one walk on their own heads: replicate it as tensors, not lists.
    one = torch.tensor([item for items in per_worker for item in items], dtype=torch.int32).reshape(-1, 7)
    counts = torch.tensor([len(items) for items in per_worker], dtype=torch.int64)
    c = torch.arange(clusters, dtype=torch.int64)
    head_range = (c * heads_per_cluster | ((c + 1) * heads_per_cluster) << 16).to(torch.int32)
    work_info_cpu = torch.cat(
        [one.repeat(clusters, 1), head_range.repeat_interleave(one.shape[0])[:, None]], dim=1
    )
    indptr = torch.cat(
        [torch.zeros(1, dtype=torch.int64), (c[:, None] * one.shape[0] + counts.cumsum(0)).flatten()]
    ).tolist()
    reduce_indptr = [0]
    partial_map: list[int] = []
    for _, _, locs in groups:
        partial_map.extend(locs)
        reduce_indptr.append(len(partial_map))

    def dev(data, shape=None):
        t = torch.tensor(data, dtype=torch.int32)
        if shape is not None:
            t = t.reshape(shape)
        return t.to(device)

    return PrefillPlan(
        work_indptr=dev(indptr),
        work_info=work_info_cpu.to(device),
        reduce_indptr=dev(reduce_indptr),
        reduce_final_map=dev([[g[0], g[1]] for g in groups], (-1, 2)),
        reduce_partial_map=dev(partial_map),
        num_partial_tiles=pieces,
        tile_q=tile_q,
        kv_granularity=kv_granularity,
        num_workers=num_workers,
        num_heads=num_heads,
        num_clusters=clusters,
        causal=causal,
        total_q=cq[-1],
        total_k=ck[-1],
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        num_tiles=len(tiles),
        work_info_cpu=work_info_cpu,
        cu_seqlens_host=(tuple(cq), tuple(ck)),
        source=(cu_seqlens_q, _version(cu_seqlens_q), cu_seqlens_k, _version(cu_seqlens_k)),
    )
