"""The Triton kernel provider: FP8 (or bf16/fp16) split-KV MLA prefill and the LSE reduce.

Written for CUDA (measured on an H200, sm_90) and ROCm (gfx942 with e4m3fnuz, gfx950;
written for, not run here). Three pieces, each in its own module:
- `triton_quant`: the fused amax + cast of the dynamic per-tensor FP8 scales;
- `triton_attention`: phase 1 over the plan's work items;
- `triton_reduce`: phase 2, the merge of split tiles.

Nothing here imports triton at import time: `environment_reasons` looks for the package
and the kernel modules are imported on first use. Under `TRITON_INTERPRET=1` the
kernels also run on the CPU (slowly; for tests of the kernels' logic).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..device import default_num_workers, device_arch, device_kind
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of phase 1, chosen by measurement on the H200 (benchmarks/NOTES.md).

    block_m: query rows a program computes (the plan's tile_q is a multiple of it);
    block_n: keys per step of the online softmax; use_tma: k/v through tensor
    descriptors (sm_90+); warp_spec: Triton's automatic warp specialization of the key loop.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True
    warp_spec: bool = False


#: CUDA defaults per compute mode (fp8 / 16-bit), see benchmarks/NOTES.md for the measurements;
#: other archs: `default_config` (triton_attention.ARCH_CONFIGS)
FP8_CONFIG = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=4)
BF16_CONFIG = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def default_config(device: torch.device, fp8: bool) -> TileConfig:
    """The phase-1 configuration for this device's arch (chosen so it does not spill there)."""
    if device_kind(device) != "rocm":
        return FP8_CONFIG if fp8 else BF16_CONFIG
    from .triton_attention import arch_config

    bm, bn, warps, stages = arch_config(device_arch(device) or "", fp8)
    return TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, use_tma=False)


def _tl_fp8(fp8_dtype: torch.dtype):
    import triton.language as tl

    return {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e4m3fnuz: tl.float8e4b8,
            torch.float16: tl.float16}[fp8_dtype]


def _can_tma(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip or _interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ok(t: torch.Tensor, width: int) -> bool:
    """Whether a [T, H, width] tensor can be seen as a 2D [T, H * width] TMA descriptor."""
    if t.shape[0] == 0 or t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != width):
        return False
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def run_prefill(
    inputs: PrefillInputs,
    plan: PrefillPlan,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    config: TileConfig | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Phase 1 (with the fp8 quantization first when `inputs.fp8`).

    `quantized` = (k8, vt8, scales) from `triton_quant.quantize_kv` skips the quantization
    (benchmarks time the attention alone with it); `config` overrides the default tile
    configuration.
    """
    from . import triton_attention as ta
    from . import triton_quant as tq

    if plan.num_items == 0 or plan.total_q == 0:
        return
    q, k, v = inputs.q, inputs.k, inputs.v
    device = q.device
    if config is None:
        config = default_config(device, inputs.fp8)
    use_tma = config.use_tma and _can_tma(device)
    heads = inputs.num_heads
    if inputs.fp8:
        check_fp8_plan(plan, config)
        cq_host, ck_host = plan.cu_seqlens_host
        batch = len(ck_host) - 1
        fp8_max = float(torch.finfo(inputs.fp8_dtype).max)
        storage = inputs.fp8_dtype
        if _FP8_STORAGE is not None and _interpreting():
            storage = _FP8_STORAGE  # the interpreter has no fp8: same logic, fp16 storage
        if quantized is None:
            cu_k = inputs.cu_seqlens_k
            k8, vt8, scales = tq.quantize_kv(k, v, cu_k, batch, plan.max_seqlen_k, storage, fp8_max)
        else:
            k8, vt8, scales = quantized
        k_src, v_src = k8, vt8
        kv_dtype = _tl_fp8(storage)
        p_shift = 8.0
        vt_cols = tq.vt_columns(k.shape[0], batch)
    else:
        scales = torch.empty(0, device=device)
        k_src, v_src = k, v
        fp8_max, kv_dtype, p_shift = 448.0, None, 0.0
    if use_tma and not inputs.fp8 and not (_tma_ok(k, tq.NOPE + tq.ROPE) and _tma_ok(v, tq.DV)):
        use_tma = False
    if inputs.k.shape[0] == 0:
        use_tma = False  # a descriptor needs a non-empty tensor; no item reads keys then

    bn = config.block_n
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        total_k = k_src.shape[0]
        kd = TensorDescriptor(k_src, [total_k, heads * 192], [k_src.stride(0), 1], [bn, tq.NOPE])
        krd = TensorDescriptor(k_src, [total_k, heads * 192], [k_src.stride(0), 1], [bn, tq.ROPE])
        if inputs.fp8:
            # every sequence starts at a 16-aligned column (triton_quant.vt_column); the shape
            # stops at the last written column: what lies past it reads as zeros
            vd = TensorDescriptor(v_src, [heads * tq.DV, vt_cols], [v_src.stride(0), 1], [tq.DV, bn])
        else:
            vd = TensorDescriptor(v_src, [total_k, heads * tq.DV], [v_src.stride(0), 1], [bn, tq.DV])
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
    ta.mla_prefill_kernel[grid](
        q, k_arg, kr_arg, v_arg, out, lse_arg, partial_out, partial_lse, plan.work_info, scales,
        q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1), sv_t, sv_h, vt_stride, ss_w,
        out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_lse.stride(0), partial_lse.stride(1),
        inputs.softmax_scale * ta.LOG2E, num_sub, int(plan.causal), int(lse is not None),
        FP8=inputs.fp8, FP8_MAX=fp8_max, KV_DTYPE=kv_dtype, P_SHIFT=p_shift,
        USE_TMA=use_tma, V_TMA=use_tma, WARP_SPEC=config.warp_spec,
        BLOCK_M=config.block_m, BLOCK_N=bn,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def check_fp8_plan(plan: PrefillPlan, config: TileConfig) -> None:
    """fp8 applies one scale per 64-row query block and per 64-key block (core/fp8.py): the
    plan's tiles and key splits, and the kernel's blocks, must line up with them."""
    from ..fp8 import BLOCK

    if plan.tile_q % BLOCK or plan.kv_granularity % BLOCK:
        raise ValueError(
            f"plan: tile_q={plan.tile_q}, kv_granularity={plan.kv_granularity} found; the triton "
            f"kernel's fp8 block scaling needs both multiples of {BLOCK}: plan with the kernel's "
            "own parameters (kernel='triton') or pass such values to plan_prefill"
        )
    if config.block_m != BLOCK or BLOCK % config.block_n:
        raise ValueError(
            f"config: block_m={config.block_m}, block_n={config.block_n} found; fp8 needs "
            f"block_m == {BLOCK} and block_n dividing {BLOCK}"
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
        config = default_config(inputs.device, inputs.fp8)
        tile_q = config.block_m
        cq, ck = inputs.seqlens_host or (inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist())
        q_lens = [b - a for a, b in zip(cq, cq[1:], strict=False)]
        k_lens = [b - a for a, b in zip(ck, ck[1:], strict=False)]
        sms = default_num_workers(inputs.device)
        workers = split_workers(q_lens, k_lens, inputs.num_heads, tile_q, sms)
        return {"tile_q": tile_q, "kv_granularity": 128, "num_workers": workers}

    def workspace_layout(self, plan: PrefillPlan, *, fp8: bool, num_heads: int, head_dim_v: int,
                         fp8_dtype: torch.dtype) -> list:
        """The partial buffers, and in fp8 the quantized k, transposed v and their scales
        (`triton_quant.quantize_kv`'s shapes), so a call with a plan allocates none of them."""
        layout = super().workspace_layout(plan, fp8=fp8, num_heads=num_heads,
                                          head_dim_v=head_dim_v, fp8_dtype=fp8_dtype)
        if fp8 and _quantize_into_supported():
            from . import triton_quant as tq

            storage = _storage_dtype(fp8_dtype)
            t_pad = tq.vt_padded_len(plan.total_k, plan.batch_size)
            layout += [
                ("k8", (plan.total_k, num_heads, tq.NOPE + tq.ROPE), storage),
                ("vt8", (num_heads * tq.DV, t_pad), storage),
                ("scales", (2, num_heads, t_pad // 16), torch.float32),
            ]
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
        from . import triton_launch as tl_launch

        if torch.version.hip and not self._rocm_warned:
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
        if not (replayable and tl_launch.ENABLED):
            with _on_device(device):
                self._run_ordinary(inputs, plan, out, lse, scratch)
            return
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        lp = 0 if lse is None else lse.data_ptr()
        key = (
            inputs.fp8, q.dtype, inputs.softmax_scale, token,
            q.stride(), k.stride(), v.stride(), out.stride(), None if lse is None else lse.stride(),
            qp % 16, kp % 16, vp % 16, op % 16, lp % 16,
        )
        memo = plan.memo.get("replay")
        if memo is not None and memo[1] is not None and memo[0] == key:
            index = device.index
            ptrs = {"q": qp, "k": kp, "v": vp, "out": op, "lse": lp}
            if torch.cuda.current_device() == index:
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
            buffers = [t for t in scratch.values()] + [plan.work_info, plan.cu_seqlens_k]
            recorder = tl_launch.Recorder({"q": q, "k": k, "v": v, "out": out, "lse": lse}, buffers)
            with recorder:
                self._run_ordinary(inputs, plan, out, lse, scratch)
            plan.memo["replay"] = (key, recorder.replay())

    def _run_ordinary(self, inputs: PrefillInputs, plan: PrefillPlan, out: torch.Tensor,
                      lse: torch.Tensor | None, scratch: dict[str, torch.Tensor]) -> None:
        from . import triton_quant as tq

        quantized = None
        if inputs.fp8 and "k8" in scratch and _quantize_into_supported():
            quantized = tq.quantize_kv(
                inputs.k, inputs.v, plan.cu_seqlens_k, plan.batch_size, plan.max_seqlen_k,
                _storage_dtype(inputs.fp8_dtype), float(torch.finfo(inputs.fp8_dtype).max),
                out=(scratch["k8"], scratch["vt8"], scratch["scales"]),
            )
        partial_out, partial_lse = scratch["partial_out"], scratch["partial_lse"]
        run_prefill(inputs, plan, out, lse, partial_out, partial_lse, quantized=quantized)
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


def _storage_dtype(fp8_dtype: torch.dtype) -> torch.dtype:
    """What the fp8 copies are stored in: the fp8 format, or what tests set for the interpreter."""
    storage = globals().get("_FP8_STORAGE")
    return storage if storage is not None and _interpreting() else fp8_dtype


@functools.cache
def _quantize_into_supported() -> bool:
    from . import triton_quant as tq

    fn = getattr(tq, "quantize_kv", None)
    return fn is not None and "out" in inspect.signature(fn).parameters


@functools.cache
def _ensure_wrapped() -> None:
    from . import triton_attention, triton_launch, triton_quant, triton_reduce

    triton_launch.wrap_kernels(triton_quant, triton_attention, triton_reduce)


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


__all__ = ["BF16_CONFIG", "FP8_CONFIG", "TileConfig", "TritonKernel", "run_prefill", "split_workers"]
