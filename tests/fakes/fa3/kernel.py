"""The forward body every fake FA3 build registers: FlashAttention-3's `mha_fwd`, on the CPU.

Written from the real sources (copies under /work/shared_src, cited as file:line):
- flash-attention-HEAD/flash_api.cpp (Dao-AILab hopper/ at HEAD): `mha_fwd` 673-1197, the
  build-flag refusals in `run_mha_fwd_` 332 / 362 and after the parameter set-up 1148-1165;
- vllm-flash-attention-617264c1/flash_api.cpp (vLLM's fork): `mha_fwd` 737-1312, which adds the
  HDIMDIFF build-flag checks 855-860, `s_aux` and the context-parallel checks 1236-1260;
- flash-attention-HEAD/softmax.h 151 (`row_sum == 0 or NaN -> lse -INFINITY`, the output scaled
  by 0) and 78/118 (a row max of -INFINITY taken as 0), epilogue_fwd.hpp 411-447 (`store_zero`:
  a tile with no key to visit writes output 0 and lse -INFINITY);
- FA3 before its 2025-01-07 refactor wrote +INFINITY for those rows (`legacy_empty_lse`).

What it computes, as the real kernel does (in float64 here, one sequence at a time):
- the batched layout where neither `cu_seqlens_q` nor `cu_seqlens_k` is given (flash_api.cpp
  758-770, 807-823, 866-892): q [B, S_q, H, D], k and v [B, S_k, H_k, D(v)], out
  [B, S_q, H, Dv], lse [B, H, S_q]; its tiles read nothing past a sequence (TMA bounds);
- varlen over `cu_seqlens_q` / `cu_seqlens_k` (int32 [B+1]); heads of q grouped over the
  heads of k (`num_heads % num_heads_k == 0`, head h reads k head h // (H / H_k));
- bottom-right causal (`is_causal` sets window_size_right = 0, flash_api.cpp 805): row i of a
  sequence with q_len rows and k_len keys sees keys j <= i + k_len - q_len; sliding windows
  (`window_size_left/right` >= 0) as the interface docstrings state; `softcap` as tanh capping;
- `softmax_scale` (None: 1/sqrt(head_size), flash_api.cpp 772);
- fp8 e4m3 inputs: q, k, v dequantized by `q_descale`, `k_descale`, `v_descale` of shape
  [batch, num_heads_k] float32 (absent: 1, as the kernel's nullptr descale), output bf16;
- lse [num_heads, total_q] float32 (natural log); a row whose exp-sum is 0 (no visible key) or
  NaN gets lse -inf (legacy: +inf) and its output scaled by 0 (so 0 where no key was seen);
  the row max ignores NaN (the kernel's fmaxf);
- out written into `out` when given (checked: dtype, stride(-1) == 1, shape), else allocated;
- a query tile that visits a sequence's last, partial key block multiplies P = 0 by the V
  rows past the sequence's end (the next sequence's): an inf or NaN there makes that tile's
  rows NaN (`_tile_reads`, measured on an H200: 128 x 128 tiles for bf16 192/128);
- a batch whose total_k is 0 is not run: output zeroed and lse filled with +INFINITY, as both
  flash_api.cpp do (HEAD 1190-1194, vLLM 1305-1309), even at HEAD;
- returns (out, softmax_lse, out_accum, softmax_lse_accum); out_accum and softmax_lse_accum are
  undefined tensors (None in Python) since no split is made (num_splits <= 1), as the real op
  returns them unsplit; in a `Tensor[]` return (vLLM) they are empty tensors instead (a list
  cannot carry None through the dispatcher).

Scheduler metadata (`get_scheduler_metadata`, `scheduler_metadata`), from
flash-attention-HEAD/flash_api.cpp `mha_fwd_get_scheduler_metadata` 522-662 and `mha_fwd`
987-1025 / 1186-1189, and vLLM's fork (vllm-flash-attention 617264c1 hopper/flash_api.cpp 584-725
and 1053-1113):
- the metadata op applies the real checks (qkv dtype, heads dividing) and returns an int32
  tensor of the real size on seqused_k's device: FA3 (and fa3-fwd, sgl_kernel) 1 + b4 * (2 +
  [not local] + [causal or local]) with b4 the batch rounded up to 4; vLLM's fork 1 + b4 * (1 +
  [dynamic split: batch <= 992 and more than one split] + [causal or local]);
- the forward, given one, applies the real checks in the real order and messages: on q's
  device ("scheduler_metadata must be on CUDA"), `CHECK_SHAPE(scheduler_metadata,
  metadata_size)` with the size its own arguments give, contiguous, int32;
- the size depends on the split count where FA3's heuristic picks it (num_splits 0): this
  fake computes FA3's `get_num_splits` (hopper/heuristics.h `num_splits_heuristic`, tile
  sizes from hopper/tile_size.h `tile_size_fwd_sm90`) for an H200's 132 SMs;
- what the real forward does not check and the fake does: the real kernel schedules the call's
  tiles by whatever the metadata holds (tiles, splits and batch order per sequence), so a
  metadata made for other arguments (another head count or dtype, other sequence lengths, or
  a batch size that rounds to the same size) gives wrong or missing rows without an error.
  The fake remembers what each metadata tensor was made for and raises where any argument
  of the forward call differs from it (a tensor it did not make is refused too).
Each metadata call is recorded in `METADATA_CALLS[namespace]`, as the forward's are.

What the real kernel adds and this body does not model: it runs on Hopper GPUs only
(`CHECK_DEVICE`: "q must be on CUDA", sm_90 for fp8 and for different V head dims); tile
scheduling (128-row query tiles, the persistent/LPT scheduler, the metadata's contents and
the tile semaphore the forward zeroes after each call, split-KV with its combine kernel,
PackGQA); float32 accumulation, and in fp8 the e4m3 rounding of P
before the PV product (with the exp scaled by 2^8, `Max_offset`); the causal special case for
max_seqlen_q == 1 (same result); paged KV, appended KV (`k_new`), rotary, `q_v`, `seqused_*`,
`leftpad_k`, `s_aux` / `sinks`, context parallelism: those raise NotImplementedError here so a
caller that passes them fails loudly. A `max_seqlen_*` shorter than a sequence is not modelled
either (the real kernel tiles by it): it raises here.

Each call is recorded in `CALLS[namespace]` (the full positional argument list, defaults
filled in) so a test can compare what two callers passed.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

#: namespace -> every call's argument list (schema order, defaults filled in)
CALLS: dict[str, list[list]] = {}
#: namespace -> every get_scheduler_metadata call's argument list (the same way)
METADATA_CALLS: dict[str, list[list]] = {}
#: namespace -> the live torch.library.Library of a fake build, and its two schemas
_LIBS: dict[str, tuple[torch.library.Library, tuple]] = {}
#: id(metadata tensor) -> (a weak reference to it, the namespace that made it, what for)
_MADE: dict[int, tuple] = {}
#: the SM count the fakes schedule for (H100 SXM and H200)
NUM_SM = 132
#: flash_api.cpp 42
PREPARE_VARLEN_MAX_BATCHES_1CTA = 992


@dataclass
class Build:
    """One FA3 build as its `_C` library registers it."""

    namespace: str
    schema: str
    #: FLASHATTENTION_DISABLE_* flags compiled into the build (a dict, read at call time)
    flags: dict = field(default_factory=dict)
    #: pre-2025 FA3: rows that see no key get lse +inf
    legacy_empty_lse: bool = False
    #: vLLM's fork: the HDIMDIFF checks in mha_fwd (vllm flash_api.cpp 855-860)
    hdimdiff_checks_in_fwd: bool = False
    #: (kBlockM, kBlockN) of the forward's tiles, for what they read past a sequence's end
    #: (`_tile_reads`); None: no such reads
    tile: tuple[int, int] | None = (128, 128)
    #: the build's `get_scheduler_metadata` schema (None: the build registers no such op)
    metadata_schema: str | None = None
    #: how its scheduler metadata is laid out: "fa3" (FA3 since 2025-08, fa3-fwd, sgl_kernel)
    #: or "vllm" (vLLM's fork: no batch sort, a split vector only where it splits)
    metadata_layout: str = "fa3"


def _flag(flags: dict, name: str) -> bool:
    return bool(flags.get(f"FLASHATTENTION_DISABLE_{name}") or flags.get(f"FLASH_ATTENTION_DISABLE_{name}"))


def _check(cond: bool, message: str) -> None:
    """TORCH_CHECK: a RuntimeError with the real message."""
    if not cond:
        raise RuntimeError(message)


def _check_shape(x: torch.Tensor, name: str, expected: tuple, spelled: str) -> None:
    # CHECK_SHAPE(x, ...): #x " must have shape (" #__VA_ARGS__ ")"
    _check(tuple(x.shape) == tuple(expected), f"{name} must have shape ({spelled})")


def _float_ptr(x: torch.Tensor) -> None:
    # at::Tensor::data_ptr<float>() on another dtype (c10's check in TensorMethods.cpp)
    if x.dtype != torch.float32:
        names = {torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float64: "Double",
                 torch.int32: "Int", torch.int64: "Long", torch.float8_e4m3fn: "Float8_e4m3fn"}
        raise RuntimeError(f"expected scalar type Float but found {names.get(x.dtype, str(x.dtype))}")


def _max_headdim(flags: dict) -> int:
    """get_max_headdim (flash_api.cpp 473-489)."""
    for dim in (256, 192, 128, 96, 64):
        if not _flag(flags, f"HDIM{dim}"):
            return dim
    return 0


NOT_MODELLED = ("k_new", "v_new", "q_v", "qv", "cu_seqlens_k_new", "seqused_q", "seqused_k",
                "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin",
                "seqlens_rotary", "s_aux", "sinks", "sparse_mask_fine", "cp_tot_seqused_k")


def _int_ptr(x: torch.Tensor) -> None:
    # at::Tensor::data_ptr<int>() on another dtype (c10's check in TensorMethods.cpp)
    if x.dtype != torch.int32:
        names = {torch.int64: "Long", torch.float32: "Float", torch.int16: "Short"}
        raise RuntimeError(f"expected scalar type Int but found {names.get(x.dtype, str(x.dtype))}")


# -- scheduling: what decides the metadata's size (flash_api.cpp, tile_size.h, heuristics.h) --


def _round_up_headdim(d: int) -> int:
    """round_up_headdim (flash_api.cpp 491-508), no head dim compiled out."""
    return next((r for r in (64, 96, 128, 192, 256) if d <= r), 256)


def _round_up_headdimv(d: int) -> int:
    """round_up_headdimv (flash_api.cpp 510-517)."""
    return next((r for r in (64, 96, 128, 192, 256) if d <= r), 512)


def _tile_size_sm90(d: int, dv: int, causal: bool, local: bool, element_size: int,
                    softcap: bool) -> tuple[int, int]:
    """(kBlockM, kBlockN) of tile_size_fwd_sm90 (tile_size.h 10-57), without paged KV."""
    if element_size == 2:
        if d <= 64:
            if dv == 512:
                return 64, 64
            if dv == 256:
                return 128, 96
            return 192, 128 if causal or local else 192
        if d <= 96:
            return 192, 128 if local else 144
        if d <= 128:
            return 128, 128 if causal or local else 176
        if d <= 192:
            return 128, 96 if local else (128 if dv <= 128 else 112)
        return 128, 64 if local else 80
    if d <= 64:
        return 192, 160
    if d <= 96:
        return 192, 128
    if d <= 128:
        return 128, 192 if softcap and local else 224
    if d <= 192:
        return 128, 128 if softcap and local else 160
    return 128, 64 if local else 128


def _num_splits_heuristic(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head,
                          causal_or_local, max_splits) -> int:
    """num_splits_heuristic (heuristics.h 25-59), line for line."""
    if total_mblocks >= 0.8 * num_sms:
        size_l2 = 50 * 1024 * 1024
        if size_one_kv_head > size_l2 and num_m_blocks >= num_sms * 2 and not causal_or_local:
            return min((size_one_kv_head + size_l2 - 1) // size_l2, max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    efficiency = []
    for n in range(1, max_splits + 1):
        waves = total_mblocks * n / num_sms
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency, default=0.0)
    return next((n for n, eff in enumerate(efficiency, 1) if eff >= 0.85 * best), 1)


def _causal_local(max_q: int, max_k: int, head_size: int, left: int, right: int, chunk: int,
                  is_causal: bool) -> tuple[bool, bool, int, int]:
    """(is_causal, is_local, left, right) as both mha_fwd (795-805 and set_params_fprop) and
    the metadata op (566-584) derive them, without paged KV."""
    if left >= max_k - 1:
        left = -1
    if right >= max_q - 1:
        right = -1
    if max_q == 1 and left == -1 and right == -1 and chunk == 0:
        is_causal = False  # head dims outside (64, 128] or no page table: always here
    if is_causal:
        right = 0
    causal = left < 0 and right == 0 and chunk == 0
    local = (left >= 0 or right >= 0 or chunk >= 1) and not causal
    return causal, local, left, right


def _metadata_size(build: Build, *, batch, max_q, max_k, heads, heads_k, d, dv, e4m3, left,
                   right, chunk, is_causal, softcap, num_splits, sm_margin) -> int:
    """The scheduler metadata's size for these arguments, on sm_90 and varlen (both the
    metadata op and the forward's `metadata_size`)."""
    causal, local, left, right = _causal_local(max_q, max_k, d, left, right, chunk, is_causal)
    b4 = (batch + 3) // 4 * 4
    swizzle = causal or local
    if build.metadata_layout == "fa3":  # flash_api.cpp 992-1002 (sort unless local)
        return 1 + b4 * (2 + (not local) + swizzle)
    if num_splits <= 0:  # get_num_splits (flash_api.cpp 443-470), num_splits_dynamic_ptr set
        d_r = _round_up_headdim(d)
        dv_r = d_r if dv == d else _round_up_headdimv(dv)
        block_m, block_n = _tile_size_sm90(d_r, dv_r, causal, local, 1 if e4m3 else 2, softcap)
        loaded = max_k if not local else max(0, min(max_k, right + left + 1 + block_m))
        n_blocks = -(-loaded // block_n)
        m_blocks = -(-(max_q * (heads // heads_k)) // block_m)
        num_splits = _num_splits_heuristic(heads_k * m_blocks, NUM_SM - sm_margin, n_blocks,
                                           m_blocks, max_k * (d + dv) * (1 if e4m3 else 2),
                                           causal or local, 128)
    dynamic = batch <= PREPARE_VARLEN_MAX_BATCHES_1CTA and num_splits > 1  # vllm 1071, 1083-1089
    return 1 + b4 * (1 + dynamic + swizzle)


def _lens(cu: torch.Tensor | None, count: int, static: int) -> tuple[int, ...]:
    if cu is None:
        return (static,) * count
    values = cu.tolist()
    return tuple(b - a for a, b in zip(values, values[1:], strict=False))


def scheduler_metadata(build: Build, a: dict) -> torch.Tensor:
    """mha_fwd_get_scheduler_metadata for one call: `a` maps every schema argument name to its
    value. Returns the metadata tensor (zeros: its contents are not modelled) and remembers
    what it was made for."""
    dtype = a["qkv_dtype"]
    _check(dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
           "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    _check(a["num_heads"] % a["num_heads_k"] == 0,
           "Number of heads in key/value must divide number of heads in query")
    for name in ("cu_seqlens_k_new", "seqused_q", "leftpad_k"):
        if a.get(name) is not None:
            raise NotImplementedError(f"fake FA3 ({build.namespace}): get_scheduler_metadata's {name} is not modelled")
    if a.get("page_size") is not None or a.get("max_seqlen_k_new", 0):
        raise NotImplementedError(f"fake FA3 ({build.namespace}): paged or appended KV metadata is not modelled")
    seqused_k, cu_q = a["seqused_k"], a.get("cu_seqlens_q")
    _int_ptr(seqused_k)  # params.seqused_k = seqused_k.data_ptr<int>()
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if a.get(name) is not None:
            _int_ptr(a[name])
    batch = a["batch_size"]
    # prepare_varlen_num_blocks reads seqused_k[0:batch] and cu_seqlens_q[0:batch + 1]
    if seqused_k.numel() < batch or (cu_q is not None and cu_q.numel() < batch + 1):
        raise RuntimeError(
            f"fake FA3 ({build.namespace}): batch_size {batch} reads past seqused_k "
            f"({seqused_k.numel()}) or cu_seqlens_q ({None if cu_q is None else cu_q.numel()}): "
            "out of bounds on the GPU")
    chunk = a.get("attention_chunk", 0)
    size = _metadata_size(build, batch=batch, max_q=a["max_seqlen_q"], max_k=a["max_seqlen_k"],
                          heads=a["num_heads"], heads_k=a["num_heads_k"], d=a["headdim"],
                          dv=a["headdim_v"], e4m3=dtype == torch.float8_e4m3fn,
                          left=a["window_size_left"], right=a["window_size_right"], chunk=chunk,
                          is_causal=a["is_causal"], softcap=a["has_softcap"],
                          num_splits=a["num_splits"], sm_margin=a["sm_margin"])
    made_for = {
        "batch_size": batch, "max_seqlen_q": a["max_seqlen_q"], "max_seqlen_k": a["max_seqlen_k"],
        "num_heads": a["num_heads"], "num_heads_k": a["num_heads_k"], "headdim": a["headdim"],
        "headdim_v": a["headdim_v"], "qkv_dtype": dtype, "is_causal": a["is_causal"],
        "window_size_left": a["window_size_left"], "window_size_right": a["window_size_right"],
        "attention_chunk": chunk, "softcap": bool(a["has_softcap"]), "num_splits": a["num_splits"],
        "pack_gqa": a["pack_gqa"], "sm_margin": a["sm_margin"],
        "q_lens": _lens(cu_q, batch, a["max_seqlen_q"]),
        "k_lens": tuple(seqused_k[:batch].tolist()),  # seqused_k comes first (get_num_n_blocks)
    }
    metadata = torch.zeros(size, dtype=torch.int32, device=seqused_k.device)
    _MADE[id(metadata)] = (weakref.ref(metadata), build.namespace, made_for)
    return metadata


def _check_metadata(build: Build, metadata: torch.Tensor, q: torch.Tensor, size: int,
                    call: dict) -> None:
    """mha_fwd 1005-1011 (the real checks), then what the real kernel would schedule by."""
    _check(metadata.device.type == q.device.type, "scheduler_metadata must be on CUDA")
    _check_shape(metadata, "scheduler_metadata", (size,), "metadata_size")
    _check(metadata.is_contiguous(), "scheduler_metadata must be contiguous")
    _check(metadata.dtype == torch.int32, "scheduler_metadata must have dtype int32")
    entry = _MADE.get(id(metadata))
    if entry is None or entry[0]() is not metadata or entry[1] != build.namespace:
        raise RuntimeError(
            f"fake FA3 ({build.namespace}): scheduler_metadata was not made by this build's "
            "get_scheduler_metadata; the real kernel would schedule by whatever it holds (not modelled)")
    made_for = entry[2]
    differ = {k: (made_for[k], call[k]) for k in call if made_for[k] != call[k]}
    if differ:
        raise RuntimeError(
            f"fake FA3 ({build.namespace}): scheduler_metadata made for other arguments than this "
            f"call's ({', '.join(f'{k}: made for {m!r}, called with {c!r}' for k, (m, c) in differ.items())}); "
            "the real mha_fwd checks only its size and schedules the call by it (wrong or missing rows)")


def forward(build: Build, a: dict) -> tuple:
    """mha_fwd for one call: `a` maps every schema argument name to its value."""
    flags = build.flags
    q, k, v = a["q"], a["k"], a["v"]
    for name in NOT_MODELLED:
        if a.get(name) is not None:
            raise NotImplementedError(f"fake FA3 ({build.namespace}): {name} is not modelled")
    if a.get("only_qv"):
        raise NotImplementedError(f"fake FA3 ({build.namespace}): only_qv is not modelled")
    if "cp_world_size" in a:  # vLLM flash_api.cpp 1255-1257
        _check(a["cp_world_size"] > 0, "cp_world_size must be positive, required by downstream unified code path. Use 1 if CP is not enabled.")
        _check(a["cp_world_size"] != 1 or a["cp_rank"] == 0, "When context parallelism is disabled, cp_rank must be zero")
        if a["cp_world_size"] != 1:
            raise NotImplementedError(f"fake FA3 ({build.namespace}): context parallelism is not modelled")

    # flash_api.cpp 714-728: dtypes and strides (CHECK_DEVICE skipped: this fake runs on the CPU)
    q_type = q.dtype
    _check(q_type in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
           "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    _check(k.dtype == q_type, "query and key must have the same dtype")
    _check(v.dtype == q_type, "query and value must have the same dtype")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")

    # 739-755: varlen offsets (is_varlen_q / is_varlen_k); without them the batched layout
    # [batch, seqlen, heads, dim] (one of the two without the other is not modelled)
    cu_q, cu_k = a.get("cu_seqlens_q"), a.get("cu_seqlens_k")
    batched = cu_q is None and cu_k is None
    if not batched and (cu_q is None or cu_k is None):
        raise NotImplementedError(f"fake FA3 ({build.namespace}): cu_seqlens_q without cu_seqlens_k "
                                  "(or the reverse) is not modelled")
    if not batched:
        _check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
        _check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype torch.int32")
        _check(a.get("max_seqlen_q") is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided")
        _check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
        _check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype torch.int32")
        _check(a.get("max_seqlen_k") is not None, "max_seqlen_k must be provided if cu_seqlens_k is provided")

    # 757-792: sizes and head dims (batched: from q's and k's first two sizes, 758-770)
    if batched:
        batch_size, seqlen_q0 = q.shape[0], q.shape[1]
        total_q = batch_size * seqlen_q0
        seqlen_k0 = k.shape[1]
        total_k = batch_size * seqlen_k0
        batch_size_k = k.shape[0]
    else:
        batch_size = cu_q.shape[0] - 1
        total_q = q.shape[0]
        total_k = k.shape[0]
        batch_size_k = cu_k.shape[0] - 1
    num_heads, head_size = q.shape[-2], q.shape[-1]
    head_size_v = v.shape[-1]
    num_heads_k = k.shape[-2]
    softmax_scale = a.get("softmax_scale")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_size)
    _check(batch_size == batch_size_k, "batch_size must be equal to batch_size_k")
    max_headdim = _max_headdim(flags)
    _check(head_size <= max_headdim, f"FlashAttention forward only supports head dimension at most {max_headdim}")
    _check(num_heads_k > 0 and num_heads % num_heads_k == 0,
           "Number of heads in key/value must divide number of heads in query")
    if head_size_v != head_size:
        _check((128 < head_size <= 192 and 96 < head_size_v <= 128) or (head_size <= 64 and head_size_v <= 512),
               "If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] and V headdim in (96, 128], "
               "or (Q/K <= 64 and V <= 512).")
        if head_size_v > 256:
            _check(q_type in (torch.float16, torch.bfloat16), "HeaddimV > 256 requires fp16 and bf16 data type")
        if build.hdimdiff_checks_in_fwd:
            if _flag(flags, "HDIMDIFF64"):
                _check(head_size > 64, "This flash attention build does not support hdim != hdim_v when hdim <= 64")
            if _flag(flags, "HDIMDIFF192"):
                _check(head_size <= 64, "This flash attention build does not support hdim != hdim_v when hdim in (128, 192]")

    # 795-805: windows; causal is a right window of 0
    if batched:
        seqlen_q, seqlen_k = seqlen_q0, seqlen_k0
    else:
        seqlen_q, seqlen_k = a["max_seqlen_q"], a["max_seqlen_k"]
    left, right = a.get("window_size_left", -1), a.get("window_size_right", -1)
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    is_causal = bool(a.get("is_causal", False))
    if is_causal:
        right = 0
    is_local = (left >= 0 or right >= 0) and not is_causal

    # 807-823: shapes
    if batched:
        _check_shape(q, "q", (batch_size, seqlen_q, num_heads, head_size),
                     "batch_size, seqlen_q, num_heads, head_size")
        _check_shape(k, "k", (batch_size_k, seqlen_k, num_heads_k, head_size),
                     "batch_size_k, seqlen_k, num_heads_k, head_size")
        _check_shape(v, "v", (batch_size_k, seqlen_k, num_heads_k, head_size_v),
                     "batch_size_k, seqlen_k, num_heads_k, head_size_v")
    else:
        _check_shape(q, "q", (total_q, num_heads, head_size), "total_q, num_heads, head_size")
        _check_shape(cu_q, "cu_seqlens_q", (batch_size + 1,), "batch_size + 1")
        _check_shape(k, "k", (total_k, num_heads_k, head_size), "total_k, num_heads_k, head_size")
        _check_shape(v, "v", (total_k, num_heads_k, head_size_v), "total_k, num_heads_k, head_size_v")
        _check_shape(cu_k, "cu_seqlens_k", (batch_size + 1,), "batch_size + 1")

    # 848-856: varlen build flag (is_varlen: offsets given), head-dim alignment
    _check(batched or not _flag(flags, "VARLEN"), "This flash attention build does not support varlen.")
    alignment = 16 if q_type == torch.float8_e4m3fn else 8
    _check(head_size % alignment == 0, f"head_size should be a multiple of {alignment}")
    _check(head_size_v % alignment == 0, f"head_size_v should be a multiple of {alignment}")

    # 858-874: the output
    out_type = torch.bfloat16 if q_type == torch.float8_e4m3fn else q_type
    out = a.get("out")
    if out is not None:
        _check(out.dtype == out_type, "For FP16/BF16 input, output must have the same dtype as inputs. For FP8 input, output must have dtype BF16")
        _check(out.stride(-1) == 1, "Output tensor must have contiguous last dimension")
        if batched:
            _check_shape(out, "out", (batch_size, seqlen_q, num_heads, head_size_v),
                         "batch_size, seqlen_q, num_heads, head_size_v")
        else:
            _check_shape(out, "out", (total_q, num_heads, head_size_v), "total_q, num_heads, head_size_v")
    elif batched:
        out = torch.empty(batch_size, seqlen_q, num_heads, head_size_v, dtype=out_type, device=q.device)
    else:
        out = torch.empty(total_q, num_heads, head_size_v, dtype=out_type, device=q.device)
    # 887-892: lse [batch, heads, seqlen_q] batched, [heads, total_q] varlen
    if batched:
        softmax_lse = torch.empty(batch_size, num_heads, seqlen_q, dtype=torch.float32, device=q.device)
    else:
        softmax_lse = torch.empty(num_heads, total_q, dtype=torch.float32, device=q.device)

    # 987-1011: the scheduler metadata, where the call passes one
    metadata = a.get("scheduler_metadata")
    if metadata is not None:
        chunk = a.get("attention_chunk", 0)
        size = _metadata_size(build, batch=batch_size, max_q=seqlen_q, max_k=seqlen_k,
                              heads=num_heads, heads_k=num_heads_k, d=head_size, dv=head_size_v,
                              e4m3=q_type == torch.float8_e4m3fn, left=a.get("window_size_left", -1),
                              right=a.get("window_size_right", -1), chunk=chunk,
                              is_causal=bool(a.get("is_causal", False)),
                              softcap=float(a.get("softcap", 0.0)) != 0.0,
                              num_splits=a.get("num_splits", 0), sm_margin=a.get("sm_margin", 0))
        call = {
            "batch_size": batch_size, "max_seqlen_q": seqlen_q, "max_seqlen_k": seqlen_k,
            "num_heads": num_heads, "num_heads_k": num_heads_k, "headdim": head_size,
            "headdim_v": head_size_v, "qkv_dtype": q_type, "is_causal": a.get("is_causal", False),
            "window_size_left": a.get("window_size_left", -1),
            "window_size_right": a.get("window_size_right", -1), "attention_chunk": chunk,
            "softcap": float(a.get("softcap", 0.0)) != 0.0, "num_splits": a.get("num_splits", 0),
            "pack_gqa": a.get("pack_gqa"), "sm_margin": a.get("sm_margin", 0),
            "q_lens": _lens(cu_q, batch_size, seqlen_q), "k_lens": _lens(cu_k, batch_size, seqlen_k),
        }
        _check_metadata(build, metadata, q, size, call)

    # 1112-1142: descales, read for fp8 inputs only
    descales = {}
    if q_type == torch.float8_e4m3fn:
        for name in ("q_descale", "k_descale", "v_descale"):
            d = a.get(name)
            if d is not None:
                _check_shape(d, name, (batch_size, num_heads_k), "batch_size, num_heads_k")
                _float_ptr(d)
                descales[name] = d

    # 1148-1165 and run_mha_fwd_ 332/362: what the build compiled out
    _check(not (is_local and _flag(flags, "LOCAL")), "This flash attention build does not support local attention.")
    softcap = float(a.get("softcap", 0.0))
    _check(not (softcap != 0.0 and _flag(flags, "SOFTCAP")), "This flash attention build does not support tanh softcapping.")
    num_splits = a.get("num_splits", 1)
    _check(not (num_splits > 1 and _flag(flags, "SPLIT")), "This flash attention build does not support splits.")

    if batched:
        # the same rows as a varlen batch of equal lengths; TMA's bounds are the tensors' own
        # seqlen dimension, so no tile reads a neighbour's rows (no `_tile_reads`)
        cq = [i * seqlen_q for i in range(batch_size + 1)]
        ck = [i * seqlen_k for i in range(batch_size + 1)]
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    else:
        cq, ck = cu_q.tolist(), cu_k.tolist()
    if total_q > 0 and total_k > 0 and num_heads_k > 0:
        if q_type == torch.float16:
            _check(not _flag(flags, "FP16"), "This flash attention build does not support FP16.")
        if q_type == torch.float8_e4m3fn:
            _check(not _flag(flags, "FP8"), "This flash attention build does not support FP8.")
        o64, lse64 = _attention(q, k, v, cq, ck, descales, softmax_scale, left, right, softcap,
                                build, seqlen_q, seqlen_k, leaks=not batched)
        # rows past cu_seqlens_q[-1] are not written by the kernel; rows of a fake run are all
        # covered (cq[-1] == total_q is the varlen contract; checked in _attention)
        if batched:
            out.copy_(o64.to(out_type).reshape(out.shape))
            softmax_lse.copy_(lse64.to(torch.float32).reshape(batch_size, seqlen_q, num_heads)
                              .transpose(1, 2))
        else:
            out.copy_(o64.to(out_type))
            softmax_lse.copy_(lse64.t().to(torch.float32))
    elif total_q > 0 and num_heads_k > 0:
        # flash_api.cpp 1190-1194: "If seqlen_k == 0, then we have an empty tensor."
        out.zero_()
        softmax_lse.fill_(float("inf"))
    return out, softmax_lse, None, None


def _attention(q, k, v, cq, ck, descales, scale, left, right, softcap, build, seqlen_q, seqlen_k,
               leaks=True):
    """(out float64 [total_q, H, Dv], lse float64 [total_q, H]) from FA3's per-row softmax;
    `leaks`: the varlen tiles' reads past a sequence's end (`_tile_reads`)."""
    total_q, num_heads = q.shape[0], q.shape[1]
    num_heads_k = k.shape[1]
    group = num_heads // num_heads_k
    if cq[-1] != total_q or ck[-1] != k.shape[0] or cq[0] != 0 or ck[0] != 0:
        raise NotImplementedError(
            f"fake FA3 ({build.namespace}): cu_seqlens not spanning q/k exactly "
            f"(cu_seqlens_q {cq[0]}..{cq[-1]} for {total_q} rows, cu_seqlens_k {ck[0]}..{ck[-1]} "
            f"for {k.shape[0]} rows) is not modelled")
    heads_k = torch.arange(num_heads) // group

    def dequant(x, name, b):
        x = x.to(torch.float64)
        d = descales.get(name)
        if d is None:
            return x
        # one descale per (sequence, kv head); q's heads read their kv head's (flash_api.cpp 1116)
        per_head = d[b].to(torch.float64)
        return x * (per_head[heads_k][:, None] if name == "q_descale" else per_head[:, None])

    out = torch.zeros(total_q, num_heads, v.shape[-1], dtype=torch.float64)
    empty = float("inf") if build.legacy_empty_lse else float("-inf")
    lse = torch.full((total_q, num_heads), empty, dtype=torch.float64)
    for b in range(len(cq) - 1):
        q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if q_len > seqlen_q or k_len > seqlen_k:
            raise NotImplementedError(
                f"fake FA3 ({build.namespace}): sequence {b} has {q_len} queries / {k_len} keys, "
                f"more than max_seqlen_q={seqlen_q} / max_seqlen_k={seqlen_k} (the real kernel "
                "tiles by them; not modelled)")
        if q_len == 0:
            continue
        if k_len == 0:  # store_zero (epilogue_fwd.hpp 411-447): 0 and -inf (legacy +inf)
            continue
        qs = dequant(q[cq[b]:cq[b + 1]].cpu(), "q_descale", b)
        ks = dequant(k[ck[b]:ck[b + 1]].cpu(), "k_descale", b)[:, heads_k]
        vs = dequant(v[ck[b]:ck[b + 1]].cpu(), "v_descale", b)[:, heads_k]
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if softcap != 0.0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(q_len)[:, None]
        j = torch.arange(k_len)[None, :]
        diag = i + (k_len - q_len)
        visible = torch.ones(q_len, k_len, dtype=torch.bool)
        if right >= 0:
            visible &= j <= diag + right
        if left >= 0:
            visible &= j >= diag - left
        s = s.masked_fill(~visible, float("-inf"))
        # row max ignores NaN (fmaxf); a max of -inf is taken as 0 (softmax.h 78/118)
        m = torch.where(torch.isnan(s), float("-inf"), s).amax(dim=-1)
        m = torch.where(m == float("-inf"), 0.0, m)
        p = torch.exp(s - m[..., None])
        row_sum = p.sum(dim=-1)
        bad = (row_sum == 0) | torch.isnan(row_sum)  # softmax.h 151
        inv = torch.where(bad, 0.0, 1.0 / torch.where(bad, 1.0, row_sum))
        o = torch.einsum("hij,jhd->ihd", p, vs) * inv.t()[..., None]
        row_lse = torch.where(bad, empty, m + torch.log(torch.where(bad, 1.0, row_sum)))
        if build.tile is not None and leaks:
            o = _tile_reads(o, v, ck[b], q_len, k_len, right, build.tile, lambda x, b=b: dequant(x, "v_descale", b)[:, heads_k])
        out[cq[b]:cq[b + 1]] = o
        lse[cq[b]:cq[b + 1]] = row_lse.t()
    return out.to(q.device), lse.to(q.device)


def _tile_reads(o, v, k_start, q_len, k_len, right, tile, dequant):
    """What FA3's tiles read past a sequence's end: a query tile of kBlockM rows (from the
    sequence start) that visits the sequence's last key block (kBlockN keys from the start)
    multiplies P = 0 by the V rows past the sequence's end that the block covers (the next
    sequence's, read through the packed tensor; zeros past the tensor's end). 0 * finite adds
    nothing; 0 * inf or NaN makes every row of that tile NaN in that head (even rows that see
    no key), while the lse (from the masked scores) is unchanged. Measured on an H200 with
    fa3-fwd 0.0.3, bf16, 192/128 (tests/gpu/test_flash_attn_gpu.py): kBlockM = kBlockN = 128."""
    block_m, block_n = tile
    n_blocks = -(-k_len // block_n)
    if n_blocks * block_n == k_len:
        return o  # the last block ends where the sequence does
    past = v[k_start + k_len : min(k_start + n_blocks * block_n, v.shape[0])]
    if past.shape[0] == 0:
        return o
    leak = (0.0 * dequant(past.cpu())).sum(dim=0)  # [H, Dv]: 0 where finite, NaN where not
    for m in range(0, q_len, block_m):
        # keys the tile's last row may see (window_size_right >= 0: causal is right = 0)
        reach = min(k_len, m + block_m + k_len - q_len + right) if right >= 0 else k_len
        if -(-reach // block_n) == n_blocks and reach > 0:  # this tile visits the last block
            o[m : m + block_m] = o[m : m + block_m] + leak
    return o


def register(build: Build) -> torch.library.Library:
    """Define `build.namespace::fwd` with the build's schema and this body as its CPU kernel.

    With `build.metadata_schema`, also `build.namespace::get_scheduler_metadata` with that
    schema and `scheduler_metadata` as its CPU kernel.
    Idempotent for the same schemas; different ones for a namespace replace the old op."""
    schemas = (build.schema, build.metadata_schema)
    live = _LIBS.get(build.namespace)
    if live is not None:
        if live[1] == schemas:
            return live[0]
        unregister(build.namespace)
    lib = torch.library.Library(build.namespace, "FRAGMENT")
    lib.define(build.schema)
    if build.metadata_schema is not None:
        _register_metadata(lib, build)
    overload = getattr(torch.ops, build.namespace).fwd.default
    arguments = list(overload._schema.arguments)
    as_list = "Tensor[]" in build.schema.split("->")[-1]
    calls = CALLS.setdefault(build.namespace, [])

    def fwd(*args, **kwargs):
        values = _all_values(arguments, args, kwargs, f"fake {build.namespace}::fwd")
        calls.append(values)
        result = forward(build, {arg.name: value for arg, value in zip(arguments, values, strict=True)})
        if as_list:
            out = result[0]
            return [out, result[1], out.new_empty(0, dtype=torch.float32),
                    out.new_empty(0, dtype=torch.float32)]
        return result

    lib.impl("fwd", fwd, "CPU")
    _LIBS[build.namespace] = (lib, schemas)
    return lib


def _all_values(arguments, args, kwargs, who: str) -> list:
    """Every schema argument's value of one call: the positional ones, then by name or the
    schema's default (the dispatcher drops trailing defaults before a CPU kernel sees them)."""
    values = list(args)
    for arg in arguments[len(values):]:
        if arg.name in kwargs:
            values.append(kwargs[arg.name])
        elif arg.has_default_value():
            values.append(arg.default_value)
        else:
            raise TypeError(f"{who}: missing argument {arg.name}")
    return values


def _register_metadata(lib: torch.library.Library, build: Build) -> None:
    lib.define(build.metadata_schema)
    overload = getattr(torch.ops, build.namespace).get_scheduler_metadata.default
    arguments = list(overload._schema.arguments)
    calls = METADATA_CALLS.setdefault(build.namespace, [])

    def get_scheduler_metadata(*args, **kwargs):
        values = _all_values(arguments, args, kwargs,
                             f"fake {build.namespace}::get_scheduler_metadata")
        calls.append(values)
        return scheduler_metadata(build, {arg.name: v for arg, v in zip(arguments, values, strict=True)})

    lib.impl("get_scheduler_metadata", get_scheduler_metadata, "CPU")


def unregister(namespace: str) -> None:
    """Remove a fake build's op (so another schema can be registered under its namespace)."""
    live = _LIBS.pop(namespace, None)
    if live is not None:
        live[0]._destroy()
    CALLS.pop(namespace, None)
    METADATA_CALLS.pop(namespace, None)


def unregister_all() -> None:
    for namespace in list(_LIBS):
        unregister(namespace)
