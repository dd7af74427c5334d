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

What the real kernel adds and this body does not model: it runs on Hopper GPUs only
(`CHECK_DEVICE`: "q must be on CUDA", sm_90 for fp8 and for different V head dims); tile
scheduling (128-row query tiles, the persistent/LPT scheduler, `scheduler_metadata`, split-KV
with its combine kernel, PackGQA); float32 accumulation, and in fp8 the e4m3 rounding of P
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
from dataclasses import dataclass, field

import torch

#: namespace -> every call's argument list (schema order, defaults filled in)
CALLS: dict[str, list[list]] = {}
#: namespace -> the live torch.library.Library of a fake build
_LIBS: dict[str, tuple[torch.library.Library, str]] = {}


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
                "seqlens_rotary", "scheduler_metadata", "s_aux", "sinks", "sparse_mask_fine",
                "cp_tot_seqused_k")


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

    # 739-755: varlen offsets
    cu_q, cu_k = a.get("cu_seqlens_q"), a.get("cu_seqlens_k")
    if cu_q is None or cu_k is None:
        raise NotImplementedError(f"fake FA3 ({build.namespace}): the batched (non-varlen) layout is not modelled")
    _check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype torch.int32")
    _check(a.get("max_seqlen_q") is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided")
    _check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype torch.int32")
    _check(a.get("max_seqlen_k") is not None, "max_seqlen_k must be provided if cu_seqlens_k is provided")

    # 757-792: sizes and head dims
    batch_size = cu_q.shape[0] - 1
    total_q, num_heads, head_size = q.shape[0], q.shape[-2], q.shape[-1]
    head_size_v = v.shape[-1]
    total_k, num_heads_k = k.shape[0], k.shape[-2]
    batch_size_k = cu_k.shape[0] - 1
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

    # 809-823: shapes
    _check_shape(q, "q", (total_q, num_heads, head_size), "total_q, num_heads, head_size")
    _check_shape(cu_q, "cu_seqlens_q", (batch_size + 1,), "batch_size + 1")
    _check_shape(k, "k", (total_k, num_heads_k, head_size), "total_k, num_heads_k, head_size")
    _check_shape(v, "v", (total_k, num_heads_k, head_size_v), "total_k, num_heads_k, head_size_v")
    _check_shape(cu_k, "cu_seqlens_k", (batch_size + 1,), "batch_size + 1")

    # 848-856: varlen build flag, head-dim alignment
    _check(not _flag(flags, "VARLEN"), "This flash attention build does not support varlen.")
    alignment = 16 if q_type == torch.float8_e4m3fn else 8
    _check(head_size % alignment == 0, f"head_size should be a multiple of {alignment}")
    _check(head_size_v % alignment == 0, f"head_size_v should be a multiple of {alignment}")

    # 858-874: the output
    out_type = torch.bfloat16 if q_type == torch.float8_e4m3fn else q_type
    out = a.get("out")
    if out is not None:
        _check(out.dtype == out_type, "For FP16/BF16 input, output must have the same dtype as inputs. For FP8 input, output must have dtype BF16")
        _check(out.stride(-1) == 1, "Output tensor must have contiguous last dimension")
        _check_shape(out, "out", (total_q, num_heads, head_size_v), "total_q, num_heads, head_size_v")
    else:
        out = torch.empty(total_q, num_heads, head_size_v, dtype=out_type, device=q.device)
    softmax_lse = torch.empty(num_heads, total_q, dtype=torch.float32, device=q.device)

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

    cq, ck = cu_q.tolist(), cu_k.tolist()
    if total_q > 0 and total_k > 0 and num_heads_k > 0:
        if q_type == torch.float16:
            _check(not _flag(flags, "FP16"), "This flash attention build does not support FP16.")
        if q_type == torch.float8_e4m3fn:
            _check(not _flag(flags, "FP8"), "This flash attention build does not support FP8.")
        o64, lse64 = _attention(q, k, v, cq, ck, descales, softmax_scale, left, right, softcap,
                                build, seqlen_q, seqlen_k)
        # rows past cu_seqlens_q[-1] are not written by the kernel; rows of a fake run are all
        # covered (cq[-1] == total_q is the varlen contract; checked in _attention)
        out.copy_(o64.to(out_type))
        softmax_lse.copy_(lse64.t().to(torch.float32))
    elif total_q > 0 and num_heads_k > 0:
        # flash_api.cpp 1190-1194: "If seqlen_k == 0, then we have an empty tensor."
        out.zero_()
        softmax_lse.fill_(float("inf"))
    return out, softmax_lse, None, None


def _attention(q, k, v, cq, ck, descales, scale, left, right, softcap, build, seqlen_q, seqlen_k):
    """(out float64 [total_q, H, Dv], lse float64 [total_q, H]) from FA3's per-row softmax."""
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
        if build.tile is not None:
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

    Idempotent for the same schema; a different schema for a namespace replaces the old one."""
    live = _LIBS.get(build.namespace)
    if live is not None:
        if live[1] == build.schema:
            return live[0]
        unregister(build.namespace)
    lib = torch.library.Library(build.namespace, "FRAGMENT")
    lib.define(build.schema)
    overload = getattr(torch.ops, build.namespace).fwd.default
    arguments = list(overload._schema.arguments)
    as_list = "Tensor[]" in build.schema.split("->")[-1]
    calls = CALLS.setdefault(build.namespace, [])

    def fwd(*args, **kwargs):
        values = list(args)
        for arg in arguments[len(values):]:  # the dispatcher drops trailing defaults
            if arg.name in kwargs:
                values.append(kwargs[arg.name])
            elif arg.has_default_value():
                values.append(arg.default_value)
            else:
                raise TypeError(f"fake {build.namespace}::fwd: missing argument {arg.name}")
        calls.append(values)
        result = forward(build, {arg.name: value for arg, value in zip(arguments, values, strict=True)})
        if as_list:
            out = result[0]
            return [out, result[1], out.new_empty(0, dtype=torch.float32),
                    out.new_empty(0, dtype=torch.float32)]
        return result

    lib.impl("fwd", fwd, "CPU")
    _LIBS[build.namespace] = (lib, build.schema)
    return lib


def unregister(namespace: str) -> None:
    """Remove a fake build's op (so another schema can be registered under its namespace)."""
    live = _LIBS.pop(namespace, None)
    if live is not None:
        live[0]._destroy()
    CALLS.pop(namespace, None)


def unregister_all() -> None:
    for namespace in list(_LIBS):
        unregister(namespace)
