"""The AITER kernel: AMD's asm FP8 prefill (`mla_prefill_ps_asm_fwd`, gfx950 only) and its
reduce, called in whichever convention the installed AITER has.

Written to AITER's source (reference/aiter.md, field-findings section 1); no AMD GPU exists
where this project is tested, so it runs here against tests/fakes (AITER's planner and
reduce as written, the asm kernel's contract) and on ROCm for real.

AITER schedules its own work: `get_ps_metadata_v1` (host-side) is called once per batch,
by `build_plan` (the plan's `extra["aiter"]`) or, for a call without such a plan, through a
cache keyed by the batch's host offsets, so the layers of one forward share it. Its
metadata is built in pinned host memory and copied to the device non-blocking on the
current stream (the pinned tensors live as long as the metadata). Partial buffers are
sized from the host `reduce_indptr[-1]`, not from the planner's worst case; they, the fp8
copies and every other buffer of a run are views of the workspace (`scratch_layout`),
made once per plan and lse mode, so a call allocates nothing of its own.

What this provider adds to AITER's result, so the core's contract holds:
- rows that see no key (causal rows above a sequence's diagonal when q_len > k_len, every
  row when k_len = 0) get out 0 and lse -inf: AITER's reduce writes +inf lse (and, on its
  2-3 piece path, NaN output) for split rows that see no key, and its planner gives tiles
  with no visible key after the last KV unit to no workgroup, leaving their rows unwritten;
- lse for every row: with need_lse (ROCm/aiter#3606) AITER's planner routes unsplit tiles
  through the reduce; without it, the same routing is done on the host
  (`route_unsplit_through_reduce`) and the one-piece groups are copied after the reduce.
Heads are zero-padded to a count both AITER kernels are known to take (`padded_heads`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from ..aiter import (
    REDUCE_ROUTER_V0116,
    SinglePieces,
    aiter_mla_reduce_v1,
    probe_aiter,
    route_unsplit_through_reduce,
)
from ..device import device_arch, device_kind, fp8_dtype_for
from ..fp8 import fp8_max
from ..workspace import ALIGN, carve_views, workspace_size
from .base import Inputs, Kernel, PrefillInputs, ReduceInputs

logger = logging.getLogger("mla_plugins.kernels.aiter")

TILE_Q = 256  # the asm kernel's query tile (mla_pfl_qh192_vh128_m32x8_n128x1)
KV_GRANULARITY = 128
DQK, DV = 192, 128  # the only head dims of the asm kernel
#: value head dim -> head counts of mla_reduce_v1's router at v0.1.16 (the smaller set)
REDUCE_ROUTER = REDUCE_ROUTER_V0116
#: head counts AITER runs its FP8 PS prefill with in its own op test (1 and 16), besides
#: multiples of 16, which vLLM pads to ("PS asm prefill + mla_reduce_v1 require 16-aligned
#: heads"); SGLang saw 10 heads read out of bounds in the m32x8 kernel
KERNEL_KNOWN_SMALL = (1,)


def padded_heads(num_heads: int, router: dict[int, tuple[int, ...]] | None = None) -> int | None:
    """The head count to run: the smallest >= num_heads that is 1 or a multiple of 16 (what
    the asm kernel is known to take) and in the reduce router of the installed AITER
    (`router`, by release: 48 and 96 from v0.1.20); None when there is none."""
    heads = (router or REDUCE_ROUTER).get(128, ())
    for count in sorted(heads):
        if count >= num_heads and (count in KERNEL_KNOWN_SMALL or count % 16 == 0):
            return count
    return None


def no_key_rows(cq: tuple[int, ...], ck: tuple[int, ...], causal: bool) -> list[tuple[int, int]]:
    """Row ranges [a, b) that see no key: bottom-right causal rows i < q_len - k_len, or
    every row of a sequence without keys."""
    ranges = []
    for b in range(len(cq) - 1):
        q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        blind = q_len if k_len == 0 else (max(q_len - k_len, 0) if causal else 0)
        if blind:
            ranges.append((cq[b], cq[b] + blind))
    return ranges


def _rows(ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)


def scratch_layout(*, total_q: int, total_k: int, heads: int, padded: int, dtype: torch.dtype,
                   fp8_dtype: torch.dtype, partial_tiles: int, with_lse: bool,
                   single_rows: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every buffer a run takes from the workspace, as (name, shape, dtype) regions.

    The fp8 copies carry the padded heads; `staging` is the float32 image of one input at
    a time (the quantization divides in float32, as `fp8.quantize_fp8` does), later reused
    for the one-piece groups of the lse routing. A layout with more of every region is
    never smaller, which `AiterKernel.workspace_layout` relies on for its bound.
    """
    f32 = torch.float32
    staging = max(max(total_q, total_k) * heads * DQK, single_rows * padded * DV, 1)
    layout = [
        ("partial_out", (max(partial_tiles, 1) * TILE_Q, padded, DV), f32),
        ("partial_lse", (max(partial_tiles, 1) * TILE_Q, padded), f32),
        ("q8", (total_q, padded, DQK), fp8_dtype),
        ("k8", (total_k, padded, DQK), fp8_dtype),
        ("v8", (total_k, padded, DV), fp8_dtype),
        ("staging", (staging,), f32),
        ("amax", (3,), dtype),
        ("scales", (3,), f32),
        ("zero", (3,), torch.bool),
    ]
    if padded != heads:
        layout.append(("target", (total_q, padded, DV), dtype))
    if with_lse:
        layout.append(("final_lse", (total_q, padded), f32))
    if single_rows:
        layout.append(("single", (single_rows, padded, DV), dtype))
    return layout


def _quantize_into(x: torch.Tensor, dst: torch.Tensor, staging: torch.Tensor,
                   scale: torch.Tensor, limit: float, heads: int) -> None:
    """`fp8.quantize_fp8`'s values (x.float() / scale, clamped, cast) written into `dst`
    [T, padded, D] through `staging`, allocating nothing; padded heads get 0."""
    if x.shape[0]:
        buf = staging[: x.numel()].view(x.shape)
        buf.copy_(x)
        buf.div_(scale)
        buf.clamp_(-limit, limit)
        dst[:, :heads].copy_(buf)
    if dst.shape[1] != heads:
        # the shared workspace holds other runs' bytes there
        dst[:, heads:].zero_()


@dataclass
class AiterMetadata:
    """One batch's AITER metadata on the device, with the host values the run needs."""

    heads: int
    causal: bool
    with_lse: bool
    native_need_lse: bool
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    kv_indices: torch.Tensor
    work_indptr: torch.Tensor
    work_info: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final_map: torch.Tensor
    reduce_partial_map: torch.Tensor
    num_partial_tiles: int
    max_seqlen_q: int
    empty_rows: torch.Tensor | None
    #: query tiles of the batch (the lse routing adds at most one piece per tile)
    num_tiles: int = 0
    #: one-piece groups of the host lse routing, copied by the provider after the reduce
    single: SinglePieces | None = None
    #: host buffers the non-blocking copies read from: kept alive with the metadata
    host: list = field(default_factory=list)

    @property
    def partial_rows(self) -> int:
        return max(self.num_partial_tiles, 1) * TILE_Q


def build_metadata(cq, ck, *, heads: int, causal: bool, with_lse: bool, device) -> AiterMetadata:
    """Run AITER's planner for one batch (host offsets `cq`, `ck`) and copy its metadata to
    `device`: from pinned memory, non-blocking, on the current stream."""
    import aiter

    device = torch.device(device)
    status = probe_aiter()
    pin = device.type == "cuda" and torch.cuda.is_available()
    batch = len(cq) - 1
    lens_q = [b - a for a, b in zip(cq, cq[1:], strict=False)]
    max_q = max(lens_q, default=0)

    def host(values=None, shape=None, dtype=torch.int32):
        t = torch.empty(shape if shape is not None else len(values), dtype=dtype, pin_memory=pin)
        if values is not None:
            t.copy_(torch.tensor(values, dtype=dtype))
        return t

    cu_q, cu_k = host(list(cq)), host(list(ck))
    lens_k = host([b - a for a, b in zip(ck, ck[1:], strict=False)])
    info = aiter.get_ps_metadata_info_v1(batch, heads, max(max_q, 1), TILE_Q)
    bufs = [host(shape=shape, dtype=dtype) for shape, dtype in info]
    native = with_lse and status.metadata_need_lse
    extra = {"need_lse": True} if native else {}
    aiter.get_ps_metadata_v1(
        cu_q, cu_k, lens_k, 1, heads, *bufs,
        qhead_granularity=1, qlen_granularity=TILE_Q, kvlen_granularity=KV_GRANULARITY,
        block_size=1, is_causal=causal, **extra,
    )
    _, work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map = bufs
    pieces = None
    if with_lse and not native:
        info_h, indptr, final, partial, out_rows, partial_rows = route_unsplit_through_reduce(
            work_indptr, work_info, TILE_Q)
        work_info.view(-1, 8)[: info_h.shape[0]].copy_(info_h)
        reduce_indptr, reduce_final_map, reduce_partial_map = (
            host(indptr.tolist()), host(shape=tuple(final.shape)), host(partial.tolist()))
        reduce_final_map.copy_(final)
        pieces = (out_rows, partial_rows)
    num_partial = int(reduce_indptr[-1])
    empty = no_key_rows(cq, ck, causal)
    empty_rows = host(_rows(empty).tolist(), dtype=torch.long) if empty else None
    keep = [cu_q, cu_k, work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map]

    def dev(t):
        return t.to(device, non_blocking=pin) if t is not None else None

    meta = AiterMetadata(
        heads=heads, causal=causal, with_lse=with_lse, native_need_lse=native,
        cu_q=dev(cu_q), cu_k=dev(cu_k),
        kv_indices=torch.arange(ck[-1], dtype=torch.int32, device=device),
        work_indptr=dev(work_indptr), work_info=dev(work_info), reduce_indptr=dev(reduce_indptr),
        reduce_final_map=dev(reduce_final_map), reduce_partial_map=dev(reduce_partial_map),
        num_partial_tiles=num_partial, max_seqlen_q=max_q, empty_rows=dev(empty_rows),
        num_tiles=sum(-(-n // TILE_Q) for n in lens_q),
        host=keep + ([empty_rows] if empty_rows is not None else []),
    )
    if pieces is not None and pieces[0].numel():
        # kept on the metadata, not registered for the reduce drop-in: the provider copies
        # them itself, through the workspace
        out_rows, partial_rows = (host(p.tolist(), dtype=torch.long) for p in pieces)
        meta.host += [out_rows, partial_rows]
        meta.single = SinglePieces(dev(out_rows), dev(partial_rows), num_partial)
    return meta


class AiterPlanData:
    """What a plan (or the per-batch cache) holds for AITER: the metadata with and without
    lse routing, each built on first use and then reused by every layer."""

    def __init__(self, cq, ck, heads: int, causal: bool, device):
        self.key = (tuple(cq), tuple(ck), heads, causal, str(torch.device(device)))
        self._lock = threading.Lock()
        self._meta: dict[bool, AiterMetadata] = {}

    def get(self, with_lse: bool) -> AiterMetadata:
        with self._lock:
            meta = self._meta.get(with_lse)
            if meta is None:
                cq, ck, heads, causal, device = self.key
                meta = self._meta[with_lse] = build_metadata(
                    cq, ck, heads=heads, causal=causal, with_lse=with_lse, device=device)
            return meta


_CACHE_SIZE = 16
_cache: OrderedDict[tuple, AiterPlanData] = OrderedDict()
_cache_lock = threading.Lock()


def plan_data(cq, ck, heads: int, causal: bool, device) -> AiterPlanData:
    """The batch's AITER plan data, from a small LRU cache keyed by its host offsets."""
    key = (tuple(cq), tuple(ck), heads, causal, str(torch.device(device)))
    with _cache_lock:
        data = _cache.get(key)
        if data is not None:
            _cache.move_to_end(key)
            return data
        data = _cache[key] = AiterPlanData(cq, ck, heads, causal, device)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
        return data


class AiterKernel(Kernel):
    name = "aiter"
    description = "AMD AITER asm FP8 prefill + mla_reduce_v1 (ROCm gfx950)"
    priority = 0
    devices = frozenset({"rocm"})
    dtypes = frozenset({torch.bfloat16})  # the asm kernel writes bf16 only
    supports_fp8 = True
    supports_bf16_compute = False
    head_dims_qk = frozenset({192})
    head_dims_v = frozenset({128})
    archs = frozenset({"gfx950"})

    def environment_reasons(self) -> list[str]:
        status = probe_aiter()
        if not status.usable:
            return [status.reason]
        if not status.prefill_op:
            return ["this AITER has no mla_prefill_ps_asm_fwd (FP8 persistent prefill)"]
        return []

    def device_reasons(self, device: torch.device) -> list[str]:
        arch = device_arch(device)
        if arch not in self.archs:
            return [f"arch {arch} not supported (AITER's FP8 prefill exists for {sorted(self.archs)} only)"]
        return []

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        if inputs.op != "reduce":
            return super().not_supported_reasons(inputs)
        # The reduce alone has its own router: exact (H, Dv) pairs, bf16 or fp16 output.
        status = probe_aiter()
        reasons = [] if status.usable else [status.reason]
        kind = device_kind(inputs.device)
        if kind not in self.devices:
            reasons.append(f"device {kind} not supported (supports {sorted(self.devices)})")
        if inputs.dtype not in (torch.bfloat16, torch.float16):
            reasons.append(f"dtype {inputs.dtype} not supported (supports bfloat16, float16)")
        router = status.reduce_router() if status.usable else REDUCE_ROUTER
        pairs = router.get(inputs.head_dim_v, ())
        if inputs.num_heads not in pairs:
            reasons.append(
                f"{inputs.num_heads} heads with value head dim {inputs.head_dim_v} not supported "
                f"by mla_reduce_v1 (supports {dict((d, list(h)) for d, h in router.items())})"
            )
        return reasons

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        status = probe_aiter()
        router = status.reduce_router() if status.usable else REDUCE_ROUTER
        if padded_heads(inputs.num_heads, router) is None:
            return [
                f"{inputs.num_heads} heads not supported (AITER's FP8 prefill runs 1 or a "
                f"multiple of 16 heads that mla_reduce_v1 takes: {list(router.get(128, ()))}; "
                "fewer heads are padded up)"
            ]
        host = getattr(inputs, "seqlens_host", None)
        if host is not None and getattr(inputs, "causal", False):
            reason = self._negative_units_reason(*host)
            if reason:
                return [reason]
        return []

    @staticmethod
    def _negative_units_reason(cq, ck) -> str | None:
        # v1_2_host.cuh counts a tile's KV units with C's truncating (x + 127) / 128: a tile
        # ending 128+ rows above the diagonal counts -1 units, which shifts the CU quotas
        # and can leave the KV of later tiles unassigned (wrong output, not an error).
        for b in range(len(cq) - 1):
            q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if q_len > TILE_Q and k_len - q_len + TILE_Q <= -KV_GRANULARITY:
                return (f"sequence {b}: {q_len} query rows over {k_len} keys, causal: AITER's "
                        f"planner miscounts tiles {KV_GRANULARITY}+ rows above the diagonal "
                        "(q_len - k_len >= 384)")
        return None

    # -- planning ------------------------------------------------------------------------
    def build_plan(self, request):
        """The core plan (for the fields every plan has) with AITER's metadata in
        `extra["aiter"]`: planned once here, for every layer that runs the batch. Its
        `workspace_bytes` covers a run with and without lse (`workspace_layout`)."""
        plan = super().build_plan(request)
        status = probe_aiter()
        heads = padded_heads(request.num_heads, status.reduce_router()) or request.num_heads
        cq, ck = request.seqlens_host
        data = AiterPlanData(cq, ck, heads, request.causal, request.device)
        data.get(False)
        extra = dict(getattr(plan, "extra", None) or {})
        extra["aiter"] = data
        plan = replace(plan, extra=extra)
        nbytes = workspace_size(self.workspace_layout(
            plan, fp8=True, num_heads=request.num_heads, head_dim_v=request.head_dim_v,
            fp8_dtype=fp8_dtype_for(plan.device)))
        return replace(plan, workspace_bytes=nbytes + ALIGN)

    def workspace_layout(self, plan, *, fp8: bool, num_heads: int, head_dim_v: int,
                         fp8_dtype: torch.dtype) -> list:
        """For a plan with AITER's metadata: a layout at least as large as a run needs with
        or without lse, so a workspace of `plan.workspace_bytes` serves both. Only the
        metadata without lse is planned here; with lse a tile that one workgroup finishes
        gets a piece of its own (the host routing; AITER's need_lse planner as modelled in
        tests/fakes), so at most one more piece per tile. Should a run need more, a shared
        workspace grows and a caller's buffer is refused by `carve`, naming the sizes."""
        data = (getattr(plan, "extra", None) or {}).get("aiter")
        if not isinstance(data, AiterPlanData):
            return super().workspace_layout(plan, fp8=fp8, num_heads=num_heads,
                                            head_dim_v=head_dim_v, fp8_dtype=fp8_dtype)
        meta = data.get(False)
        return scratch_layout(
            total_q=plan.total_q, total_k=plan.total_k, heads=num_heads, padded=data.key[2],
            dtype=plan.dtype, fp8_dtype=fp8_dtype, with_lse=True, single_rows=plan.total_q,
            partial_tiles=meta.num_partial_tiles + meta.num_tiles)

    def _plan_data(self, inputs: PrefillInputs, plan, heads: int) -> AiterPlanData:
        data = (getattr(plan, "extra", None) or {}).get("aiter") if plan is not None else None
        if isinstance(data, AiterPlanData) and data.key[2] == heads:
            return data
        host = inputs.seqlens_host
        if host is None:  # one device read, as for any call without a plan
            host = (tuple(inputs.cu_seqlens_q.tolist()), tuple(inputs.cu_seqlens_k.tolist()))
        reason = self._negative_units_reason(*host) if inputs.causal else None
        if reason:
            raise ValueError(f"cu_seqlens_q: {reason}; run this batch with kernel='triton' or 'torch'")
        return plan_data(host[0], host[1], heads, inputs.causal, inputs.device)

    def _scratch(self, inputs: PrefillInputs, plan, meta: AiterMetadata, padded: int,
                 workspace: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Views of the workspace for `meta`'s run, made once per (plan, lse mode, buffer)."""
        key = ("aiter_scratch", meta.with_lse)
        # a framework may hand a new view of the same memory on every call: compare the memory
        where = None if workspace is None else (
            workspace.data_ptr() if isinstance(workspace, torch.Tensor) else id(workspace),
            workspace.numel() if isinstance(workspace, torch.Tensor) else 0)
        memo = plan.memo.get(key)
        if (memo is not None and memo[0] is meta and memo[1] == where and memo[2] == inputs.dtype
                and memo[3] == inputs.fp8_dtype):
            shared = memo[4]
            if shared is None or shared.generation == memo[5]:
                return memo[6]
        layout = scratch_layout(
            total_q=inputs.q.shape[0], total_k=inputs.k.shape[0], heads=inputs.num_heads,
            padded=padded, dtype=inputs.dtype, fp8_dtype=inputs.fp8_dtype,
            partial_tiles=meta.num_partial_tiles, with_lse=meta.with_lse,
            single_rows=0 if meta.single is None else meta.single.out_rows.numel())
        shared, generation, views = carve_views(layout, workspace, inputs.device)
        plan.memo[key] = (meta, where, inputs.dtype, inputs.fp8_dtype, shared, generation, views)
        return views

    # -- work ----------------------------------------------------------------------------
    def run(self, inputs: PrefillInputs, plan, out: torch.Tensor, lse: torch.Tensor | None,
            workspace: torch.Tensor | None = None) -> None:
        """Quantize into the workspace, AITER's prefill and reduce, the provider's fixes.
        Every buffer is a view of the workspace (or `out` / `lse`): a call allocates
        nothing of its own (the torch ops' internal scratch, e.g. a reduction's, aside)."""
        import aiter

        status = probe_aiter()
        heads = inputs.num_heads
        padded = padded_heads(heads, status.reduce_router())
        if padded is None:
            raise ValueError(f"q: found {heads} heads, which AITER's FP8 prefill cannot run "
                             "(see AiterKernel.extra_reasons)")
        meta = self._plan_data(inputs, plan, padded).get(lse is not None)
        ws = self._scratch(inputs, plan, meta, padded, workspace)
        q, k, v = inputs.q, inputs.k, inputs.v
        limit = fp8_max(inputs.fp8_dtype)
        # fp8.fp8_scale's per-tensor scales: the inf-norm is the NaN-aware amax, exact in
        # the input dtype; 1 where a tensor is all zeros (or empty)
        amax, scales, zero = ws["amax"], ws["scales"], ws["zero"]
        for i, x in enumerate((q, k, v)):
            if x.numel():
                torch.linalg.vector_norm(x, float("inf"), out=amax[i])
            else:
                amax[i].zero_()
        scales.copy_(amax)
        scales.div_(limit)
        torch.eq(scales, 0, out=zero)
        scales.masked_fill_(zero, 1.0)
        q8, k8, v8, staging = ws["q8"], ws["k8"], ws["v8"], ws["staging"]
        for i, (x, dst) in enumerate(((q, q8), (k, k8), (v, v8))):
            _quantize_into(x, dst, staging, scales[i], limit, heads)
        split_out, split_lse = ws["partial_out"], ws["partial_lse"]
        direct = padded == heads
        target = out if direct else ws["target"]
        final_lse = None
        if lse is not None:
            final_lse = lse if direct and lse.is_contiguous() else ws["final_lse"]
        aiter.mla_prefill_ps_asm_fwd(
            q8, k8, v8, meta.cu_q, meta.cu_k, meta.kv_indices, meta.work_indptr, meta.work_info,
            meta.max_seqlen_q, inputs.softmax_scale, inputs.causal,
            split_out, split_lse, target, scales[0], scales[1], scales[2],
        )
        if meta.num_partial_tiles > 0:
            aiter_mla_reduce_v1(
                split_out, split_lse, meta.reduce_indptr, meta.reduce_final_map,
                meta.reduce_partial_map, TILE_Q, 0, target, final_lse,
            )
            if meta.single is not None:
                _copy_single_pieces(meta.single, split_out, split_lse, target, final_lse, ws)
        if not direct:
            out.copy_(target[:, :heads])
        if lse is not None and final_lse is not lse:
            lse.copy_(final_lse[:, :heads])
        if meta.empty_rows is not None:
            out.index_fill_(0, meta.empty_rows, 0.0)
            if lse is not None:
                lse.index_fill_(0, meta.empty_rows, float("-inf"))

    def reduce(self, inputs: ReduceInputs) -> None:
        aiter_mla_reduce_v1(
            inputs.partial_out, inputs.partial_lse, inputs.reduce_indptr, inputs.reduce_final_map,
            inputs.reduce_partial_map, inputs.tile_q, inputs.num_kv_splits, inputs.out, inputs.final_lse,
        )


def _copy_single_pieces(single: SinglePieces, partial_out: torch.Tensor, partial_lse: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor | None, ws: dict) -> None:
    """What `aiter._complete_single_pieces` does for the reduce drop-in (one-piece groups of
    the host lse routing: output row <- partial row), through the workspace."""
    n, heads, dv = single.out_rows.numel(), out.shape[1], out.shape[2]
    picked = ws["staging"][: n * heads * dv].view(n, heads, dv)
    torch.index_select(partial_out.view(-1, heads, dv), 0, single.partial_rows, out=picked)
    cast = ws["single"]
    cast.copy_(picked)
    out.index_copy_(0, single.out_rows, cast)
    if lse is not None:
        picked_lse = ws["staging"][: n * heads].view(n, heads)
        torch.index_select(partial_lse.view(-1, heads), 0, single.partial_rows, out=picked_lse)
        lse.index_copy_(0, single.out_rows, picked_lse)
