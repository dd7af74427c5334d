"""The split-KV work plan: AITER's persistent-scheduling layout, not its exact meaning.

Built on the host, like AITER's own planner (`get_ps_metadata_v1`, v1_2_host.cuh): the
query of every sequence is cut into tiles of `tile_q` rows in ping-pong order (0, n-1,
1, ...); each tile's visible keys are counted in units of `kv_granularity` tokens; the
heads are split into `gcd(num_heads, num_workers)` clusters, each served by
`num_workers / clusters` workers with an equal quota of units (the first
`total % workers` get one more). Walking the tiles in order, a worker that can finish a
tile emits one work item; otherwise it takes its remaining quota as a piece of the tile,
and the tile is merged later by the reduce.

`work_info` rows are 8 int32 in AITER's field order:
    [batch_idx, partial_o_loc, qo_start, qo_end, kv_start, kv_end, kv_offset, head_range]
- `qo_start, qo_end`: absolute rows of q / out covered by the item;
- `kv_start, kv_end`: absolute rows of k / v the item attends over;
- `kv_offset`: causal diagonal in absolute rows: with causal=True, query row `r` sees
  key `j` iff `j <= r + kv_offset` (bottom-right alignment of each sequence);
- `partial_o_loc`: -1 when the item finishes its tile alone (written straight to the
  output), otherwise the first row of its piece in the partial buffers
  (`tile_q * piece_index`);
- `head_range`: `head_lo | head_hi << 16`, heads `[head_lo, head_hi)`.
`reduce_indptr` / `reduce_final_map` / `reduce_partial_map` are CSR groups of pieces per
split tile, as the reduce (ours and AITER's mla_reduce_v1) reads them.

Where the meaning differs from what AITER's planner writes (so neither side's metadata
may be fed to the other side's kernels; the AITER provider runs AITER's own planner):
- `kv_offset`: ours is the diagonal above, on every item. AITER's is 0 on an item that
  ends its tile and, on a piece that stops inside one, the KV tokens of the sequence left
  after the piece (`k_len - (kv_end - seq_kv_start)`).
- items per cluster vs per KV head: our item covers every head of its cluster
  (`head_range` = the cluster's heads); AITER repeats the walk once per KV head, each item
  one KV head wide (`q_head_range` = that head's `qhead_granularity` query heads), so it
  has `num_heads / clusters` times as many items.
- `kv_end`: ours stops at the tile's causal limit; AITER's is rounded up to the next
  `kv_granularity` unit and clamped to the sequence end only (keys past the diagonal are
  left to the kernel's mask).
- tiles with no visible key: we emit an empty item (kv_start == kv_end) so their rows get
  0 / -inf; AITER emits them only if a worker with quota left walks past them (none after
  the last unit: those rows are never written), and its C integer division gives a tile
  ending 128+ rows above the diagonal a negative unit count.
- quotas: our last worker of a cluster takes whatever is left; AITER's take exactly
  their quota.
- `reduce_final_map`: ours lists split tiles in walk order; AITER's is sorted by
  (qo_start, qo_end) (a std::map), each group's pieces sorted.
- buffers: ours are exact-size tensors; AITER fills fixed-size buffers from
  `get_ps_metadata_info_v1`, zeroes their tails and pads `reduce_indptr` with the final
  count.
- lse: our kernels write lse for every row; AITER's reduce writes none for unsplit tiles
  (unless need_lse, ROCm/aiter#3606) and +inf for split rows that see no key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .validation import (
    check_cu_seqlens,
    check_device,
    check_partial_rows,
    check_plan_param,
    check_plan_tiles,
    check_tensor,
)

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


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """A work plan for one batch: the batch's authority on its sequence lengths.

    The plan holds its own host copy of the offsets (`cu_seqlens_host`) and its own int32
    device copies (`cu_seqlens_q`, `cu_seqlens_k`), so a call given a plan reads nothing
    back from the device and depends on no tensor the caller may change afterwards.

    work_indptr:        int32 [num_workers + 1], CSR of work items per worker
    work_info:          int32 [num_items, 8], see the module docstring
    reduce_indptr:      int32 [T + 1], CSR over `reduce_partial_map` for the T split tiles
    reduce_final_map:   int32 [T, 2], output rows (q_start, q_end) of split tile t
    reduce_partial_map: int32 [num_partial_tiles], first partial-buffer row of each piece
    num_partial_tiles:  pieces; the partial buffers hold `num_partial_tiles * tile_q` rows
    kernel:             name of the kernel the plan was built for (and that runs it)
    workspace_bytes:    scratch bytes that kernel needs to run the plan
    extra:              a kernel's own metadata (AITER's scheduler output, ...)
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
    #: host copies of (cu_seqlens_q, cu_seqlens_k)
    cu_seqlens_host: tuple[tuple[int, ...], tuple[int, ...]]
    #: the plan's own int32 device copies of the offsets
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    device: torch.device
    kernel: str = "torch"
    #: None: planned without naming the compute mode (calls may use either)
    fp8: bool | None = None
    dtype: torch.dtype = torch.bfloat16
    head_dim_qk: int = 192
    head_dim_v: int = 128
    workspace_bytes: int = 0
    #: planned for fp8 with kernel="auto", but bf16 measured faster for this batch: calls that
    #: say fp8=True run in bf16 (core/dispatch.py); False everywhere else
    auto_bf16: bool = False
    extra: dict = field(default_factory=dict)
    #: what the running kernel derives from the plan once (workspace views, launch
    #: arguments); a memo, not part of what the plan says
    memo: dict = field(default_factory=dict, repr=False)

    @property
    def seqlens_host(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.cu_seqlens_host

    @property
    def batch_size(self) -> int:
        return len(self.cu_seqlens_host[0]) - 1

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


def normalize_device(device) -> torch.device:
    device = check_device("device", device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device: found {str(device)!r}, but no CUDA or ROCm device is visible to this torch "
            f"({torch.__version__}); plan for device='cpu' or on a machine with a GPU"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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


def host_offsets(cu_seqlens_q, cu_seqlens_k, *, cpu_int64: bool = True) -> tuple[list[int], list[int]]:
    """Checked host copies of both offsets, with at most one device read.

    Device tensors (int32) are read together; CPU tensors (int32 or int64) and lists or
    tuples of ints are read on the host.
    """
    tensors = [t for t in (cu_seqlens_q, cu_seqlens_k) if isinstance(t, torch.Tensor)]
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if isinstance(t, torch.Tensor):
            wide = cpu_int64 and t.device.type == "cpu"
            check_tensor(name, t, ndim=1, dtypes=(torch.int32, torch.int64) if wide else (torch.int32,))
    if len(tensors) == 2 and all(t.device.type not in ("cpu", "meta") for t in tensors) \
            and cu_seqlens_q.device == cu_seqlens_k.device:
        both = torch.cat((cu_seqlens_q, cu_seqlens_k)).tolist()  # one sync, not two
        n = cu_seqlens_q.numel()
        return check_cu_seqlens(both[:n], both[n:])
    hosts = [t.tolist() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t
             for t in (cu_seqlens_q, cu_seqlens_k)]
    return check_cu_seqlens(*hosts)


def build_core_plan(request, *, kernel: str, tile_q: int = 256, kv_granularity: int = 128,
                    num_workers: int | None = None) -> PrefillPlan:
    """The core's planner (AITER's persistent-scheduling format) for a `PlanRequest`."""
    from .device import default_num_workers

    check_plan_param("tile_q", tile_q)
    check_plan_param("kv_granularity", kv_granularity)
    device = request.device
    if num_workers is None:
        num_workers = default_num_workers(device)
    check_plan_param("num_workers", num_workers)
    num_heads, causal = request.num_heads, request.causal
    cq, ck = request.seqlens_host
    batch = len(cq) - 1
    check_plan_tiles(cq, tile_q)  # before the walk below, which is linear in the tiles

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
    check_partial_rows(pieces, tile_q)  # partial rows are int32 offsets

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
    ).to(torch.int32)
    reduce_indptr = [0]
    partial_map: list[int] = []
    for _, _, locs in groups:
        partial_map.extend(locs)
        reduce_indptr.append(len(partial_map))

    # Every int32 array of the plan travels in one host-to-device copy; each starts
    # 16-byte aligned (kernels specialize on pointer alignment).
    parts = [
        work_info_cpu.flatten(),
        indptr,
        torch.tensor(reduce_indptr, dtype=torch.int32),
        torch.tensor([x for g in groups for x in g[:2]], dtype=torch.int32),
        torch.tensor(partial_map, dtype=torch.int32),
        torch.tensor(cq, dtype=torch.int32),
        torch.tensor(ck, dtype=torch.int32),
    ]
    offsets, n = [], 0
    for p in parts:
        offsets.append(n)
        n += -(-p.numel() // 4) * 4
    host = torch.zeros(max(n, 4), dtype=torch.int32)
    for off, p in zip(offsets, parts, strict=True):
        host[off : off + p.numel()] = p
    packed = host.to(device) if device.type != "cpu" else host
    views = [packed[off : off + p.numel()] for off, p in zip(offsets, parts, strict=True)]

    return PrefillPlan(
        work_indptr=views[1],
        work_info=views[0].view(-1, 8),
        reduce_indptr=views[2],
        reduce_final_map=views[3].view(-1, 2),
        reduce_partial_map=views[4],
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
        cu_seqlens_q=views[5],
        cu_seqlens_k=views[6],
        device=device,
        kernel=kernel,
        fp8=request.fp8 if request.fp8_given else None,
        dtype=request.dtype,
        head_dim_qk=request.head_dim_qk,
        head_dim_v=request.head_dim_v,
    )


def offsets_plan(request, *, kernel: str, extra: dict) -> PrefillPlan:
    """The plan of a kernel that schedules its own work (FlashAttention-3): no work items,
    no split tiles; the batch's host offsets, their int32 device copies (one copy) and its
    lengths. `extra` marks the plan as that kernel's (no other kernel may run it: an empty
    work list would leave their output unwritten)."""
    cq, ck = request.seqlens_host
    device = request.device
    host = torch.tensor(list(cq) + list(ck), dtype=torch.int32)
    packed = host.to(device) if device.type != "cpu" else host
    n = len(cq)
    lens_q = [b - a for a, b in zip(cq, cq[1:], strict=False)]
    lens_k = [b - a for a, b in zip(ck, ck[1:], strict=False)]
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    return PrefillPlan(
        work_indptr=torch.zeros(1, dtype=torch.int32, device=device),
        work_info=empty.view(0, 8),
        reduce_indptr=torch.zeros(1, dtype=torch.int32, device=device),
        reduce_final_map=empty.view(0, 2),
        reduce_partial_map=empty,
        num_partial_tiles=0,
        tile_q=256,
        kv_granularity=128,
        num_workers=1,
        num_heads=request.num_heads,
        num_clusters=1,
        causal=request.causal,
        total_q=cq[-1],
        total_k=ck[-1],
        max_seqlen_q=max(lens_q, default=0),
        max_seqlen_k=max(lens_k, default=0),
        num_tiles=0,
        work_info_cpu=torch.zeros(0, 8, dtype=torch.int32),
        cu_seqlens_host=(tuple(cq), tuple(ck)),
        cu_seqlens_q=packed[:n],
        cu_seqlens_k=packed[n:],
        device=device,
        kernel=kernel,
        fp8=request.fp8 if request.fp8_given else None,
        dtype=request.dtype,
        head_dim_qk=request.head_dim_qk,
        head_dim_v=request.head_dim_v,
        extra=extra,
    )


def rows_without_keys(cu_seqlens_host, causal: bool) -> bool:
    """Whether some query row of the batch sees no key: a sequence with queries and no
    keys, or (causal, bottom-right) fewer keys than queries."""
    cq, ck = cu_seqlens_host
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:], strict=False):
        q_len, k_len = q1 - q0, k1 - k0
        if q_len and (k_len == 0 or (causal and k_len < q_len)):
            return True
    return False


__all__ = ["WORK_INFO_FIELDS", "PrefillPlan", "build_core_plan", "host_offsets", "normalize_device",
           "offsets_plan", "rows_without_keys"]
