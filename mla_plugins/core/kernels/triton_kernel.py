"""The Triton kernel provider: FP8 (or bf16/fp16) split-KV MLA prefill and the LSE reduce.

Written for CUDA (measured on an H200, sm_90) and ROCm (gfx942 with e4m3fnuz, gfx950;
written for, not run here). Three pieces, each in its own module:
- `triton_quant`: the block-scaled FP8 quantization of q, k and v (core/fp8.py's rule, with
  its rotation of q and k), one launch;
- `triton_attention`: phase 1 over the plan's work items;
- `triton_reduce`: phase 2, the merge of split tiles.

Nothing here imports triton at import time: `environment_reasons` looks for the package
and the kernel modules are imported on first use. Under `TRITON_INTERPRET=1` the
kernels also run on the CPU (slowly; for tests of the kernels' logic).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..device import default_num_workers, device_arch, device_kind
from . import triton_launch as tl_launch  # torch and the standard library only
from .base import Kernel, KernelInfo, PrefillInputs, ReduceInputs

if TYPE_CHECKING:
    from ..plan import PrefillPlan

logger = logging.getLogger("mla_plugins.core.kernels.triton_kernel")

#: ROCm archs the kernels are written for (e4m3fnuz on gfx942, e4m3fn on gfx950); not run here
ROCM_ARCHS = ("gfx942", "gfx950")


#: why kernel="auto" never takes the Triton kernel on a CPU, and what bf16 does there
CPU_ONLY_PINNED = (
    "on the CPU only the Triton interpreter (TRITON_INTERPRET=1) runs it, slowly: chosen only "
    "when pinned (kernel='triton' or MLA_PLUGINS_KERNEL=triton), never by kernel='auto'"
)
INTERPRETER_BF16 = (
    "bfloat16 is refused under the Triton interpreter (numpy has no bfloat16: results would "
    "be wrong); use float16 there, or another kernel"
)

#: tests set this (torch.float16) to run the fp8 path under Triton's interpreter, which has
#: no fp8 types: the same block scales and clamps, values stored in fp16
_FP8_STORAGE: torch.dtype | None = None


_HIP = bool(torch.version.hip)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of phase 1, chosen by measurement on the H200 (benchmarks/NOTES.md).

    block_m: query rows a program computes (the plan's tile_q is a multiple of it);
    block_n: keys per step of the online softmax; use_tma: k/v through tensor
    descriptors (sm_90+); warp_spec: Triton's automatic warp specialization of the key loop;
    gluon: phase 1 in Gluon (`gluon_attention`, Hopper only: wgmma, TMA, warp-specialized),
    which fixes block_m 128, and block_n 128 in fp8 (one k/v scale block a step), 64 or 128 in
    16-bit; num_stages is its ring depth,
    pingpong its two consumer warpgroups taking turns on the tensor cores, persistent one
    CTA per SM looping over the work (heads in L2-sized groups, longest first; else one CTA
    per unit), longest_first the one-CTA-per-unit grid taking each head's slices last to
    first (measured -3..+1%: off), q_tma the q blocks loaded by the producer's TMA (once the
    previous unit's last q k^T is done: the next unit's q overlaps this one's tail) instead of
    by the consumers' pointer loads; rescale_late the Gluon consumer's accumulator rescaled
    after the next block's q k^T is issued (FA3's order) rather than before it; sum_mma (Gluon
    fp8 only) the softmax's row sums by the tensor cores (P @ ones beside each P @ V) rather
    than 64 FADD a thread a key block; split_kv (Gluon) k and v of a ring stage on barriers of
    their own, k released once its q k^T is done (FA3's two pipelines) rather than the stage
    after its P @ V; lean_sync (Gluon) the kernel's PTX without the 128-thread barriers
    Triton puts before each mbarrier arrive and wait (`gluon_sync`), as CUTLASS's pipelines
    release a stage from one thread.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True
    warp_spec: bool = False
    gluon: bool = False
    pingpong: bool = False
    persistent: bool = False
    longest_first: bool = False
    q_tma: bool = False
    rescale_late: bool = False
    sum_mma: bool = False
    split_kv: bool = False
    lean_sync: bool = False


#: CUDA defaults per compute mode (fp8 / 16-bit), see benchmarks/NOTES.md for the measurements;
#: other archs: `default_config` (triton_attention.ARCH_CONFIGS)
FP8_CONFIG = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=4)
BF16_CONFIG = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
#: Hopper fp8 (sm_90): the Gluon kernel, q by the producer's TMA (H200, stop 28, attention
#: alone in GPU time: +1-3% at B1-S8192-H128, B4-S4096-H16, B8-S2048-H128, B16-S512-H16), the
#: accumulator rescaled after the next q k^T is issued (stop 29, two runs: +0.5-3.7% at those
#: four large shapes, -1% at B16-S512-H16), the row sums by the tensor cores (sum_mma: H100,
#: stops 41-42, +2.1-5.6% at nine shapes; its errors against float64 within 3e-4 of the
#: vector sums'; benchmarks/NOTES.md)
GLUON_FP8_CONFIG = TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=4, gluon=True,
                              q_tma=True, rescale_late=True, sum_mma=True)
#: the persistent form: no longer a default in fp8 (GLUON_PERSISTENT_MIN_MEAN_KEYS): one CTA per
#: unit with sum_mma ran 6-8% faster at the several-sequence shapes that took it (H100, stop 42:
#: B8-S2048-H128 613 against 576 TFLOP/s, B4-S4096-H16 702 against 652). Kept for
#: `prefill.py --variants` and the GPU tests: q loaded by the consumers (with the producer's TMA
#: ptxas spills 4 words), the accumulator rescaled in the old place (rescale_late measured
#: -2..-4% there, stop 29), the vector row sums (with sum_mma ptxas spills 8 bytes, stop 41)
GLUON_FP8_PERSISTENT_CONFIG = replace(GLUON_FP8_CONFIG, persistent=True, q_tma=False,
                                      rescale_late=False, sum_mma=False)
#: Hopper 16-bit (sm_90): the Gluon kernel on the caller's q, k, v, 128-key steps over two
#: stages with k and v on barriers of their own (split_kv: a stage's k is released once its
#: q k^T is done, so the next k load does not wait for a P @ V), P carried packed (`_carry`),
#: no pingpong. H100, stop 43, GPU time against stop 28's 64-key steps over four stages with
#: pingpong: +9.2 / +8.3 / +7.3 / +5.8% at B1-S8192-H128, B1-S16384-H16, B4-S4096-H16,
#: B8-S2048-H128, +6.4% at chunked-q512-k8192-H16, +1.6% at B1-S1024-H16, -1.1% at
#: B16-S512-H16 (pingpong -1.5% and -0.0% at the two shapes measured with it; 128-key steps
#: without split_kv lost to 64-key ones on the H200 in stop 28, 0.62-0.82x FA3 bf16; q by the
#: producer's TMA +1-5% at five of six shapes, stop 28). Stop 44 (H100, two runs): the
#: accumulator rescaled after the next q k^T is issued with the PTX's warpgroup barriers
#: before mbarrier arrives and waits removed (rescale_late, lean_sync) +0.2-3.3% at the four
#: large shapes, +1.5% at chunked-q512-k8192-H16, -0.2% at B16-S512-H16; either alone
#: -1.2..+1.3% (benchmarks/NOTES.md)
GLUON_BF16_CONFIG = TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, gluon=True,
                               q_tma=True, split_kv=True, rescale_late=True, lean_sync=True)
#: its persistent form (never a default: GLUON_BF16_PERSISTENT_MIN_MEAN_KEYS) keeps stop 28's
#: 64-key steps: with 128-key steps and split_kv it spills 40 bytes outside the key loop
#: (sm_90); the rescale in its old place, Triton's barriers kept (as measured in stop 28)
GLUON_BF16_PERSISTENT_CONFIG = replace(GLUON_BF16_CONFIG, persistent=True, q_tma=False,
                                       block_n=64, num_stages=4, pingpong=True, split_kv=False,
                                       rescale_late=False, lean_sync=False)


def gluon_reasons(device: torch.device) -> list[str]:
    """Why the Gluon kernel (fp8 or 16-bit) cannot run on `device` (empty: it can)."""
    from ..settings import gluon_enabled

    if not gluon_enabled():
        return ["MLA_PLUGINS_GLUON is off"]
    if device.type != "cuda" or torch.version.hip or _interpreting():
        return ["the Gluon kernel runs on NVIDIA GPUs only (not ROCm, the CPU or the interpreter)"]
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return [f"the Gluon kernel is written for Hopper (sm_90: wgmma); compute capability "
                f"{cap[0]}.{cap[1]} found"]
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return ["this Triton has no triton.experimental.gluon (3.5+ needed)"]
    return []


#: where the Gluon kernel runs instead of the portable one (fp8, Hopper): batches whose
#: 128-row query slices see long key ranges on average. The Gluon kernel (one CTA per SM,
#: 12 warps) wins there; on short slices the portable kernel's two CTAs per SM hide each
#: slice's prologue and epilogue. H200, GPU time (CUDA graphs), benchmarks/NOTES.md:
#: one sequence, mean keys per slice ~4200 (B1-S8192-H128) 1.13x the portable kernel,
#: ~8300 (B1-S16384-H16) 1.17x, ~8000 (q512 over k8192) 1.24x; ~320 (B16-S512-H16) 0.85x.
#: Stop 42 (H100) brought the threshold down from 3072 to 1024 for one sequence, where
#: several already had it: attention alone at ~1100 (B8-S2048-H128) 1.18x the portable
#: kernel, same run; at ~1090 (B1-S2048-H8, split) 383 TFLOP/s (stop 41's variants) against
#: the portable kernel's 314 (stop 42's final run, FA3 FP8 within 2% in both)
GLUON_MIN_MEAN_KEYS = 1024
#: fp8_outliers in the Gluon kernel (the corrections' 32-deep fp8 product per key block,
#: chained with the two fp8 ones; the side tiles by TMA beside k and q) where it takes the
#: batch; off, the portable kernel takes every such batch. Stop 45 measured the earlier bf16
#: form of the side product (benchmarks/NOTES.md): +22-54% over plain fp8 end to end at the
#: four large shapes with it, +70-81% without (tests/gpu/test_fp8_outliers_gpu.py runs both)
GLUON_OUTLIERS = True
#: where batches of several sequences take the persistent form (GLUON_FP8_PERSISTENT_CONFIG):
#: nowhere (one CTA per unit ran 6-8% faster at the shapes that took it, stop 42)
GLUON_PERSISTENT_MIN_MEAN_KEYS = float("inf")
#: the same two for 16-bit inputs (GLUON_BF16_CONFIG): one CTA per unit at every shape (it
#: beat the portable kernel at all ten shapes of the H200 run, by 1.10-1.20x); persistent never
#: (it lost to one CTA per unit at nine of ten, by up to 37% at B1-S2048-H8)
GLUON_BF16_MIN_MEAN_KEYS = 0
GLUON_BF16_PERSISTENT_MIN_MEAN_KEYS = float("inf")


def mean_keys_per_slice(cu_q, cu_k, causal: bool, rows: int = 128) -> float:
    """Mean count of keys a `rows`-row query slice reaches (its last row's), over the batch."""
    slices = keys = 0
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
        q, k = q1 - q0, k1 - k0
        n = -(-q // rows)
        slices += n
        if not (n and causal):
            keys += n * k
        elif k >= q:  # slice i ends at row min(rows (i + 1), q): k - q more keys than rows
            keys += rows * (n - 1) * n // 2 + (n - 1) * (k - q) + k
        else:  # early rows see no key
            keys += sum(max(0, min(k, rows * (i + 1) + k - q)) for i in range(n - 1)) + k
    return keys / slices if slices else 0.0


def default_config(device: torch.device, fp8: bool) -> TileConfig:
    """The portable kernel's phase-1 configuration for this device's arch (chosen so it does
    not spill there); `batch_config` may pick the Gluon kernel instead."""
    if device_kind(device) != "rocm":
        return FP8_CONFIG if fp8 else BF16_CONFIG
    from .triton_attention import arch_config

    bm, bn, warps, stages = arch_config(device_arch(device) or "", fp8)
    return TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, use_tma=False)


def batch_config(device: torch.device, fp8: bool, cu_q, cu_k, causal: bool) -> TileConfig:
    """The phase-1 configuration for one batch: the Gluon kernel on Hopper where the batch's
    slices are long (GLUON_MIN_MEAN_KEYS; GLUON_BF16_* in 16-bit), one CTA per unit, or
    persistent for batches of several sequences from GLUON_PERSISTENT_MIN_MEAN_KEYS; else
    `default_config`."""
    if device_kind(device) == "cuda" and not gluon_reasons(device):
        keys = mean_keys_per_slice(cu_q, cu_k, causal)
        if fp8:
            config, persistent = GLUON_FP8_CONFIG, GLUON_FP8_PERSISTENT_CONFIG
            one, persist = GLUON_MIN_MEAN_KEYS, GLUON_PERSISTENT_MIN_MEAN_KEYS
        else:
            config, persistent = GLUON_BF16_CONFIG, GLUON_BF16_PERSISTENT_CONFIG
            one, persist = GLUON_BF16_MIN_MEAN_KEYS, GLUON_BF16_PERSISTENT_MIN_MEAN_KEYS
        if len(cu_q) > 2 and keys >= persist:
            return persistent
        if keys >= one:
            return config
    return default_config(device, fp8)


def _plan_config(plan: PrefillPlan, device: torch.device, fp8: bool) -> TileConfig:
    """`batch_config` for a plan, once per plan and mode (the Gluon kernel only where the
    plan's tiles are whole 128-row slices)."""
    key = ("phase1_config", fp8)
    config = plan.memo.get(key)
    if config is None:
        config = batch_config(device, fp8, *plan.cu_seqlens_host, plan.causal)
        if config.gluon and plan.tile_q % config.block_m:
            config = default_config(device, fp8)
        plan.memo[key] = config
    return config


def _tl_fp8(fp8_dtype: torch.dtype):
    from . import triton_quant as tq

    return tq.tl_dtype_of(fp8_dtype)


def _can_tma(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip or _interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_span(t: torch.Tensor) -> int:
    """Columns of the 2D [T, span] view a TMA descriptor takes of a [T, H, width] tensor:
    head h's `width` features start at column h * stride(1)."""
    return (t.shape[1] - 1) * t.stride(1) + t.shape[2]


def _tma_ok(t: torch.Tensor, width: int) -> bool:
    """Whether a [T, H, width] tensor can be read through a 2D [T, `_tma_span`] descriptor:
    contiguous features, 16-byte aligned base and strides, heads that do not overlap and
    rows that do not overlap (vLLM's v, a [..., 128:] view of [T, H, 256], qualifies)."""
    if t.shape[0] == 0 or t.shape[2] != width or t.stride(2) != 1:
        return False
    size = t.element_size()
    if t.shape[1] > 1 and (t.stride(1) < width or (t.stride(1) * size) % 16):
        return False
    return (t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
            and t.stride(0) >= _tma_span(t))


def run_prefill(
    inputs: PrefillInputs,
    plan: PrefillPlan,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    config: TileConfig | None = None,
    quantized: tuple[torch.Tensor, ...] | None = None,
    sides: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Phase 1 (with the fp8 quantization first when `inputs.fp8`).

    `quantized` = (q8, q scales, k8, vt8, scales) from `triton_quant.quantize_qkv` (rotated
    as `inputs.fp8_rotate` says; with `inputs.fp8_outliers`, `sides` = (q_side, k_side) from
    `triton_quant.write_outlier_sides` after it) skips the quantization (benchmarks time
    the attention alone with it);
    `config` overrides the default tile configuration. With `inputs.fp8_outliers` the Gluon
    kernel takes the side product only where GLUON_OUTLIERS is on and the configuration
    loads q by TMA; else it gives way to `default_config` (the portable kernel).
    """
    from . import triton_attention as ta
    from . import triton_quant as tq

    if plan.num_items == 0 and plan.total_q and plan.kernel != "triton":
        # another kernel's plan (FA3's has no work items): running it would write nothing
        raise ValueError(f"plan: found a plan of kernel {plan.kernel!r} with no work items for "
                         f"{plan.total_q} query rows, expected one of plan_prefill(..., "
                         "kernel='triton')")
    if plan.num_items == 0 or plan.total_q == 0:
        return
    q, k, v = inputs.q, inputs.k, inputs.v
    device = q.device
    if config is None:
        config = _plan_config(plan, device, inputs.fp8)
    use_tma = config.use_tma and _can_tma(device)
    heads = inputs.num_heads
    if inputs.fp8:
        check_fp8_plan(plan, config)
        cq_host, ck_host = plan.cu_seqlens_host
        batch = len(ck_host) - 1
        storage = _storage_dtype(inputs.fp8_dtype)
        if quantized is None:
            quantized, sides = quantize(inputs, plan)
        if inputs.fp8_outliers and sides is None:
            raise ValueError("sides: found None with fp8_outliers, expected the (q_side, k_side) "
                             "that triton_quant.write_outlier_sides filled")
        q_src, q_scales, k8, vt8, scales = quantized
        k_src, v_src = k8, vt8
        kv_dtype = _tl_fp8(storage)
        p_shift = 8.0
        vt_cols = tq.vt_columns(k.shape[0], batch)
    else:
        scales = q_scales = torch.empty(0, device=device)
        q_src, k_src, v_src = q, k, v
        kv_dtype, p_shift = None, 0.0
    if use_tma and not inputs.fp8 and not (_tma_ok(k, tq.NOPE + tq.ROPE) and _tma_ok(v, tq.DV)):
        use_tma = False
    if inputs.k.shape[0] == 0:
        use_tma = False  # a descriptor needs a non-empty tensor; no item reads keys then
    outliers = bool(inputs.fp8 and inputs.fp8_outliers)
    if config.gluon and ((outliers and not (GLUON_OUTLIERS and config.q_tma))
                         or not (use_tma and (inputs.fp8 or _tma_ok(q, tq.NOPE + tq.ROPE)))):
        # the Gluon kernel loads k/v (and q) through TMA, and the side tiles with q; the
        # Triton kernel covers the rest
        config = default_config(device, inputs.fp8)
    if config.gluon:
        if not inputs.fp8:
            import triton.language as tl

            kv_dtype, vt_cols = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q.dtype], 0
        _launch_gluon(inputs, plan, out, lse, partial_out, partial_lse, config, q_src, q_scales,
                      k_src, v_src, scales, vt_cols, kv_dtype, p_shift, sides if outliers else None)
        return

    bn = config.block_n
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        total_k, k_span = k_src.shape[0], _tma_span(k_src)
        kd = TensorDescriptor(k_src, [total_k, k_span], [k_src.stride(0), 1], [bn, tq.NOPE])
        krd = TensorDescriptor(k_src, [total_k, k_span], [k_src.stride(0), 1], [bn, tq.ROPE])
        if inputs.fp8:
            # every sequence starts at a 16-aligned column (triton_quant.vt_column); the shape
            # stops at the last written column: what lies past it reads as zeros
            vd = TensorDescriptor(v_src, [heads * tq.DV, vt_cols], [v_src.stride(0), 1], [tq.DV, bn])
        else:
            vd = TensorDescriptor(v_src, [total_k, _tma_span(v_src)], [v_src.stride(0), 1], [bn, tq.DV])
        k_arg, kr_arg, v_arg = kd, krd, vd
    else:
        k_arg, kr_arg, v_arg = k_src, k_src, v_src

    num_sub = -(-plan.tile_q // config.block_m)
    heads_per_cluster = plan.num_heads // plan.num_clusters
    grid = (plan.num_items * num_sub, heads_per_cluster)
    lse_arg = lse if lse is not None else partial_lse
    vt_stride = v_src.stride(0) if inputs.fp8 else 0
    ss_w = scales.stride(0) if inputs.fp8 else 0
    if inputs.fp8:
        sv_t, sv_h = 0, 0
    else:
        sv_t, sv_h = v.stride(0), v.stride(1)
    sqs_t = q_scales.stride(0) if inputs.fp8 else 0
    q_side, k_side = sides if outliers else (scales, scales)
    ta.mla_prefill_kernel[grid](
        q_src, k_arg, kr_arg, v_arg, out, lse_arg, partial_out, partial_lse, plan.work_info, scales,
        q_scales, q_side, k_side, q_src.stride(0), q_src.stride(1), k_src.stride(0), k_src.stride(1),
        sv_t, sv_h, vt_stride, ss_w, sqs_t, q_side.stride(0) if outliers else 0,
        out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_lse.stride(0), partial_lse.stride(1),
        inputs.softmax_scale * ta.LOG2E, num_sub, int(plan.causal), int(lse is not None),
        FP8=inputs.fp8, P_SHIFT=p_shift,
        USE_TMA=use_tma, V_TMA=use_tma, WARP_SPEC=config.warp_spec,
        BLOCK_M=config.block_m, BLOCK_N=bn, V_PERM=inputs.fp8 and tq.permuted_v(device),
        OUTLIERS=outliers,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _launch_gluon(inputs, plan, out, lse, partial_out, partial_lse, config, q, q_scales, k, v,
                  scales, vt_cols, kv_dtype, p_shift, sides=None) -> None:
    """Phase 1 through `gluon_attention.mla_prefill_gluon_kernel`: fp8 on quantize_qkv's q8,
    q_scales, k8 and vt8 (k, v), or 16-bit on the caller's q, k and v (`_tma_ok` layouts);
    `sides` (q_side, k_side): fp8_outliers' side tiles, the kernel's third product."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import gluon_attention as ga
    from . import gluon_sync as gs
    from . import triton_attention as ta
    from . import triton_quant as tq

    heads, bn, fp8 = inputs.num_heads, config.block_n, inputs.fp8
    kn_l, kr_l, vt_l = _gluon_layouts(bn, kv_dtype, fp8)
    total_k = k.shape[0]
    if fp8:
        span, kh, vh = heads * 192, 0, 0
        vd = TensorDescriptor(v, [heads * tq.DV, vt_cols], [v.stride(0), 1], [tq.DV, bn], vt_l)
    else:
        span, kh, vh = _tma_span(k), k.stride(1), v.stride(1)
        vd = TensorDescriptor(v, [total_k, _tma_span(v)], [v.stride(0), 1], [bn, tq.DV], vt_l)
    kd = TensorDescriptor(k, [total_k, span], [k.stride(0), 1], [bn, tq.NOPE], kn_l)
    krd = TensorDescriptor(k, [total_k, span], [k.stride(0), 1], [bn, tq.ROPE], kr_l)
    qn_l, qr_l = _gluon_q_layouts(kv_dtype)
    q_span = _tma_span(q)
    qnd = TensorDescriptor(q, [q.shape[0], q_span], [q.stride(0), 1], [64, tq.NOPE], qn_l)
    qrd = TensorDescriptor(q, [q.shape[0], q_span], [q.stride(0), 1], [64, tq.ROPE], qr_l)
    if sides is not None:
        side_l = _gluon_side_layout(kv_dtype)
        qsd, ksd = (TensorDescriptor(t, [t.shape[0], heads * t.shape[2]], [heads * t.shape[2], 1],
                                     [rows, t.shape[2]], side_l)
                    for t, rows in zip(sides, (64, bn), strict=True))
    else:  # not read
        qsd, ksd = qnd, kd
    num_sub = -(-plan.tile_q // config.block_m)
    num_tiles = plan.num_items * num_sub
    heads_pc = plan.num_heads // plan.num_clusters
    num_units = num_tiles * heads_pc
    # persistent: one CTA per SM (12 warps and ~150 KB of shared memory each)
    grid = (max(1, min(num_units, default_num_workers(q.device))) if config.persistent
            else num_units,)
    lse_arg = lse if lse is not None else partial_lse
    # lean_sync: the kernel's PTX without the warpgroup barriers before its mbarrier arrives
    # and waits, when this launch compiles it (gluon_sync)
    with gs.lean_compile() if config.lean_sync else contextlib.nullcontext():
        ga.mla_prefill_gluon_kernel[grid](
            q, qnd, qrd, kd, krd, vd, qsd, ksd, out, lse_arg, partial_out, partial_lse, plan.work_info, scales, q_scales,
            q.stride(0), q.stride(1), v.stride(0) if fp8 else 0, scales.stride(0) if fp8 else 0,
            q_scales.stride(0) if fp8 else 0,
            out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_lse.stride(0), partial_lse.stride(1),
            inputs.softmax_scale * ta.LOG2E, num_units, num_tiles, num_sub, heads_pc, int(plan.causal),
            int(lse is not None), _gluon_order(config, plan, heads_pc, q.device, 1 if fp8 else 2),
            kh, vh,
            KV_DTYPE=kv_dtype, P_SHIFT=p_shift, BLOCK_M=config.block_m, BLOCK_N=bn,
            NUM_STAGES=config.num_stages, CONSUMER_REGS=ga.CONSUMER_REGS,
            PRODUCER_REGS=ga.PRODUCER_REGS, PINGPONG=config.pingpong, PERSISTENT=config.persistent,
            FP8=fp8, Q_TMA=config.q_tma, RESCALE_LATE=config.rescale_late,
            SUM_MMA=config.sum_mma and fp8, SPLIT_KV=config.split_kv,
            LEAN_SYNC=gs.VERSION if config.lean_sync else 0, OUTLIERS=sides is not None,
            num_warps=ga.NUM_WARPS,
            maxnreg=ga.MAXNREG,
        )


def _gluon_order(config: TileConfig, plan: PrefillPlan, heads_pc: int, device,
                 kv_bytes: int = 1) -> int:
    """The Gluon kernel's `order` argument: one CTA per unit, longest_first (0 or 1);
    persistent, the heads whose k/v ((192 + 128) * kv_bytes bytes per key: 1 in fp8, 2 in
    16-bit) fit in half the L2."""
    if not config.persistent:
        return int(config.longest_first)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    per_head = max(1, plan.total_k * (192 + 128) * kv_bytes)
    return max(1, min(heads_pc, (l2 or 50 << 20) // 2 // per_head))


@functools.cache
def _gluon_q_layouts(kv_dtype):
    """Shared-memory layouts of a consumer group's q block (nope, rope): the kernel's q
    buffers, which the q descriptors' TMA boxes fill."""
    from triton.experimental.gluon import language as gl

    return (gl.NVMMASharedLayout.get_default_for([64, 128], kv_dtype),
            gl.NVMMASharedLayout.get_default_for([64, 64], kv_dtype))


@functools.cache
def _gluon_side_layout(kv_dtype):
    """Shared-memory layout of fp8_outliers' side tiles (fp8 rows of 32: 32 bytes), the q
    side's [64, 32] and the k side's [keys, 32] boxes alike."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([64, 32], kv_dtype)


@functools.cache
def _gluon_layouts(bn: int, kv_dtype, fp8: bool = True):
    """Shared-memory layouts of the k nope, k rope and v stages (fp8: v transposed)."""
    from triton.experimental.gluon import language as gl

    return (gl.NVMMASharedLayout.get_default_for([bn, 128], kv_dtype),
            gl.NVMMASharedLayout.get_default_for([bn, 64], kv_dtype),
            gl.NVMMASharedLayout.get_default_for([128, bn] if fp8 else [bn, 128], kv_dtype))


def check_fp8_plan(plan: PrefillPlan, config: TileConfig) -> None:
    """fp8 applies one scale per 64-row query block and per 128-key block (core/fp8.py): the
    plan's tiles and key splits, and the kernel's blocks, must line up with them."""
    from ..fp8 import KV_BLOCK, Q_BLOCK

    if plan.tile_q % Q_BLOCK or plan.kv_granularity % KV_BLOCK:
        raise ValueError(
            f"plan: tile_q={plan.tile_q}, kv_granularity={plan.kv_granularity} found; the triton "
            f"kernel's fp8 block scaling needs tile_q a multiple of {Q_BLOCK} and kv_granularity "
            f"a multiple of {KV_BLOCK}: plan with the kernel's own parameters (kernel='triton') "
            "or pass such values to plan_prefill"
        )
    if config.gluon:
        if (config.block_m, config.block_n) != (2 * Q_BLOCK, KV_BLOCK):
            raise ValueError(
                f"config: block_m={config.block_m}, block_n={config.block_n} found; the Gluon "
                f"kernel computes block_m == {2 * Q_BLOCK} (two {Q_BLOCK}-row q blocks) and "
                f"block_n == {KV_BLOCK} (one k/v scale block)"
            )
    elif config.block_m != Q_BLOCK or KV_BLOCK % config.block_n:
        raise ValueError(
            f"config: block_m={config.block_m}, block_n={config.block_n} found; fp8 needs "
            f"block_m == {Q_BLOCK} and block_n dividing {KV_BLOCK}"
        )


def split_workers(
    q_lens: list[int], k_lens: list[int], num_heads: int, tile_q: int, sms: int,
    max_splits: int = 16,
) -> int:
    """`num_workers` for `plan_prefill`: 1 (no split) when the tiles alone fill the GPU.

    One program runs per (tile, head), so splitting only pays when there are too few of
    them to fill `sms` multiprocessors about twice over (a short query over a long cached
    prefix, say). Then `num_heads * s` workers make `gcd(H, workers) = H` head clusters of
    `s` workers each, and a tile longer than a worker's share is cut into pieces.
    """
    tiles = sum(-(-n // tile_q) for n in q_lens)
    programs = tiles * num_heads
    if programs == 0 or programs >= 2 * sms:
        return 1
    splits = min(max_splits, -(-2 * sms // programs))
    # no piece shorter than ~512 keys: below that the reduce costs more than it saves
    longest = max((kl for kl in k_lens), default=0)
    splits = max(1, min(splits, longest // 512))
    return num_heads * splits if splits > 1 else 1


class TritonKernel(Kernel):
    name = "triton"
    description = (
        "Triton FP8/bf16 split-KV prefill + LSE reduce; CUDA sm_80+ (fp8: sm_89+), measured on "
        "H200; ROCm gfx942 (e4m3fnuz) / gfx950 written for, not run here"
    )
    priority = 10
    devices = frozenset({"cuda", "rocm"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    supports_fp8_outliers = True
    head_dims_qk = frozenset({192})
    head_dims_v = frozenset({128})
    #: (major, minor) needed on CUDA: tensor-core bf16 dots, and fp8 dots
    cuda_min_capability = (8, 0)
    cuda_fp8_min_capability = (8, 9)
    rocm_archs = ROCM_ARCHS
    #: where the kernels have actually been run and measured
    verified_on = ("cuda sm_90 (H200)",)

    def __init__(self) -> None:
        if _interpreting():
            # the Triton interpreter runs the same kernels on the CPU
            self.devices = frozenset({"cuda", "rocm", "cpu"})
        self._rocm_warned = False

    # -- capabilities ---------------------------------------------------------------------
    def environment_reasons(self) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            from ..advice import triton_install_hint  # the right advice differs per platform

            return [f"triton is not installed ({triton_install_hint()})"]
        return []

    def device_reasons(self, device: torch.device) -> list[str]:
        kind = device_kind(device)
        if kind == "cuda":
            cap = torch.cuda.get_device_capability(device)
            if cap < self.cuda_min_capability:
                need = ".".join(map(str, self.cuda_min_capability))
                return [f"CUDA compute capability {cap[0]}.{cap[1]} found, {need}+ needed"]
        elif kind == "rocm":
            arch = device_arch(device)
            if arch not in self.rocm_archs:
                return [f"ROCm arch {arch} found, written for {', '.join(self.rocm_archs)}"]
        return []

    def auto_reasons(self, inputs) -> list[str]:
        if device_kind(inputs.device) == "cpu":
            return [CPU_ONLY_PINNED]
        return []

    def extra_reasons(self, inputs) -> list[str]:
        if _interpreting() and inputs.dtype == torch.bfloat16:
            # numpy has no bfloat16: the interpreter's bf16 loads give garbage (issue 13)
            return [INTERPRETER_BF16]
        if inputs.op == "reduce" or not inputs.fp8 or device_kind(inputs.device) != "cuda":
            return []
        cap = torch.cuda.get_device_capability(inputs.device)
        if cap < self.cuda_fp8_min_capability:
            need = ".".join(map(str, self.cuda_fp8_min_capability))
            return [f"fp8 needs CUDA compute capability {need}+ (found {cap[0]}.{cap[1]}); pass fp8=False"]
        return []

    # -- work -----------------------------------------------------------------------------
    def plan_params(self, inputs: PrefillInputs) -> dict:
        cq, ck = inputs.seqlens_host or (inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist())
        # a plan made without naming the mode (fp8 None) may run fp8: plan for it
        config = batch_config(inputs.device, inputs.fp8 is not False, cq, ck, inputs.causal)
        tile_q = config.block_m
        q_lens = [b - a for a, b in zip(cq, cq[1:], strict=False)]
        k_lens = [b - a for a, b in zip(ck, ck[1:], strict=False)]
        sms = default_num_workers(inputs.device)
        workers = split_workers(q_lens, k_lens, inputs.num_heads, tile_q, sms)
        return {"tile_q": tile_q, "kv_granularity": 128, "num_workers": workers}

    def workspace_layout(self, plan: PrefillPlan, *, fp8: bool, num_heads: int, head_dim_v: int,
                         fp8_dtype: torch.dtype) -> list:
        """The partial buffers, and in fp8 the quantized q, k, transposed v and their scales
        (`triton_quant.quantize_qkv`'s shapes), so a call with a plan allocates none of them."""
        layout = super().workspace_layout(plan, fp8=fp8, num_heads=num_heads,
                                          head_dim_v=head_dim_v, fp8_dtype=fp8_dtype)
        if fp8 and _quantize_into_supported():
            from . import triton_quant as tq

            layout += tq.qkv_workspace_layout(plan.total_q, plan.total_k, plan.batch_size,
                                              num_heads, _storage_dtype(fp8_dtype))
        return layout

    def run(
        self,
        inputs: PrefillInputs,
        plan: PrefillPlan,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        workspace: torch.Tensor | None = None,
    ) -> None:
        """Quantize (fp8) into the workspace, phase 1, the reduce: the first call of a plan
        through the ordinary host code, recorded; later calls of the same layout replay the
        recorded launches (`triton_launch`), with no binder, descriptor or torch work."""
        if _HIP and not self._rocm_warned:
            self._warn_rocm(inputs.device)
        scratch, token = self.scratch_entry(inputs, plan, workspace)
        if plan.total_q == 0 or plan.num_items == 0:
            return
        q, k, v = inputs.q, inputs.k, inputs.v
        device = plan.device  # == q's device, checked by mla_prefill
        replayable = plan.memo.get("replayable")
        if replayable is None:
            replayable = plan.memo["replayable"] = (
                device.type == "cuda" and not torch.version.hip and not _interpreting())
        if not (replayable and tl_launch.ENABLED) or inputs.fp8_outliers:
            # fp8_outliers: its scratch (the selection, the side tiles) is allocated per call,
            # which a replay cannot follow
            with _on_device(device):
                self._run_ordinary(inputs, plan, out, lse, scratch)
            return
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        lp = 0 if lse is None else lse.data_ptr()
        rotation = None
        if inputs.fp8 and inputs.fp8_rotate:
            from . import triton_quant as tq

            # in the key: a recording holds one implementation's launches
            rotation = tq.current_rotation()
        key = (
            inputs.fp8, rotation, q.dtype, inputs.softmax_scale, token,
            q.stride(), k.stride(), v.stride(), out.stride(), None if lse is None else lse.stride(),
            qp % 16, kp % 16, vp % 16, op % 16, lp % 16,
        )
        memo = plan.memo.get("replay")
        if memo is not None and memo[1] is not None and memo[0] == key:
            index = device.index
            ptrs = {"q": qp, "k": kp, "v": vp, "out": op, "lse": lp}
            # torch.cuda.current_device() re-runs the lazy-init check on every call
            if torch._C._cuda_getDevice() == index:
                memo[1](index, ptrs)
            else:
                with torch.cuda.device(index):
                    memo[1](index, ptrs)
            return
        with _on_device(device):
            if memo is not None and memo[0] == key:  # recorded before: not replayable
                self._run_ordinary(inputs, plan, out, lse, scratch)
                return
            _ensure_wrapped()
            buffers = [t for t in scratch.values()] + [plan.work_info, plan.cu_seqlens_q,
                                                        plan.cu_seqlens_k]
            if rotation is not None:
                # made (copied to the device) before recording, kept for the process's life
                buffers.append(tq.rotation_operand(device, q.dtype, rotation))
            recorder = tl_launch.Recorder({"q": q, "k": k, "v": v, "out": out, "lse": lse}, buffers)
            with recorder:
                self._run_ordinary(inputs, plan, out, lse, scratch)
            plan.memo["replay"] = (key, recorder.replay())

    def _run_ordinary(self, inputs: PrefillInputs, plan: PrefillPlan, out: torch.Tensor,
                      lse: torch.Tensor | None, scratch: dict[str, torch.Tensor]) -> None:
        quantized = sides = None
        if inputs.fp8 and "k8" in scratch and _quantize_into_supported():
            quantized, sides = quantize(inputs, plan, out=(
                scratch["q8"], scratch["q_scales"], scratch["k8"], scratch["vt8"], scratch["scales"]))
        partial_out, partial_lse = scratch["partial_out"], scratch["partial_lse"]
        run_prefill(inputs, plan, out, lse, partial_out, partial_lse, quantized=quantized,
                    sides=sides)
        if plan.num_partial_tiles:
            self.reduce(ReduceInputs(
                partial_out=partial_out, partial_lse=partial_lse, reduce_indptr=plan.reduce_indptr,
                reduce_final_map=plan.reduce_final_map, reduce_partial_map=plan.reduce_partial_map,
                tile_q=plan.tile_q, num_kv_splits=0, out=out, final_lse=lse,
            ))

    def info(self, device: torch.device) -> KernelInfo:
        info = super().info(device)
        if info.available and device_kind(device) == "cpu":
            # runnable when pinned, never chosen automatically: say so in check/doctor
            return replace(info, reasons=[CPU_ONLY_PINNED, INTERPRETER_BF16])
        return info

    def _warn_rocm(self, device: torch.device) -> None:
        if device_kind(device) == "rocm" and not self._rocm_warned:
            self._rocm_warned = True
            logger.warning(
                "triton kernel on ROCm %s: written for this arch but never run on it by this "
                "project; check results with `mla-plugins check`", device_arch(device)
            )

    def prefill(
        self,
        inputs: PrefillInputs,
        plan: PrefillPlan,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        partial_out: torch.Tensor,
        partial_lse: torch.Tensor,
    ) -> None:
        self._warn_rocm(inputs.device)
        with _on_device(inputs.device):
            run_prefill(inputs, plan, out, lse, partial_out, partial_lse)

    def reduce(self, inputs: ReduceInputs) -> None:
        from .triton_reduce import reduce

        with _on_device(inputs.device):
            reduce(
                inputs.partial_out,
                inputs.partial_lse,
                inputs.reduce_indptr,
                inputs.reduce_final_map,
                inputs.reduce_partial_map,
                inputs.tile_q,
                inputs.out,
                inputs.final_lse,
            )


def quantize(inputs: PrefillInputs, plan: PrefillPlan, out: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor] | None]:
    """(quantize_qkv's five tensors, (q_side, k_side) with `inputs.fp8_outliers`, else None):
    the fp8 quantization of a call (rotated as `inputs.fp8_rotate` says; with the outliers,
    a second launch writes their corrections from the maxima the first published, into
    scratch allocated here), into `out` (the workspace's buffers) or new tensors."""
    from . import triton_quant as tq

    storage = _storage_dtype(inputs.fp8_dtype)
    limit = float(torch.finfo(inputs.fp8_dtype).max)
    args = (inputs.q, inputs.k, inputs.v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.batch_size,
            plan.max_seqlen_q, plan.max_seqlen_k, storage, limit, out)
    sms = default_num_workers(inputs.q.device)
    if not inputs.fp8_outliers:
        return tq.quantize_qkv(*args, rotate=inputs.fp8_rotate, sms=sms), None
    cq, ck = plan.cu_seqlens_host
    quantized, _, sides = tq.quantize_qkv_outliers(*args, used=(cq[-1], ck[-1]), sms=sms)
    return quantized, sides


def _storage_dtype(fp8_dtype: torch.dtype) -> torch.dtype:
    """What the fp8 copies are stored in: the fp8 format, or what tests set for the interpreter."""
    storage = globals().get("_FP8_STORAGE")
    return storage if storage is not None and _interpreting() else fp8_dtype


@functools.cache
def _quantize_into_supported() -> bool:
    from . import triton_quant as tq

    fn = getattr(tq, "quantize_qkv", None)
    return fn is not None and "out" in inspect.signature(fn).parameters


@functools.cache
def _ensure_wrapped() -> None:
    from . import gluon_attention, triton_attention, triton_launch, triton_quant, triton_reduce

    triton_launch.wrap_kernels(triton_quant, triton_attention, triton_reduce, gluon_attention)


class _on_device:
    """`torch.cuda.device(d)` for GPU tensors (Triton launches on the current device)."""

    def __init__(self, device: torch.device) -> None:
        self._ctx = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            return self._ctx.__exit__(*exc)
        return False


__all__ = ["BF16_CONFIG", "FP8_CONFIG", "GLUON_BF16_CONFIG", "GLUON_FP8_CONFIG", "TileConfig", "TritonKernel", "run_prefill", "split_workers"]
