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
sized from the host `reduce_indptr[-1]`, not from the planner's worst case.

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
    register_single_pieces,
    route_unsplit_through_reduce,
)
from ..device import device_arch, device_kind
from ..fp8 import quantize_fp8
from .base import Inputs, Kernel, PrefillInputs, ReduceInputs

logger = logging.getLogger("mla_plugins.kernels.aiter")

TILE_Q = 256  # the asm kernel's query tile (mla_pfl_qh192_vh128_m32x8_n128x1)
KV_GRANULARITY = 128
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
        host=keep + ([empty_rows] if empty_rows is not None else []),
    )
    if pieces is not None:
        out_rows, partial_rows = (host(p.tolist(), dtype=torch.long) for p in pieces)
        meta.host += [out_rows, partial_rows]
        register_single_pieces(meta.reduce_indptr, SinglePieces(dev(out_rows), dev(partial_rows), num_partial))
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
        `extra["aiter"]`: planned once here, for every layer that runs the batch."""
        plan = super().build_plan(request)
        status = probe_aiter()
        heads = padded_heads(request.num_heads, status.reduce_router()) or request.num_heads
        cq, ck = request.seqlens_host
        data = AiterPlanData(cq, ck, heads, request.causal, request.device)
        data.get(False)
        extra = dict(getattr(plan, "extra", None) or {})
        extra["aiter"] = data
        return replace(plan, extra=extra)

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

    # -- work ----------------------------------------------------------------------------
    def run(self, inputs: PrefillInputs, plan, out: torch.Tensor, lse: torch.Tensor | None,
            workspace: torch.Tensor | None = None) -> None:
        import aiter

        status = probe_aiter()
        heads = inputs.num_heads
        padded = padded_heads(heads, status.reduce_router())
        if padded is None:
            raise ValueError(f"q: found {heads} heads, which AITER's FP8 prefill cannot run "
                             "(see AiterKernel.extra_reasons)")
        meta = self._plan_data(inputs, plan, padded).get(lse is not None)
        q, k, v = inputs.q, inputs.k, inputs.v
        if padded != heads:
            pad = (0, 0, 0, padded - heads)
            q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
        q8, q_scale = quantize_fp8(q, inputs.fp8_dtype)
        k8, k_scale = quantize_fp8(k, inputs.fp8_dtype)
        v8, v_scale = quantize_fp8(v, inputs.fp8_dtype)
        device = q.device
        rows = meta.partial_rows
        split_out = torch.empty((rows, padded, 128), dtype=torch.float32, device=device)
        split_lse = torch.empty((rows, padded), dtype=torch.float32, device=device)
        direct = padded == heads
        target = out if direct else torch.empty((out.shape[0], padded, 128), dtype=out.dtype, device=device)
        final_lse = None
        if lse is not None:
            final_lse = lse if direct and lse.is_contiguous() else torch.empty(
                (out.shape[0], padded), dtype=torch.float32, device=device)
        aiter.mla_prefill_ps_asm_fwd(
            q8, k8, v8, meta.cu_q, meta.cu_k, meta.kv_indices, meta.work_indptr, meta.work_info,
            meta.max_seqlen_q, inputs.softmax_scale, inputs.causal,
            split_out, split_lse, target, q_scale, k_scale, v_scale,
        )
        if meta.num_partial_tiles > 0:
            # through the drop-in: it also copies the one-piece groups of the lse routing
            aiter_mla_reduce_v1(
                split_out, split_lse, meta.reduce_indptr, meta.reduce_final_map,
                meta.reduce_partial_map, TILE_Q, 0, target, final_lse,
            )
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
