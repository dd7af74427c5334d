"""Block-scaled FP8 quantization of k and v in one pass (`core/fp8.py`'s block rule).

One program per (128-key block of a sequence, sequence, head; or a few heads in turn) loads
its bf16 k [128, 192] and v [128, 128] once, takes the NaN-aware amax in registers and
writes the fp8 values and the two scales: one read of bf16, one write of fp8, no separate
amax pass over the tensors. Its instructions per element, not its bytes, kept it at half the
copy bandwidth (~33 SASS instructions per element with an IEEE division each: 2.1 TB/s
against 4.2 on the H200), so the amax is an integer max of bit patterns (`abs_bits`) and the
cast a multiply by the correctly rounded reciprocal (~14 per element). v is transposed in
registers and stored as [128, 128] tiles whose rows (128 tokens) start at 16-aligned
columns, in 16-byte vectors. q is quantized inside the attention kernel (one scale per
64-row query block and head, from the tile it loads anyway), so q is never written.

Layouts written:
- k8 [T, H, 192]: the rows of k;
- vt8 [H * 128, T_pad], v transposed (fp8 tensor-core products on Hopper read their second
  operand K-major, so P @ V wants tokens contiguous). Token t of sequence b sits in column
  `t - ck[b] % 16 + 16 * b` (`vt_column`; within its 16-group reordered by `column_of_key`
  where `permuted_v`, below): every sequence starts 16-aligned, which TMA
  loads of fp8 need on the H200 (an unaligned start faults), and every key block
  starts 16-aligned too. The columns between sequences are written as zeros;
- scales [2, H, T_pad / 16] float32 (k, then v): the scale of head h's block whose first
  column is c sits at [., h, c / 16].

Key order within vt8's 16-column groups (`permuted_v`, CUDA): key x of a group sits in
column `column_of_key(x)`, a fixed permutation of the group chosen so that P, as the
tensor cores leave it (the fp32 accumulator layout), is already in the layout P @ V reads
its fp8 A operand in (k_width 4) with its keys in that same order (`in_v_order`): the
conversion between the two stays in each thread (byte permutes), with no shuffles between
threads. Measured on the H200 (Gluon kernel, ncu): the shuffled conversion took ~200 of
its ~700 instructions per key block. P @ V sums over keys, so any order of keys taken by
both P and V gives the same product. On ROCm the order is the natural one.

Stored fp8 values are always finite (NaN -> 0, see core/fp8.py): a masked read of a
neighbour's values multiplies zeros; a block's NaN/inf travels in its scale.

This module imports triton when it is imported; the provider imports it lazily.
"""

from __future__ import annotations

import torch

from ..fp8 import KV_BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the provider reports "triton is not installed"
    triton = None

#: nope + rope widths of the query/key head and the value head width this kernel handles
NOPE, ROPE, DV = 128, 64, 128
#: keys per k/v scale block (core/fp8.py's KV_BLOCK)
SCALE_BLOCK = KV_BLOCK
#: warps every quantization kernel launches with
NUM_WARPS = 16
#: heads one quantization program handles in turn (the largest divisor of H up to this);
#: with 4 warps or 2 heads the sm_90 build spills when strides are not known 16-divisible
HEADS_PER_PROGRAM = 1
#: sweeps over halves of a key block (1: the block held at once; see _quant_kv_kernel)
PARTS = 2

if triton is not None:

    NOPE_C = tl.constexpr(NOPE)
    ROPE_C = tl.constexpr(ROPE)
    DV_C = tl.constexpr(DV)
    SCALE_BLOCK_C = tl.constexpr(SCALE_BLOCK)

    @triton.jit
    def max_nan(a, b):
        return tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))

    @triton.jit
    def abs_bits(x):
        """|x| of a 16-bit float tile as int16 bit patterns (sign cleared): they order as the
        values do, with every NaN above inf, so an integer max is a NaN-propagating amax."""
        return x.to(tl.int16, bitcast=True) & 0x7FFF

    # tl.max's own combine, in a reduce of our own: tl.max would widen int16 to int32 first
    # (and Triton's interpreter runs this combine through numpy, any other element by element)
    _imax = tl.standard._elementwise_max

    @triton.jit
    def amax_of_bits(b, dtype: tl.constexpr):
        """The largest of a tile of `abs_bits`, as a value of the 16-bit float `dtype`."""
        return tl.reduce(tl.reduce(b, 1, _imax), 0, _imax).to(dtype, bitcast=True)

    @triton.jit
    def nan_aware_amax(x):
        """max |x| over a 2D tile of bf16/fp16; NaN if any element is NaN (max alone drops
        it). Integer max of the bit patterns: two instructions per element, exact."""
        return amax_of_bits(abs_bits(x), x.dtype)

    @triton.jit
    def scale_from_amax(amax, FP8_MAX: tl.constexpr):
        """amax / fp8 max; 1 for an all-zero block; NaN and inf stay (core/fp8.py)."""
        # IEEE division (Triton's `/` on fp32 is approximate on CUDA): the same scale bits
        # as torch's amax / fp8_max
        return tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)))

    @triton.jit
    def reciprocal(scale):
        """1 / scale, correctly rounded: the factor core/fp8.py's rule multiplies by."""
        return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)

    @triton.jit
    def to_fp8(x, inv, FP8_MAX: tl.constexpr, out_ty: tl.constexpr):
        """x * (1 / scale), NaN -> 0, clamped, cast (core/fp8.py): a multiply per element,
        not a division (an IEEE division is ~10 instructions, most of this kernel's work)."""
        y = x.to(tl.float32) * inv
        y = tl.where(y != y, 0.0, y)
        return tl.clamp(y, -FP8_MAX, FP8_MAX).to(out_ty)

    @triton.jit
    def key_of_column(c):
        """The key (offset in its 16-group) that vt8's column c holds when `permuted_v`: the
        inverse of `column_of_key` (bits 3 2 1 0 of c are bits 2 1 3 0 of the key)."""
        return (c & ~15) | ((c & 2) << 2) | ((c & 12) >> 1) | (c & 1)

    @triton.jit
    def in_v_order(p, BLOCK_N: tl.constexpr):
        """p [rows, BLOCK_N] (keys in order) with its columns in vt8's permuted key order:
        column c holds key `key_of_column(c)`. Written as a reshape, a transpose of bits and
        a reshape back, which on NVIDIA leaves every value in its thread (module doc)."""
        rows: tl.constexpr = p.shape[0]
        p6 = tl.reshape(p, [rows, BLOCK_N // 16, 2, 2, 2, 2])
        return tl.reshape(tl.permute(p6, (0, 1, 3, 4, 2, 5)), [rows, BLOCK_N])

    @triton.jit
    def _load_k_rows(src, k_off, ok):
        """k rows of one head (nope, rope) in the input dtype: [rows, 128], [rows, 64]."""
        kn = tl.load(src + k_off + tl.arange(0, NOPE_C)[None, :], mask=ok, other=0.0)
        kr = tl.load(src + NOPE_C + k_off + tl.arange(0, ROPE_C)[None, :], mask=ok, other=0.0)
        return kn, kr

    # ss_w (the scale rows' length) follows the batch: not specialized, one variant per model
    @triton.jit(do_not_specialize=["ss_w"])
    def _quant_kv_kernel(
        K, V, K8, VT8, Scales, CuK,
        sk_t, sk_h, sv_t, sv_h, vt_stride, ss_w, heads,
        FP8_MAX: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, PARTS: tl.constexpr,
        PERMUTED: tl.constexpr,
    ):
        """Grid (key blocks of the longest sequence, sequences, heads / HEADS_PER_PROGRAM).

        PERMUTED: vt8's columns in `key_of_column` order (the v rows are loaded in that
        order, so the transposed store stays contiguous).

        PARTS = 1: the block's rows are loaded once, held, cast. PARTS = 2: two sweeps over
        halves of the block, the first for the amax, the second (from L2) to cast, so a
        program holds half the rows (fewer registers, more programs per SM).
        """
        j = tl.program_id(0)
        b = tl.program_id(1)
        g = tl.program_id(2)
        k0 = tl.load(CuK + b)
        k1 = tl.load(CuK + b + 1)
        r0 = k0 + j * SCALE_BLOCK_C
        if (r0 < k1) | ((j == 0) & (k0 == k1)):
            out_ty = K8.dtype.element_ty
            SUB: tl.constexpr = SCALE_BLOCK_C // PARTS
            c_nope = tl.arange(0, NOPE_C)
            c_rope = tl.arange(0, ROPE_C)
            c_v = tl.arange(0, DV_C)
            t = tl.arange(0, SUB)
            # the v row each column of the transposed tile takes
            tv = key_of_column(t) if PERMUTED else t
            # the block's first vt8 column and the next sequence's first column are both
            # multiples of 16 (vt_column); telling the compiler so lets the transposed store
            # write 16-byte vectors with a mask that is constant over each vector
            col0 = tl.multiple_of(k0 - k0 % 16 + 16 * b + j * SCALE_BLOCK_C, 16)
            next_start = tl.multiple_of(k1 - k1 % 16 + 16 * (b + 1), 16)
            vt_stride = tl.multiple_of(vt_stride, 16)
            last = r0 + SCALE_BLOCK_C >= k1
            # scalar 64-bit bases, 32-bit offset tiles: fewer address registers
            k_off = t[:, None] * sk_t
            k8_off = t[:, None] * (heads * (NOPE_C + ROPE_C))
            v_off = tv[:, None] * sv_t + c_v[None, :]
            vt_off = c_v[:, None] * vt_stride + t[None, :]
            for hh in tl.range(0, HEADS_PER_PROGRAM, num_stages=1):
                h = g * HEADS_PER_PROGRAM + hh
                src = K + h.to(tl.int64) * sk_h + r0.to(tl.int64) * sk_t
                vsrc = V + h.to(tl.int64) * sv_h + r0.to(tl.int64) * sv_t
                dst = K8 + (r0.to(tl.int64) * heads + h) * (NOPE_C + ROPE_C)
                vrow = VT8 + (h * DV_C).to(tl.int64) * vt_stride + col0
                # values stay in the input dtype until the cast: the amax is exact there (a
                # max of bf16/fp16 values is one of them) and they take half the registers
                if PARTS == 1:
                    ok = (t < k1 - r0)[:, None]
                    kn, kr = _load_k_rows(src, k_off, ok)
                    x = tl.load(vsrc + v_off, mask=(tv < k1 - r0)[:, None], other=0.0)
                    s_k = scale_from_amax(
                        max_nan(nan_aware_amax(kn), nan_aware_amax(kr)).to(tl.float32), FP8_MAX)
                    s_v = scale_from_amax(nan_aware_amax(x).to(tl.float32), FP8_MAX)
                    inv_k = reciprocal(s_k)
                    tl.store(dst + k8_off + c_nope[None, :], to_fp8(kn, inv_k, FP8_MAX, out_ty),
                             mask=ok)
                    tl.store(dst + NOPE_C + k8_off + c_rope[None, :],
                             to_fp8(kr, inv_k, FP8_MAX, out_ty), mask=ok)
                    # v transposed in registers: [128 features, SUB tokens], tokens contiguous;
                    # columns past the sequence's end get the masked loads' zeros (the gap up
                    # to the next sequence's first column); the next sequence's are left alone
                    tl.store(vrow + vt_off, tl.trans(to_fp8(x, reciprocal(s_v), FP8_MAX, out_ty)),
                             mask=(t < next_start - col0)[None, :])
                else:
                    # sweep 1: each part's per-row maxima (within a warp: no barrier between
                    # the parts' loads), merged row by row, then one reduction per tile
                    ok = (t < k1 - r0)[:, None]
                    kn, kr = _load_k_rows(src, k_off, ok)
                    m_kn = tl.reduce(abs_bits(kn), 1, _imax)
                    m_kr = tl.reduce(abs_bits(kr), 1, _imax)
                    ok_v = (tv < k1 - r0)[:, None]
                    m_v = tl.reduce(abs_bits(tl.load(vsrc + v_off, mask=ok_v, other=0.0)), 1, _imax)
                    for p in tl.static_range(1, PARTS):
                        ok = (t < k1 - r0 - p * SUB)[:, None]
                        kn, kr = _load_k_rows(src + p * SUB * sk_t, k_off, ok)
                        m_kn = tl.maximum(m_kn, tl.reduce(abs_bits(kn), 1, _imax))
                        m_kr = tl.maximum(m_kr, tl.reduce(abs_bits(kr), 1, _imax))
                        ok_v = (tv < k1 - r0 - p * SUB)[:, None]
                        x = tl.load(vsrc + p * SUB * sv_t + v_off, mask=ok_v, other=0.0)
                        m_v = tl.maximum(m_v, tl.reduce(abs_bits(x), 1, _imax))
                    in_ty = K.dtype.element_ty
                    a_kn = tl.reduce(m_kn, 0, _imax).to(in_ty, bitcast=True)
                    a_kr = tl.reduce(m_kr, 0, _imax).to(in_ty, bitcast=True)
                    s_k = scale_from_amax(max_nan(a_kn, a_kr).to(tl.float32), FP8_MAX)
                    s_v = scale_from_amax(tl.reduce(m_v, 0, _imax).to(in_ty, bitcast=True).to(
                        tl.float32), FP8_MAX)
                    inv_k = reciprocal(s_k)
                    inv_v = reciprocal(s_v)
                    # sweep 2: the block again (from L2), cast
                    for p in tl.static_range(PARTS):
                        ok = (t < k1 - r0 - p * SUB)[:, None]
                        kn, kr = _load_k_rows(src + p * SUB * sk_t, k_off, ok)
                        d = dst + p * SUB * heads * (NOPE_C + ROPE_C)
                        tl.store(d + k8_off + c_nope[None, :], to_fp8(kn, inv_k, FP8_MAX, out_ty),
                                 mask=ok)
                        tl.store(d + NOPE_C + k8_off + c_rope[None, :],
                                 to_fp8(kr, inv_k, FP8_MAX, out_ty), mask=ok)
                        ok_v = (tv < k1 - r0 - p * SUB)[:, None]
                        x = tl.load(vsrc + p * SUB * sv_t + v_off, mask=ok_v, other=0.0)
                        tl.store(vrow + p * SUB + vt_off, tl.trans(to_fp8(x, inv_v, FP8_MAX, out_ty)),
                                 mask=(t + p * SUB < next_start - col0)[None, :])
                if last:
                    # the gap can reach 16 columns past the block (it is < 32 columns long)
                    tail = SCALE_BLOCK_C + tl.arange(0, 16)
                    zeros = tl.zeros([DV_C, 16], dtype=tl.float32).to(out_ty)
                    tl.store(vrow + c_v[:, None] * vt_stride + tail[None, :], zeros,
                             mask=(tail < next_start - col0)[None, :])
                if r0 < k1:
                    sidx = col0 // 16
                    tl.store(Scales + h * (vt_stride // 16) + sidx, s_k)
                    tl.store(Scales + ss_w + h * (vt_stride // 16) + sidx, s_v)


def permuted_v(device: torch.device) -> bool:
    """Whether vt8 holds its keys in `key_of_column` order on this device: everywhere but
    ROCm (whose matrix-core layouts differ), the interpreter included, where tests check it."""
    return not (device.type == "cuda" and torch.version.hip)


def column_of_key(x):
    """Column offset (in its 16-group) of key offset x in vt8 when `permuted_v`: bits
    3 2 1 0 of x go to bits 1 3 2 0 (ints or integer tensors)."""
    return (x & ~15) | ((x & 6) << 1) | ((x & 8) >> 2) | (x & 1)


def vt_column(seq_start: int, seq_index: int, offset, permuted: bool):
    """vt8's column of the key `offset` keys into sequence `seq_index`, which starts at token
    `seq_start` (ints, or an integer tensor of offsets): the sequence's 16-aligned first
    column, plus `column_of_key(offset)` when `permuted` (module doc)."""
    return seq_start - seq_start % 16 + 16 * seq_index + (column_of_key(offset) if permuted else offset)


def vt_columns(total_k: int, batch: int) -> int:
    """Columns of vt8 that hold data or inter-sequence zeros (a bound on `vt_column` + 1)."""
    return total_k - total_k % 16 + 16 * batch


def vt_padded_len(total_k: int, batch: int) -> int:
    """Row length of the transposed fp8 V (a multiple of 16 bytes: TMA stride alignment)."""
    return max(16, vt_columns(total_k, batch) + 16)


def quantize_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    batch: int,
    max_seqlen_k: int,
    fp8_dtype: torch.dtype,
    fp8_max: float | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    heads_per_program: int = HEADS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
    parts: int = PARTS,
    permuted: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k8 [T, H, 192], vt8 [H * 128, T_pad], scales float32 [2, H, T_pad / 16]).

    `out`: those three buffers to write into (the workspace's), else they are allocated.

    `cu_seqlens_k` int32 on k's device; `batch` and `max_seqlen_k` from the host (the plan),
    so nothing is read back from the device. `fp8_max` overrides the format's largest
    value (tests run the fp8 logic with fp16 storage in Triton's interpreter).
    `heads_per_program`, `num_warps` and `parts` are tuning knobs; the outputs do not
    depend on them. `permuted`: vt8's key order (module doc), `permuted_v(k.device)` by
    default, which is what the attention kernels read.
    """
    total_k, heads = k.shape[0], k.shape[1]
    t_pad = vt_padded_len(total_k, batch)
    if out is not None:
        k8, vt8, scales = out
    else:
        k8 = torch.empty((total_k, heads, NOPE + ROPE), dtype=fp8_dtype, device=k.device)
        vt8 = torch.empty((heads * DV, t_pad), dtype=fp8_dtype, device=k.device)
        scales = torch.empty((2, heads, t_pad // 16), dtype=torch.float32, device=k.device)
    if total_k == 0 or batch == 0:
        return k8, vt8, scales
    limit = fp8_max if fp8_max is not None else float(torch.finfo(fp8_dtype).max)
    # at least one block per sequence: an empty one still writes its zero columns
    hpp = max(d for d in range(1, max(1, heads_per_program) + 1) if heads % d == 0)
    grid = (max(1, triton.cdiv(max_seqlen_k, SCALE_BLOCK)), batch, heads // hpp)
    _quant_kv_kernel[grid](
        k, v, k8, vt8, scales, cu_seqlens_k,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), t_pad, scales.stride(0), heads,
        FP8_MAX=limit, HEADS_PER_PROGRAM=hpp, PARTS=parts,
        PERMUTED=permuted_v(k.device) if permuted is None else permuted, num_warps=num_warps,
    )
    return k8, vt8, scales
