"""Fused dynamic per-tensor FP8 quantization for the Triton kernel (`core/fp8.py`'s rule).

Two passes over memory, the fewest a dynamic per-tensor scale allows: one launch reads
q, k and v once and leaves their three amax values in a float32 [3] buffer; a second
launch reads k and v again and writes them in fp8, k as `[total_k, H, 192]` and v
transposed to `[H * 128, total_k_pad]` (fp8 tensor-core products on Hopper read their
second operand K-major, so P @ V wants V with tokens contiguous). q is cast inside the
attention kernel, where each query tile is loaded once anyway, so q is never written.

Scales are never copied to the host: every consumer reads the amax buffer and applies
`scale = amax / fp8_max` (1 when amax is 0), then `x_fp8 = (x / scale)` rounded to nearest.

This module imports triton when it is imported; the provider imports it lazily.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the provider reports "triton is not installed"
    triton = None

#: nope + rope widths of the query/key head and the value head width this kernel handles
NOPE, ROPE, DV = 128, 64, 128

if triton is not None:

    NOPE_C = tl.constexpr(NOPE)
    ROPE_C = tl.constexpr(ROPE)
    DV_C = tl.constexpr(DV)

    @triton.jit
    def fp8_scale_from_amax(amax, FP8_MAX: tl.constexpr):
        """scale = amax / fp8 max, or 1 when the tensor is all zeros (core/fp8.py)."""
        return tl.where(amax > 0, amax / FP8_MAX, 1.0)

    @triton.jit
    def _amax_kernel(
        Q, K, V, Amax,
        rows_q, rows_k, heads,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
        BLOCK_R: tl.constexpr,
    ):
        """Amax[i] = max |x| of q (i=0), k (1), v (2); rows are (token, head) pairs."""
        which = tl.program_id(1)
        nprog = tl.num_programs(0)
        # q/k rows are 192 wide (128 + 64), v rows 128: the rope load is masked off for v.
        if which == 0:
            X = Q
            rows = rows_q
            s_t = sq_t
            s_h = sq_h
        elif which == 1:
            X = K
            rows = rows_k
            s_t = sk_t
            s_h = sk_h
        else:
            X = V
            rows = rows_k
            s_t = sv_t
            s_h = sv_h
        has_rope = which < 2
        c_nope = tl.arange(0, NOPE_C)
        c_rope = tl.arange(0, ROPE_C)
        acc_a = tl.zeros([BLOCK_R, NOPE_C], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_R, ROPE_C], dtype=tl.float32)
        num_blocks = tl.cdiv(rows, BLOCK_R)
        for blk in range(tl.program_id(0), num_blocks, nprog):
            r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
            ok = r < rows
            off = (r // heads).to(tl.int64) * s_t + (r % heads).to(tl.int64) * s_h
            a = tl.load(X + off[:, None] + c_nope[None, :], mask=ok[:, None], other=0.0)
            acc_a = tl.maximum(acc_a, tl.abs(a.to(tl.float32)))
            b = tl.load(X + off[:, None] + NOPE_C + c_rope[None, :], mask=ok[:, None] & has_rope, other=0.0)
            acc_b = tl.maximum(acc_b, tl.abs(b.to(tl.float32)))
        amax = tl.maximum(tl.max(tl.max(acc_a, 1), 0), tl.max(tl.max(acc_b, 1), 0))
        tl.atomic_max(Amax + which, amax)

    @triton.jit
    def _cast_kv_kernel(
        K, V, K8, VT8, Amax,
        total_k, heads,
        sk_t, sk_h, sv_t, sv_h, vt_stride,
        FP8_MAX: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """K8[t, h, :] = k / scale_k (contiguous); VT8[h * DV_C + d, t] = v[t, h, d] / scale_v."""
        which = tl.program_id(1)
        nprog = tl.num_programs(0)
        out_ty = K8.dtype.element_ty
        if which == 0:
            scale = fp8_scale_from_amax(tl.load(Amax + 1), FP8_MAX)
            rows = total_k * heads
            c_nope = tl.arange(0, NOPE_C)
            c_rope = tl.arange(0, ROPE_C)
            for blk in range(tl.program_id(0), tl.cdiv(rows, BLOCK_R), nprog):
                r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
                ok = r < rows
                src = K + ((r // heads).to(tl.int64) * sk_t + (r % heads).to(tl.int64) * sk_h)[:, None]
                dst = K8 + (r.to(tl.int64) * (NOPE_C + ROPE_C))[:, None]
                a = tl.load(src + c_nope[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                a = tl.clamp(tl.math.div_rn(a, scale), -FP8_MAX, FP8_MAX)
                tl.store(dst + c_nope[None, :], a.to(out_ty), mask=ok[:, None])
                b = tl.load(src + NOPE_C + c_rope[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                b = tl.clamp(tl.math.div_rn(b, scale), -FP8_MAX, FP8_MAX)
                tl.store(dst + NOPE_C + c_rope[None, :], b.to(out_ty), mask=ok[:, None])
        else:
            scale = fp8_scale_from_amax(tl.load(Amax + 2), FP8_MAX)
            c = tl.arange(0, DV_C)
            t_blocks = tl.cdiv(total_k, BLOCK_T)
            for tile in range(tl.program_id(0), t_blocks * heads, nprog):
                h = tile % heads
                t = (tile // heads) * BLOCK_T + tl.arange(0, BLOCK_T)
                ok = t < total_k
                x = tl.load(
                    V + t.to(tl.int64)[:, None] * sv_t + h.to(tl.int64) * sv_h + c[None, :],
                    mask=ok[:, None], other=0.0,
                ).to(tl.float32)
                x = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
                # tokens are the contiguous dim of VT8: the compiler transposes through shared memory
                dst = VT8 + (h * DV_C + c).to(tl.int64)[None, :] * vt_stride + t[:, None]
                tl.store(dst, x.to(out_ty), mask=ok[:, None])


#: warps every quantization kernel launches with
NUM_WARPS = 4

#: (kernel, pointer argument types, constexprs) of every launch below, for tests/compile
#: ("FP8" stands for the arch's fp8 type, "FP8_MAX" for its largest finite value)
COMPILE_SPECS = [
    ("_amax_kernel", {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Amax": "*fp32"}, {"BLOCK_R": 32}),
    ("_cast_kv_kernel", {"K": "*bf16", "V": "*bf16", "K8": "*FP8", "VT8": "*FP8", "Amax": "*fp32"},
     {"FP8_MAX": "FP8_MAX", "BLOCK_R": 32, "BLOCK_T": 64}),
]


def _grid_programs(work_blocks: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    return max(1, min(work_blocks, sms * 4))


def amax_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 [3]: amax of |q|, |k|, |v| (q/k: [T, H, 192], v: [T, H, 128], unit last stride)."""
    amax = torch.zeros(3, dtype=torch.float32, device=q.device)
    heads = q.shape[1]
    rows = max(q.shape[0], k.shape[0]) * heads
    if rows == 0:
        return amax
    block_r = 32
    grid = (_grid_programs(triton.cdiv(rows, block_r), q.device), 3)
    _amax_kernel[grid](
        q, k, v, amax,
        q.shape[0] * heads, k.shape[0] * heads, heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BLOCK_R=block_r, num_warps=4,
    )
    return amax


def vt_padded_len(total_k: int) -> int:
    """Row length of the transposed fp8 V: tokens padded to 16 bytes (TMA stride alignment)."""
    return max(16, (total_k + 15) // 16 * 16)


def cast_kv(
    k: torch.Tensor, v: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k8 [T, H, 192] contiguous, vt8 [H * 128, T_pad]) in `fp8_dtype`; vt8[:, T:] is never read."""
    total_k, heads = k.shape[0], k.shape[1]
    k8 = torch.empty((total_k, heads, NOPE_C + ROPE_C), dtype=fp8_dtype, device=k.device)
    t_pad = vt_padded_len(total_k)
    vt8 = torch.empty((heads * DV_C, t_pad), dtype=fp8_dtype, device=k.device)
    if total_k == 0:
        return k8, vt8
    block_r, block_t = 32, 64
    blocks = max(triton.cdiv(total_k * heads, block_r), triton.cdiv(total_k, block_t) * heads)
    grid = (_grid_programs(blocks, k.device), 2)
    _cast_kv_kernel[grid](
        k, v, k8, vt8, amax,
        total_k, heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), t_pad,
        FP8_MAX=float(torch.finfo(fp8_dtype).max), BLOCK_R=block_r, BLOCK_T=block_t, num_warps=4,
    )
    return k8, vt8
