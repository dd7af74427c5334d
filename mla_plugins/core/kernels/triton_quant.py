"""Block-scaled FP8 quantization of q, k and v in one launch (`core/fp8.py`'s block rule).

One program per (128-key block of a sequence, sequence, head; or a few heads in turn) loads
its bf16 k [128, 192] and v [128, 128], takes the NaN-aware amax in registers and writes the
fp8 values and the two scales; one program per (64-row q block, sequence, head) does the
same for q with its own scale. The grid's first axis holds the key blocks of the longest
sequence, then the q blocks of the longest query sequence: one launch for the three
tensors (a serving call is replayed launch by launch, ~3-5 us of host time each). Its
instructions per element, not its bytes, kept the k/v part at half the copy bandwidth
(~33 SASS instructions per element with an IEEE division each: 2.1 TB/s against 4.2 on the
H200), so the amax is an integer max of bit patterns (`abs_bits`) and the cast a multiply
by the correctly rounded reciprocal (~14 per element). v is transposed in registers and
stored as [128, 128] tiles whose rows (128 tokens) start at 16-aligned columns, in 16-byte
vectors.

Rotation (`ROTATE`, core/fp8.py): q and k are multiplied by the ±1 matrix M
(`fp8.rotation_pm1`, a [192, 192] device tensor in the input dtype, `rotation_operand`) on
the tensor cores, four products per row block for the 128 + 64 split of the head (nope
and rope rows of M into nope and rope columns, float32 accumulation), then scaled by
ROTATION_SCALE / scale. The scale of a block is its `l1_bound` (the largest sum_j |x_j| of
its rows, in float32, times ROTATION_SCALE), known from the unrotated input, so the scale
comes before the product as in the amax rule. v is never rotated. The two products that
add into one output are scaled and added (y = (xn @ M_n.) c + (xr @ M_r.) c, an FMUL and an
FFMA per element, the FMUL the amax rule's cast does anyway) instead of chained through
the accumulator: Triton puts every warp of a chained product along its rows, so a 64-row
product at 16 warps would be computed four times over (seen in the ttgir).

Rotation by its Kronecker structure (`rotation="kron"`, the KRON constexpr; "dense", the
above, stays the default: timed on the H200, neither is faster everywhere, see ROTATIONS):
M = diag(signs) (H12 ⊗ H16), so per row (x M)[16 c + d] = sum_a H12[a, c] sum_b xs[16 a + b] H16[b, d] with xs = x * signs.
The rows are loaded again (after the scale, which both variants take from the same `l1_bits`
of the same loads) as Kronecker tiles [rows, 16, 16] (`kron_offsets`: [r, b, a] is feature
16 a + b, groups 12 ... 15 masked to zeros), KRON_ROWS rows at a time, signs applied as a
sign-bit xor, then two batched products of 16 x 16 tiles per row (`kron_to_fp8`): H16^T
times the tile (input dtype, exact operands), then that float32 result, scaled by
ROTATION_SCALE / scale and split into two fp16 parts, times H12 (zero-padded to 16 x 16),
the first product's accumulator converted to the second's A operand (in registers: the
shared memory the variant allocates is stage 1's staging of the tile and, in the k/v
programs, v's transpose). Operands: [3, 16, 16] (`kron_operand`, 1.5 KB), no M in shared
memory. In the k/v programs v's parts are cast first and k's rows after, so the rotation's
registers never add to v's. Ahead-of-time compile (tests/compile/aot.py), sm_90: 60
registers, 16 KB of shared memory, 2 CTAs per SM, against the dense variant's 97, 96 KB,
1 CTA; gfx942/gfx950 at 16 warps: 56/55 VGPRs, 8 waves per SIMD, against 248 at 8 warps,
2 waves.

Layouts written:
- q8 [Tq, H, 192]: the rows of q (rotated with ROTATE); q scales [Tq, H] float32: the
  scale of each row's 64-row block, written at every row of the block (fp8.block_scales'
  layout), so the attention reads the scale of its tile's block at the tile's first row;
- k8 [T, H, 192]: the rows of k (rotated with ROTATE);
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

The per-(sequence, head) rule of the FlashAttention-3 provider is `triton_heads`, built
from this module's helpers. This module imports triton when it is imported; the provider
imports it lazily.
"""

from __future__ import annotations

import torch

from ..fp8 import (
    KV_BLOCK,
    OUTLIER_FEATURES,
    OUTLIER_WIDTH,
    Q_BLOCK,
    ROTATION_DIM,
    ROTATION_SCALE,
    ROTATION_SIGNS,
    rotation_pm1,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the provider reports "triton is not installed"
    triton = None

#: nope + rope widths of the query/key head and the value head width this kernel handles
NOPE, ROPE, DV = 128, 64, 128
#: keys per k/v scale block (core/fp8.py's KV_BLOCK), rows per q scale block (Q_BLOCK)
SCALE_BLOCK = KV_BLOCK
QBLOCK = Q_BLOCK
#: warps the quantization kernels launch with (`quant_warps`): 16; 8 for the rotated
#: variant on ROCm, whose products read both operands from registers (16 waves of 64 lanes
#: leave 128 VGPRs a lane: the rotated kernel spilled ~400 there; 8: 248 / 232, no spill)
NUM_WARPS = 16
NUM_WARPS_ROTATED_ROCM = 8
#: heads one quantization program handles in turn (the largest divisor of H up to this);
#: with 4 warps or 2 heads the sm_90 build spills when strides are not known 16-divisible
HEADS_PER_PROGRAM = 1
#: sweeps over halves of a key block (1: the block held at once; see _kv_block)
PARTS = 2
#: 128-key blocks one k/v program quantizes in turn (`quantize_qkv`' `kv_blocks`): with more
#: than 1 the rotation's operands are loaded once per program, not once per block and head.
#: Measured on the H200 (benchmarks/NOTES.md, stop 27): unrotated, 2 and 4 lose 25-30%
#: (3.20 -> 2.29 TB/s at B1-S8192-H128); with the dense rotation, 4 blocks and 8 q blocks a
#: program take q/k/v from 1.32-1.33 to 1.47 TB/s at the H128 shapes (+6% at B1-S16384-H16,
#: -1% at B16-S512-H16), and lose where the grid gets too small to fill the GPU (B1-S1024-H16:
#: 64 programs), so `rotated_qkv_blocks` takes them only with QKV_PROGRAMS_PER_SM programs an SM
KV_BLOCKS = 1
#: 64-row q blocks one program quantizes in turn; with ROTATE each program first fills
#: shared memory with M (72 KB from L2), which more blocks per program amortize
Q_BLOCKS = 1
Q_BLOCKS_ROTATED = 2
#: (kv_blocks, q_blocks) of the dense rotation when its grid still fills the GPU (measured:
#: 4 and 8); else (KV_BLOCKS, Q_BLOCKS_ROTATED), the earlier default. Two variants at most, so a
#: model's batches compile the q/k/v kernel at most twice (tests/compile, one variant per model)
ROTATED_QKV_BLOCKS = (4, 8)
QKV_PROGRAMS_PER_SM = 4
#: the rotation's implementations (`rotation=`): "dense", x @ M as four products of M's
#: blocks (M in shared memory, 72 KB); "kron", two batched products of 16 x 16 tiles per row
#: (`kron_to_fp8`, operands of 1.5 KB). Timed on the H200 (benchmarks/NOTES.md, stop 25):
#: q/k/v in one launch rotated 1.45 TB/s kron against 1.33 dense (unrotated 2.8), the
#: per-head pair 1.57-1.99 against 1.68-1.96 (unrotated 3.2-3.8); end to end through FA3 kron
#: cost more than dense, through ours a little less: "dense" stays the default. Neither
#: reaches the unrotated rate, whatever the occupancy. "gluon": the Kronecker form written in
#: Gluon with explicit layouts (`gluon_rotate`), for the per-head cast only
#: (`triton_heads.quantize_heads`, NVIDIA GPUs; `quantize_qkv` refuses it). `rotation=None`
#: everywhere means ROTATION, read at the call (benchmarks/rotation_cost.py switches it; the
#: providers' replay keys hold it).
ROTATIONS = ("dense", "kron", "gluon")
ROTATION = "dense"
#: rows of one Kronecker tile (`kron_cast`, `kron_rows=`: 16, 32 or 64). Compiled for sm_90
#: (tests/compile/aot.py) at 16 warps, quant_qkv / heads cast took 60 / 52 registers at 16
#: rows (2 CTAs per SM), 80 / 64 at 32 rows, 77 / 64 at 64
KRON_ROWS = 16
KRON_ROWS_ALLOWED = (16, 32, 64)
#: fp8_outliers' second launch (`write_outlier_sides`): rows of q and of k one program
#: writes the corrections of (after the selection of its (sequence, head), which every
#: program does again from the 2 x 192 maxima: a few microseconds, no launch between), in
#: blocks of OUTLIER_CHUNK rows; and its warps
OUTLIER_ROWS = 256
OUTLIER_CHUNK = 64
OUTLIER_WARPS = 4
#: how the quantization takes the per-feature maxima (`quantize_qkv`'s `maxima`): "reload",
#: from the rows read again 16 at a time after the cast (`publish_rows`; 64 registers with
#: ptxas capped there, 2 CTAs per SM on sm_90), or "held", from the tiles it casts
#: (`publish_amax`: no second read, 110 registers, 1 CTA per SM)
OUTLIER_MAXIMA_MODES = ("reload", "held")
OUTLIER_MAXIMA = "reload"

assert NOPE + ROPE == ROTATION_DIM

if triton is not None:

    NOPE_C = tl.constexpr(NOPE)
    ROPE_C = tl.constexpr(ROPE)
    DV_C = tl.constexpr(DV)
    SCALE_BLOCK_C = tl.constexpr(SCALE_BLOCK)
    QBLOCK_C = tl.constexpr(QBLOCK)
    ROTATION_SCALE_C = tl.constexpr(ROTATION_SCALE)
    OUTLIERS_C = tl.constexpr(OUTLIER_FEATURES)
    SIDE_C = tl.constexpr(OUTLIER_WIDTH)

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
    def finish_fp8(y, FP8_MAX: tl.constexpr, out_ty: tl.constexpr):
        """float32 scaled values: NaN -> 0, clamped, cast (core/fp8.py's block_cast)."""
        y = tl.where(y != y, 0.0, y)
        return tl.clamp(y, -FP8_MAX, FP8_MAX).to(out_ty)

    @triton.jit
    def to_fp8(x, inv, FP8_MAX: tl.constexpr, out_ty: tl.constexpr):
        """x * (1 / scale), NaN -> 0, clamped, cast (core/fp8.py): a multiply per element,
        not a division (an IEEE division is ~10 instructions, most of this kernel's work)."""
        return finish_fp8(x.to(tl.float32) * inv, FP8_MAX, out_ty)

    @triton.jit
    def l1_bits(xn, xr):
        """int32 [rows]: each row's sum_j |x_j| over its 192 features (the nope [rows, 128]
        and rope [rows, 64] tiles), float32, as its bit pattern with the sign cleared: the
        patterns of non-negative floats order as the values do with NaN above inf, so an
        integer max over rows propagates NaN (core/fp8.py's l1_bound before the scaling)."""
        # the two row sums added as [rows, 1] columns: added as [rows] vectors, Triton moves
        # the layout conversion between the tiles' row vectors onto the nope tile itself
        s = tl.sum(tl.abs(xn.to(tl.float32)), 1, keep_dims=True) + tl.sum(
            tl.abs(xr.to(tl.float32)), 1, keep_dims=True)
        return tl.sum(s, 1).to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def bound_scale(bits, FP8_MAX: tl.constexpr):
        """The scale of a rotated block from the int32 max of its rows' `l1_bits`: the
        l1 bound (sum * ROTATION_SCALE) / fp8 max; 1 for an all-zero block, NaN/inf stay.
        (max_r(sum_r) * c rounds as max_r(sum_r * c) does: rounding is monotone.)"""
        return scale_from_amax(bits.to(tl.float32, bitcast=True) * ROTATION_SCALE_C, FP8_MAX)

    @triton.jit
    def load_rotation(Rot):
        """M (`fp8.rotation_pm1`, [192, 192] row-major, the inputs' dtype) as the four blocks
        of the 128 + 64 split: rows nope/rope (input features) x columns nope/rope (rotated
        features): nn [128, 128], rn [64, 128], nr [128, 64], rr [64, 64]."""
        cn = tl.arange(0, NOPE_C)
        cr = tl.arange(0, ROPE_C)
        w: tl.constexpr = NOPE_C + ROPE_C
        m_nn = tl.load(Rot + cn[:, None] * w + cn[None, :])
        m_rn = tl.load(Rot + (cr + NOPE_C)[:, None] * w + cn[None, :])
        m_nr = tl.load(Rot + cn[:, None] * w + NOPE_C + cr[None, :])
        m_rr = tl.load(Rot + (cr + NOPE_C)[:, None] * w + NOPE_C + cr[None, :])
        return m_nn, m_rn, m_nr, m_rr

    @triton.jit
    def rotate_to_fp8(xn, xr, c, m_nn, m_rn, m_nr, m_rr, FP8_MAX: tl.constexpr,
                      out_ty: tl.constexpr):
        """(x @ M) * c for rows x = [xn | xr] (input dtype), c = ROTATION_SCALE / scale,
        NaN -> 0, clamped, cast: ([rows, 128], [rows, 64]) in `out_ty`. Tensor-core products
        with float32 accumulation; each output's two products scaled and added (module doc:
        chaining them through the accumulator replicates the product over warps)."""
        yn = tl.dot(xn, m_nn) * c + tl.dot(xr, m_rn) * c
        yr = tl.dot(xn, m_nr) * c + tl.dot(xr, m_rr) * c
        return finish_fp8(yn, FP8_MAX, out_ty), finish_fp8(yr, FP8_MAX, out_ty)

    @triton.jit
    def load_operands(Rot, KRON: tl.constexpr):
        """The rotation's operands, four slots: M's four blocks (`load_rotation`), or with
        KRON (h16, h12, signs, 0) (`load_kron`; Rot is then `kron_operand`)."""
        if KRON:
            m_nn, m_rn, m_nr = load_kron(Rot)
            m_rr = 0
        else:
            m_nn, m_rn, m_nr, m_rr = load_rotation(Rot)
        return m_nn, m_rn, m_nr, m_rr

    @triton.jit
    def load_kron(Rot):
        """The operands of the Kronecker rotation (`kron_operand`, [3, 16, 16] in the inputs'
        dtype) as [1, 16, 16] tiles: H16 (symmetric, so also H16^T), H12 zero-padded to
        16 x 16 and converted to fp16 (stage 2's operand type: exact, its entries are ±1 and
        0), and the signs as int16 masks laid out as a Kronecker tile (`kron_offsets`: 0 or
        0x8000 at [0, b, a] for feature 16 a + b)."""
        i = tl.arange(0, 16)[None, :, None]
        j = tl.arange(0, 16)[None, None, :]
        h16 = tl.load(Rot + i * 16 + j)
        h12 = tl.load(Rot + 256 + i * 16 + j).to(tl.float16)
        signs = tl.load(Rot + 512 + j * 16 + i).to(tl.int16, bitcast=True)
        return h16, h12, signs

    @triton.jit
    def kron_offsets(row_off):
        """[rows, 16, 16] offsets of the features of a Kronecker tile from the rows' offsets
        `row_off` [rows, 1]: element [r, b, a] is feature 16 a + b (a the group of 16, b the
        feature in it); groups a >= 12 are padding (`kron_mask`)."""
        b = tl.arange(0, 16)[None, :, None]
        a = tl.arange(0, 16)[None, None, :]
        return row_off[:, :, None] + a * 16 + b

    @triton.jit
    def kron_mask(ok):
        """[rows, 16, 16]: the rows `ok` ([rows, 1]) and the 12 real groups of 16 features."""
        return ok[:, :, None] & (tl.arange(0, 16)[None, None, :] < 12)

    @triton.jit
    def kron_to_fp8(x3, c, h16, h12, signs, FP8_MAX: tl.constexpr, out_ty: tl.constexpr):
        """x R / scale for the rows of a Kronecker tile x3 [rows, 16, 16] ([r, b, a] holds
        x[16 a + b], input dtype, padding zeros), c = ROTATION_SCALE / scale, NaN -> 0,
        clamped, cast: [rows, 16, 16] in `out_ty`, [r, d, c'] holding rotated feature
        16 c' + d (`kron_offsets` with the two axes' roles swapped: store at 16 c' + d).

        With xs = x * signs (a sign-bit xor: exact), (x M)[16 c' + d] = sum_a H12[a, c']
        sum_b xs[16 a + b] H16[b, d]; per row, two batched products of 16 x 16 tiles:
        stage 1, Zt[d, a] = sum_b H16[b, d] xs[b, a] (H16^T times the tile: input dtype,
        exact operands, float32 accumulation); stage 2, Zt c times H12 ([d, a] x [a, c']),
        Zt's accumulator taken as the A operand. Zt c is float32: it enters stage 2 as two
        fp16 parts, hi = fp16(Zt c) and lo = fp16(Zt c - hi) (22 bits of its 24: the scaling
        first bounds sum_a |Zt c| by FP8_MAX (the l1 bound; 448 or 240, far under fp16's
        65504), so fp16's range holds it, and the parts' rounding adds at most ~2^-22 of
        that, 448 * 2^-22 ~ 1e-4, to a scaled value), two products chained through float32
        accumulation, lo first."""
        xs = (x3.to(tl.int16, bitcast=True) ^ signs).to(x3.dtype, bitcast=True)
        rows: tl.constexpr = x3.shape[0]
        zt = tl.dot(tl.broadcast_to(h16, [rows, 16, 16]), xs) * c
        hi = zt.to(tl.float16)
        lo = (zt - hi.to(tl.float32)).to(tl.float16)
        h12b = tl.broadcast_to(h12, [rows, 16, 16])
        y = tl.dot(hi, h12b, tl.dot(lo, h12b))
        return finish_fp8(y, FP8_MAX, out_ty)

    @triton.jit
    def load_kron_rows(src, row_off, ok):
        """q or k rows of one head as a Kronecker tile [rows, 16, 16] (`kron_offsets`; rows
        past `ok` and the padding groups read as zeros)."""
        return tl.load(src + kron_offsets(row_off), mask=kron_mask(ok), other=0.0)

    @triton.jit
    def store_kron_rows(dst, row_off, ok, y):
        """`kron_to_fp8`'s [rows, 16, 16] result ([r, d, c'] is feature 16 c' + d) at
        dst + row_off ([rows, 1] offsets): the same offsets as `kron_offsets` gives, read
        with the last two axes as (d, c')."""
        tl.store(dst + kron_offsets(row_off), y, mask=kron_mask(ok))

    @triton.jit
    def kron_cast(src, src_t, dst, dst_t, n, c, h16, h12, signs, FP8_MAX: tl.constexpr,
                  out_ty: tl.constexpr, ROWS: tl.constexpr, KRON_ROWS: tl.constexpr):
        """Rows [0, ROWS) of q or k (those below n) at src (token stride src_t) rotated with
        c = ROTATION_SCALE / scale and stored at dst (row stride dst_t), in Kronecker tiles
        of KRON_ROWS rows, a loop (`kron_to_fp8`'s float32 tiles hold KRON_ROWS * 256 / threads
        values a thread each; ROWS a multiple of KRON_ROWS)."""
        t = tl.arange(0, KRON_ROWS)
        off = t[:, None] * src_t
        off8 = t[:, None] * dst_t
        for i in tl.range(0, ROWS // KRON_ROWS, num_stages=1):
            ok = (t < n - i * KRON_ROWS)[:, None]
            x3 = load_kron_rows(src + i * KRON_ROWS * src_t, off, ok)
            store_kron_rows(dst + i * KRON_ROWS * dst_t, off8, ok,
                            kron_to_fp8(x3, c, h16, h12, signs, FP8_MAX, out_ty))

    @triton.jit
    def qk_scale(xn, xr, FP8_MAX: tl.constexpr, ROTATE: tl.constexpr):
        """The scale of one block of q or k rows (nope [rows, 128], rope [rows, 64], input
        dtype; rows past the block's end loaded as zeros): the l1 bound with ROTATE, else
        the amax (in the input dtype: exact, a max of bf16/fp16 values is one of them)."""
        if ROTATE:
            s = bound_scale(tl.reduce(l1_bits(xn, xr), 0, _imax), FP8_MAX)
        else:
            s = scale_from_amax(max_nan(nan_aware_amax(xn), nan_aware_amax(xr)).to(tl.float32),
                                FP8_MAX)
        return s

    @triton.jit
    def qk_cast(xn, xr, s, FP8_MAX: tl.constexpr, out_ty: tl.constexpr, ROTATE: tl.constexpr,
                m_nn, m_rn, m_nr, m_rr):
        """Rows of q or k cast with their block's scale `s`: (fp8 nope, fp8 rope), x @ M
        with ROTATE (M's blocks from `load_rotation`), else x itself."""
        if ROTATE:
            yn, yr = rotate_to_fp8(xn, xr, reciprocal(s) * ROTATION_SCALE_C, m_nn, m_rn, m_nr,
                                   m_rr, FP8_MAX, out_ty)
        else:
            inv = reciprocal(s)
            yn = to_fp8(xn, inv, FP8_MAX, out_ty)
            yr = to_fp8(xr, inv, FP8_MAX, out_ty)
        return yn, yr

    @triton.jit
    def qk_to_fp8(xn, xr, FP8_MAX: tl.constexpr, out_ty: tl.constexpr, ROTATE: tl.constexpr,
                  m_nn, m_rn, m_nr, m_rr):
        """One block of q or k rows under the block rule: (fp8 nope, fp8 rope, float32
        scale), `qk_scale` then `qk_cast`."""
        s = qk_scale(xn, xr, FP8_MAX, ROTATE)
        yn, yr = qk_cast(xn, xr, s, FP8_MAX, out_ty, ROTATE, m_nn, m_rn, m_nr, m_rr)
        return yn, yr, s

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
    def load_rows(src, k_off, ok):
        """q or k rows of one head (nope, rope) in the input dtype: [rows, 128], [rows, 64];
        `k_off` the rows' offsets [rows, 1], `ok` [rows, 1] (masked rows read as zeros)."""
        kn = tl.load(src + k_off + tl.arange(0, NOPE_C)[None, :], mask=ok, other=0.0)
        kr = tl.load(src + NOPE_C + k_off + tl.arange(0, ROPE_C)[None, :], mask=ok, other=0.0)
        return kn, kr

    @triton.jit
    def store_rows(dst, off, ok, yn, yr):
        """The fp8 nope and rope parts of rows of one head at dst + off ([rows, 1] offsets)."""
        tl.store(dst + off + tl.arange(0, NOPE_C)[None, :], yn, mask=ok)
        tl.store(dst + NOPE_C + off + tl.arange(0, ROPE_C)[None, :], yr, mask=ok)

    @triton.jit
    def publish_amax(xn, xr, AMax, OUTLIERS: tl.constexpr):
        """OUTLIERS == 1 ("held" maxima): each feature's largest `abs_bits` over the held
        rows (nope [rows, 128], rope [rows, 64]; masked rows loaded as zeros) merged into
        AMax [192] (int32 atomic max; NaN's bits above inf's, so NaN propagates)."""
        if OUTLIERS == 1:
            tl.atomic_max(AMax + tl.arange(0, NOPE_C), tl.reduce(abs_bits(xn), 0, _imax).to(tl.int32),
                          sem="relaxed")
            tl.atomic_max(AMax + NOPE_C + tl.arange(0, ROPE_C),
                          tl.reduce(abs_bits(xr), 0, _imax).to(tl.int32), sem="relaxed")

    @triton.jit
    def publish_rows(src, s_t, n_rows, AMax, ROWS: tl.constexpr, OUTLIERS: tl.constexpr):
        """fp8_outliers: each feature's largest `abs_bits` over rows [0, ROWS) of one head at
        src (token stride s_t; those below n_rows) merged into AMax [192] (int32, an atomic
        max: NaN's bits above inf's, so NaN propagates) for the selection. The rows are read
        again (from L1/L2, after the cast) 16 at a time: the column maxima of the held
        [rows, 192] tiles took the kernel from 64 registers to 110 (1 CTA per SM; sm_90):
        OUTLIERS == 2 ("reload" maxima)."""
        if OUTLIERS == 2:
            t = tl.arange(0, 16)
            m_n = tl.zeros([NOPE_C], dtype=tl.int16)
            m_r = tl.zeros([ROPE_C], dtype=tl.int16)
            for i in tl.range(0, ROWS // 16, num_stages=1):
                ok = (t < n_rows - i * 16)[:, None]
                xn, xr = load_rows(src + (i * 16) * s_t, t[:, None] * s_t, ok)
                m_n = tl.maximum(m_n, tl.reduce(abs_bits(xn), 0, _imax))
                m_r = tl.maximum(m_r, tl.reduce(abs_bits(xr), 0, _imax))
            tl.atomic_max(AMax + tl.arange(0, NOPE_C), m_n.to(tl.int32), sem="relaxed")
            tl.atomic_max(AMax + NOPE_C + tl.arange(0, ROPE_C), m_r.to(tl.int32), sem="relaxed")

    @triton.jit
    def select_features(AMax, in_ty: tl.constexpr):
        """core/fp8.py's `outlier_features` of one (sequence, head) from its maxima AMax
        [2, 192] (q's, then k's; `publish_rows` / `publish_amax`): score_f = amax|q_f| * amax|k_f| in float32
        (NaN -> +inf), the 8 largest taken one at a time (ties to the lower feature): sel
        [8] int32, in ascending feature order."""
        f = tl.arange(0, 256)
        real = f < NOPE_C + ROPE_C
        aq = tl.load(AMax + f, mask=real, other=0).to(tl.int16)
        ak = tl.load(AMax + NOPE_C + ROPE_C + f, mask=real, other=0).to(tl.int16)
        score = aq.to(in_ty, bitcast=True).to(tl.float32) * ak.to(in_ty, bitcast=True).to(tl.float32)
        score = tl.where(score != score, float("inf"), score)
        score = tl.where(real, score, -1.0)
        chosen = f < 0
        for _i in tl.static_range(OUTLIERS_C):
            top = tl.max(score, 0)
            idx = tl.min(tl.where(score == top, f, 256), 0)
            chosen = chosen | (f == idx)
            score = tl.where(f == idx, -2.0, score)
        rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
        g = tl.arange(0, OUTLIERS_C)
        sel = tl.sum(tl.where((rank[None, :] == g[:, None]) & chosen[None, :], f[None, :], 0), 1)
        return sel

    @triton.jit
    def write_side(src, s_t, n_rows, sel, scale, dst, dst_t, FP8_MAX: tl.constexpr,
                   ROWS: tl.constexpr, Q_SIDE: tl.constexpr, SIDE_TY: tl.constexpr):
        """core/fp8.py's side_cast for rows [0, ROWS) of one head of q (Q_SIDE) or k (those
        below n_rows) at src (token stride s_t), each with its block's scale `scale` [ROWS]:
        u = the selected features `sel` times 1 / scale, NaN -> 0, clamped (the values the
        cast rounds, bit for bit), h = SIDE_TY(u), l = SIDE_TY(u - h): q [h, l, l, 0], k [l,
        h, l, 0], 8 columns a group, a row's 32 values packed into int32 words stored at dst
        (int32, row stride dst_t words).

        Packed here, a word's values computed side by side in float32 and their bits shifted
        together: every tile of the launch is 32-bit. The first form stored the [rows, 32]
        fp8 tile itself, through a shared-memory layout conversion of 8-bit values, and on an
        H100 (stop 46) its zero group came back with NaN bytes in some rows (the interpreter,
        with fp16 tiles, wrote zeros)."""
        BITS: tl.constexpr = SIDE_TY.primitive_bitwidth
        PER_WORD: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = SIDE_C // PER_WORD
        UINT_TY: tl.constexpr = tl.uint8 if BITS == 8 else tl.uint16
        HI_GROUP: tl.constexpr = 0 if Q_SIDE else 1
        t = tl.arange(0, ROWS)
        w = tl.arange(0, WORDS)
        ok = (t < n_rows)[:, None]
        inv = reciprocal(scale)[:, None]
        word = tl.zeros([ROWS, WORDS], dtype=tl.int32)
        for j in tl.static_range(PER_WORD):
            c = w * PER_WORD + j  # the column of each word's j-th value
            group = c // OUTLIERS_C
            feat = tl.sum(tl.where((c % OUTLIERS_C)[:, None] == tl.arange(0, OUTLIERS_C)[None, :],
                                   sel[None, :], 0), 1)
            x = tl.load(src + t[:, None] * s_t + feat[None, :], mask=ok & (group < 3)[None, :],
                        other=0.0)
            u = x.to(tl.float32) * inv
            u = tl.clamp(tl.where(u != u, 0.0, u), -FP8_MAX, FP8_MAX)
            hi = u.to(SIDE_TY).to(tl.float32)
            lo = (u - hi).to(SIDE_TY).to(tl.float32)
            y = tl.where((group == HI_GROUP)[None, :], hi, lo)
            y = tl.where((group < 3)[None, :], y, 0.0)
            bits = y.to(SIDE_TY).to(UINT_TY, bitcast=True).to(tl.int32)
            word = word | (bits << (j * BITS))
        tl.store(dst + t[:, None] * dst_t + w[None, :], word, mask=ok)

    @triton.jit
    def _outlier_side_kernel(Q, K, QS, Scales, AMax, Sel, QSide, KSide, CuQ, CuK, sq_t, sq_h,
                             sk_t, sk_h, vt_stride, heads, FP8_MAX: tl.constexpr,
                             ROWS: tl.constexpr, CHUNK: tl.constexpr, SIDE_TY: tl.constexpr):
        """Grid (spans of ROWS rows of the longest sequence, sequences, heads): the selection
        of (sequence b, head h) from AMax[b, h] (`select_features`; span 0 stores it at
        Sel[b, h]), then the side tiles of span c's q rows and k rows (`write_side`), CHUNK
        rows at a time, with the scales quantize_qkv wrote: q's per row (QS [Tq, H]), k's per
        128-key block (Scales[0], vt8's column layout). QSide, KSide: the side tiles as
        int32 words ([T, H, 32] of SIDE_TY viewed as [T, H, 32 * bits / 32])."""
        c = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        q0 = tl.load(CuQ + b)
        q1 = tl.load(CuQ + b + 1)
        k0 = tl.load(CuK + b)
        k1 = tl.load(CuK + b + 1)
        if c * ROWS < tl.maximum(q1 - q0, k1 - k0):
            sel = select_features(AMax + (b * heads + h) * 2 * (NOPE_C + ROPE_C), Q.dtype.element_ty)
            if c == 0:
                tl.store(Sel + (b * heads + h) * OUTLIERS_C + tl.arange(0, OUTLIERS_C), sel)
            t = tl.arange(0, CHUNK)
            WORDS: tl.constexpr = SIDE_C * SIDE_TY.primitive_bitwidth // 32
            for i in tl.range(0, ROWS // CHUNK, num_stages=1):
                r0 = q0 + c * ROWS + i * CHUNK
                if r0 < q1:
                    s = tl.load(QS + (r0 + t).to(tl.int64) * heads + h, mask=t < q1 - r0, other=1.0)
                    write_side(Q + h.to(tl.int64) * sq_h + r0.to(tl.int64) * sq_t, sq_t, q1 - r0,
                               sel, s, QSide + (r0.to(tl.int64) * heads + h) * WORDS,
                               heads * WORDS, FP8_MAX, CHUNK, True, SIDE_TY)
                r0 = k0 + c * ROWS + i * CHUNK
                if r0 < k1:
                    # the key's block and that block's first column in vt8 (vt_column)
                    blk = (r0 + t - k0) // SCALE_BLOCK_C
                    sidx = (k0 - k0 % 16 + 16 * b + blk * SCALE_BLOCK_C) // 16
                    s = tl.load(Scales + h * (vt_stride // 16) + sidx, mask=t < k1 - r0, other=1.0)
                    write_side(K + h.to(tl.int64) * sk_h + r0.to(tl.int64) * sk_t, sk_t, k1 - r0,
                               sel, s, KSide + (r0.to(tl.int64) * heads + h) * WORDS,
                               heads * WORDS, FP8_MAX, CHUNK, False, SIDE_TY)

    @triton.jit
    def _cast_part(p, src, vsrc, dst, vrow, k_off, k8_off, v_off, vt_off, t, tv, n_rows, n_cols,
                   sk_t, sv_t, heads, inv_k, inv_v, m_nn, m_rn, m_nr, m_rr,
                   FP8_MAX: tl.constexpr, out_ty: tl.constexpr, SUB: tl.constexpr,
                   ROTATE: tl.constexpr):
        """Sweep 2 of `_kv_block` over part p (rows p * SUB ... of the block): k8 rows and the
        transposed v tile (as `_v_part`). n_rows: the block's rows in the sequence; n_cols: vt8
        columns up to the next sequence's first."""
        ok = (t < n_rows - p * SUB)[:, None]
        kn, kr = load_rows(src + p * SUB * sk_t, k_off, ok)
        if ROTATE:
            yn, yr = rotate_to_fp8(kn, kr, inv_k, m_nn, m_rn, m_nr, m_rr, FP8_MAX, out_ty)
        else:
            yn = to_fp8(kn, inv_k, FP8_MAX, out_ty)
            yr = to_fp8(kr, inv_k, FP8_MAX, out_ty)
        store_rows(dst + p * SUB * heads * (NOPE_C + ROPE_C), k8_off, ok, yn, yr)
        ok_v = (tv < n_rows - p * SUB)[:, None]
        x = tl.load(vsrc + p * SUB * sv_t + v_off, mask=ok_v, other=0.0)
        tl.store(vrow + p * SUB + vt_off, tl.trans(to_fp8(x, inv_v, FP8_MAX, out_ty)),
                 mask=(t + p * SUB < n_cols)[None, :])

    @triton.jit
    def _v_part(p, vsrc, vrow, v_off, vt_off, t, tv, n_rows, n_cols, sv_t, inv_v,
                FP8_MAX: tl.constexpr, out_ty: tl.constexpr, SUB: tl.constexpr):
        """The transposed v tile of part p of a key block (`_cast_part`'s second half)."""
        ok_v = (tv < n_rows - p * SUB)[:, None]
        x = tl.load(vsrc + p * SUB * sv_t + v_off, mask=ok_v, other=0.0)
        tl.store(vrow + p * SUB + vt_off, tl.trans(to_fp8(x, inv_v, FP8_MAX, out_ty)),
                 mask=(t + p * SUB < n_cols)[None, :])

    @triton.jit
    def _block_operands(Rot, m_nn, m_rn, m_nr, m_rr, ROTATE: tl.constexpr, KRON: tl.constexpr,
                        HOISTED: tl.constexpr):
        """The rotation's operands a key block's head casts with: the caller's (HOISTED), or
        loaded here (`load_operands`); zeros unrotated."""
        if ROTATE:
            if HOISTED:
                o_nn, o_rn, o_nr, o_rr = m_nn, m_rn, m_nr, m_rr
            else:
                o_nn, o_rn, o_nr, o_rr = load_operands(Rot, KRON)
        else:
            o_nn, o_rn, o_nr, o_rr = 0, 0, 0, 0
        return o_nn, o_rn, o_nr, o_rr

    @triton.jit
    def _kv_block(
        j, b, g, K, V, K8, VT8, Scales, CuK, Rot, sk_t, sk_h, sv_t, sv_h, vt_stride, ss_w, heads,
        m_nn, m_rn, m_nr, m_rr, AMax,
        FP8_MAX: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, PARTS: tl.constexpr,
        PERMUTED: tl.constexpr, ROTATE: tl.constexpr, KRON: tl.constexpr,
        KRON_ROWS: tl.constexpr, HOISTED: tl.constexpr, OUTLIERS: tl.constexpr,
    ):
        """Key block j of sequence b, heads g * HEADS_PER_PROGRAM ...: k8, vt8 and the scales.

        HOISTED: the rotation's operands are m_nn ... (loaded once by the caller, which casts
        several blocks); else each head of the block loads them (`load_operands`).

        PERMUTED: vt8's columns in `key_of_column` order (the v rows are loaded in that
        order, so the transposed store stays contiguous).

        PARTS = 1: the block's rows are loaded once, held, cast. PARTS = 2: two sweeps over
        halves of the block, the first for the amax (ROTATE: k's l1 bound), the second (from
        L2) to cast, so a program holds half the rows (fewer registers, more programs per SM).

        OUTLIERS (not with ROTATE): each feature's amax over the block's k rows merged into
        AMax [B, H, 2, 192] at [b, h, 1] for the selection (`publish_rows` after the cast, or
        `publish_amax` from the held tiles: OUTLIER_MAXIMA).
        """
        k0 = tl.load(CuK + b)
        k1 = tl.load(CuK + b + 1)
        r0 = k0 + j * SCALE_BLOCK_C
        if (r0 < k1) | ((j == 0) & (k0 == k1)):
            out_ty = K8.dtype.element_ty
            SUB: tl.constexpr = SCALE_BLOCK_C // PARTS
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
                amax_k = AMax + ((b * heads + h) * 2 + 1) * (NOPE_C + ROPE_C)
                # values stay in the input dtype until the cast: the amax is exact there (a
                # max of bf16/fp16 values is one of them) and they take half the registers
                if PARTS == 1:
                    o_nn, o_rn, o_nr, o_rr = _block_operands(Rot, m_nn, m_rn, m_nr, m_rr,
                                                             ROTATE, KRON, HOISTED)
                    ok = (t < k1 - r0)[:, None]
                    if ROTATE and KRON:
                        # the scale from the rows as loaded, then the rows again (from L1/L2)
                        # in Kronecker tiles
                        kn, kr = load_rows(src, k_off, ok)
                        s_k = qk_scale(kn, kr, FP8_MAX, ROTATE)
                        kron_cast(src, sk_t, dst, heads * (NOPE_C + ROPE_C), k1 - r0,
                                  reciprocal(s_k) * ROTATION_SCALE_C, o_nn, o_rn, o_nr, FP8_MAX,
                                  out_ty, SUB, KRON_ROWS)
                        x = tl.load(vsrc + v_off, mask=(tv < k1 - r0)[:, None], other=0.0)
                        s_v = scale_from_amax(nan_aware_amax(x).to(tl.float32), FP8_MAX)
                    else:
                        kn, kr = load_rows(src, k_off, ok)
                        publish_amax(kn, kr, amax_k, OUTLIERS)
                        x = tl.load(vsrc + v_off, mask=(tv < k1 - r0)[:, None], other=0.0)
                        yn, yr, s_k = qk_to_fp8(kn, kr, FP8_MAX, out_ty, ROTATE, o_nn, o_rn, o_nr,
                                                o_rr)
                        s_v = scale_from_amax(nan_aware_amax(x).to(tl.float32), FP8_MAX)
                        store_rows(dst, k8_off, ok, yn, yr)
                    # v transposed in registers: [128 features, SUB tokens], tokens contiguous;
                    # columns past the sequence's end get the masked loads' zeros (the gap up
                    # to the next sequence's first column); the next sequence's are left alone
                    tl.store(vrow + vt_off, tl.trans(to_fp8(x, reciprocal(s_v), FP8_MAX, out_ty)),
                             mask=(t < next_start - col0)[None, :])
                else:
                    # sweep 1: each part's per-row maxima (within a warp: no barrier between
                    # the parts' loads), merged row by row, then one reduction per tile
                    # (ROTATE: each row's l1 sum, merged by max over the parts' rows)
                    ok = (t < k1 - r0)[:, None]
                    kn, kr = load_rows(src, k_off, ok)
                    publish_amax(kn, kr, amax_k, OUTLIERS)
                    if ROTATE:
                        m_kb = tl.reduce(l1_bits(kn, kr), 0, _imax)
                        m_kn, m_kr = 0, 0
                    else:
                        m_kn = tl.reduce(abs_bits(kn), 1, _imax)
                        m_kr = tl.reduce(abs_bits(kr), 1, _imax)
                        m_kb = 0
                    ok_v = (tv < k1 - r0)[:, None]
                    m_v = tl.reduce(abs_bits(tl.load(vsrc + v_off, mask=ok_v, other=0.0)), 1, _imax)
                    for p in tl.static_range(1, PARTS):
                        ok = (t < k1 - r0 - p * SUB)[:, None]
                        kn, kr = load_rows(src + p * SUB * sk_t, k_off, ok)
                        publish_amax(kn, kr, amax_k, OUTLIERS)
                        if ROTATE:
                            m_kb = tl.maximum(m_kb, tl.reduce(l1_bits(kn, kr), 0, _imax))
                        else:
                            m_kn = tl.maximum(m_kn, tl.reduce(abs_bits(kn), 1, _imax))
                            m_kr = tl.maximum(m_kr, tl.reduce(abs_bits(kr), 1, _imax))
                        ok_v = (tv < k1 - r0 - p * SUB)[:, None]
                        x = tl.load(vsrc + p * SUB * sv_t + v_off, mask=ok_v, other=0.0)
                        m_v = tl.maximum(m_v, tl.reduce(abs_bits(x), 1, _imax))
                    in_ty = K.dtype.element_ty
                    if ROTATE:
                        s_k = bound_scale(m_kb, FP8_MAX)
                        inv_k = reciprocal(s_k) * ROTATION_SCALE_C
                    else:
                        a_kn = tl.reduce(m_kn, 0, _imax).to(in_ty, bitcast=True)
                        a_kr = tl.reduce(m_kr, 0, _imax).to(in_ty, bitcast=True)
                        s_k = scale_from_amax(max_nan(a_kn, a_kr).to(tl.float32), FP8_MAX)
                        inv_k = reciprocal(s_k)
                    s_v = scale_from_amax(tl.reduce(m_v, 0, _imax).to(in_ty, bitcast=True).to(
                        tl.float32), FP8_MAX)
                    inv_v = reciprocal(s_v)
                    # after sweep 1, so its registers do not add to sweep 1's loads (unless
                    # HOISTED, a program of several heads reads it again from L2 for each)
                    o_nn, o_rn, o_nr, o_rr = _block_operands(Rot, m_nn, m_rn, m_nr, m_rr,
                                                             ROTATE, KRON, HOISTED)
                    # sweep 2: the block again (from L2), cast. ROTATE: a loop, not unrolled,
                    # so the next part's loads do not join the products' live registers
                    # KRON: v's parts first, then all of k's rows (Kronecker tiles, a loop), so
                    # the rotation's registers and v's (its offset tiles) never add up
                    if ROTATE and KRON:
                        for p in tl.static_range(PARTS):
                            _v_part(p, vsrc, vrow, v_off, vt_off, t, tv, k1 - r0,
                                    next_start - col0, sv_t, inv_v, FP8_MAX, out_ty, SUB)
                        kron_cast(src, sk_t, dst, heads * (NOPE_C + ROPE_C), k1 - r0, inv_k, o_nn,
                                  o_rn, o_nr, FP8_MAX, out_ty, SCALE_BLOCK_C, KRON_ROWS)
                    elif ROTATE:
                        for p in tl.range(0, PARTS, num_stages=1):
                            _cast_part(p, src, vsrc, dst, vrow, k_off, k8_off, v_off, vt_off, t, tv,
                                       k1 - r0, next_start - col0, sk_t, sv_t, heads, inv_k, inv_v,
                                       o_nn, o_rn, o_nr, o_rr, FP8_MAX, out_ty, SUB, ROTATE)
                    else:
                        for p in tl.static_range(PARTS):
                            _cast_part(p, src, vsrc, dst, vrow, k_off, k8_off, v_off, vt_off, t, tv,
                                       k1 - r0, next_start - col0, sk_t, sv_t, heads, inv_k, inv_v,
                                       o_nn, o_rn, o_nr, o_rr, FP8_MAX, out_ty, SUB, ROTATE)
                if last:
                    # the gap can reach 16 columns past the block (it is < 32 columns long)
                    tail = SCALE_BLOCK_C + tl.arange(0, 16)
                    zeros = tl.zeros([DV_C, 16], dtype=tl.float32).to(out_ty)
                    tl.store(vrow + c_v[:, None] * vt_stride + tail[None, :], zeros,
                             mask=(tail < next_start - col0)[None, :])
                if r0 < k1:
                    # after the cast: the rows again from L2, 16 at a time
                    publish_rows(src, sk_t, k1 - r0, amax_k, SCALE_BLOCK_C, OUTLIERS)
                    sidx = col0 // 16
                    tl.store(Scales + h * (vt_stride // 16) + sidx, s_k)
                    tl.store(Scales + ss_w + h * (vt_stride // 16) + sidx, s_v)

    @triton.jit
    def _q_blocks(
        j, b, g, Q, Q8, QS, CuQ, Rot, sq_t, sq_h, heads, AMax,
        FP8_MAX: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, Q_BLOCKS: tl.constexpr,
        ROTATE: tl.constexpr, KRON: tl.constexpr, KRON_ROWS: tl.constexpr, OUTLIERS: tl.constexpr,
    ):
        """q blocks j * Q_BLOCKS ... of sequence b (64 rows each, from the sequence's
        start), heads g * HEADS_PER_PROGRAM ...: q8 and each row's block scale (OUTLIERS: the
        per-feature amax published at AMax[b, h, 0], as `_kv_block`)."""
        q0 = tl.load(CuQ + b)
        q1 = tl.load(CuQ + b + 1)
        first = q0 + j * (Q_BLOCKS * QBLOCK_C)
        if first < q1:
            out_ty = Q8.dtype.element_ty
            t = tl.arange(0, QBLOCK_C)
            q_off = t[:, None] * sq_t
            width: tl.constexpr = NOPE_C + ROPE_C
            q8_off = t[:, None] * (heads * width)
            if ROTATE:
                m_nn, m_rn, m_nr, m_rr = load_operands(Rot, KRON)
            else:
                m_nn, m_rn, m_nr, m_rr = 0, 0, 0, 0
            for i in tl.range(0, Q_BLOCKS, num_stages=1):
                r0 = first + i * QBLOCK_C
                if r0 < q1:
                    ok_r = t < q1 - r0
                    ok = ok_r[:, None]
                    for hh in tl.range(0, HEADS_PER_PROGRAM, num_stages=1):
                        h = g * HEADS_PER_PROGRAM + hh
                        src = Q + h.to(tl.int64) * sq_h + r0.to(tl.int64) * sq_t
                        if ROTATE and KRON:
                            # the scale from the rows as loaded, then the rows again (from
                            # L1/L2) in Kronecker tiles
                            qn, qr = load_rows(src, q_off, ok)
                            s_q = qk_scale(qn, qr, FP8_MAX, ROTATE)
                            kron_cast(src, sq_t, Q8 + (r0.to(tl.int64) * heads + h) * width,
                                      heads * width, q1 - r0,
                                      reciprocal(s_q) * ROTATION_SCALE_C, m_nn, m_rn, m_nr,
                                      FP8_MAX, out_ty, QBLOCK_C, KRON_ROWS)
                        else:
                            qn, qr = load_rows(src, q_off, ok)
                            publish_amax(qn, qr, AMax + (b * heads + h) * 2 * width, OUTLIERS)
                            yn, yr, s_q = qk_to_fp8(qn, qr, FP8_MAX, out_ty, ROTATE, m_nn, m_rn,
                                                    m_nr, m_rr)
                            store_rows(Q8 + (r0.to(tl.int64) * heads + h) * width, q8_off, ok,
                                       yn, yr)
                            publish_rows(src, sq_t, q1 - r0, AMax + (b * heads + h) * 2 * width,
                                         QBLOCK_C, OUTLIERS)
                        # the block's scale at each of its rows (fp8.block_scales' layout)
                        tl.store(QS + (r0 + t).to(tl.int64) * heads + h,
                                 tl.full([QBLOCK_C], 0.0, tl.float32) + s_q, mask=ok_r)

    # ss_w (the scale rows' length) and n_kv (the key blocks of the longest sequence) follow
    # the batch: not specialized, one variant per model
    @triton.jit(do_not_specialize=["ss_w", "n_kv"])
    def _quant_qkv_kernel(
        Q, K, V, Q8, QS, K8, VT8, Scales, CuQ, CuK, Rot, AMax,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, vt_stride, ss_w, heads, n_kv,
        FP8_MAX: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, PARTS: tl.constexpr,
        PERMUTED: tl.constexpr, ROTATE: tl.constexpr, Q_BLOCKS: tl.constexpr,
        KRON: tl.constexpr, KRON_ROWS: tl.constexpr, KV_BLOCKS: tl.constexpr,
        OUTLIERS: tl.constexpr,
    ):
        """Grid (n_kv + q programs of the longest query sequence, sequences, heads /
        HEADS_PER_PROGRAM): programs j < n_kv quantize key blocks j * KV_BLOCKS ... of k and
        v (`_kv_block`; with KV_BLOCKS > 1 the rotation's operands loaded once for all of
        them), the others q blocks (`_q_blocks`, Q_BLOCKS blocks of 64 rows each).

        ROTATE: q and k rotated by M (`Rot`, [192, 192] in the inputs' dtype) with the l1
        bound as their scale (core/fp8.py); Rot is not read otherwise. KRON (with ROTATE):
        the rotation through its Kronecker structure (`kron_to_fp8`), Rot `kron_operand`.
        OUTLIERS (core/fp8.py's fp8_outliers, not with ROTATE; 1 "held", 2 "reload", 0 off):
        q8, k8 and vt8 as without, and each feature's amax over every program's q and k rows
        merged into AMax [B, H, 2, 192] (int32 bits, zeroed by the caller) for
        `write_outlier_sides`.
        """
        j = tl.program_id(0)
        b = tl.program_id(1)
        g = tl.program_id(2)
        if j < n_kv:
            m_nn, m_rn, m_nr, m_rr = 0, 0, 0, 0
            if KV_BLOCKS > 1:
                if ROTATE:
                    m_nn, m_rn, m_nr, m_rr = load_operands(Rot, KRON)
            for jj in tl.range(0, KV_BLOCKS, num_stages=1):
                _kv_block(j * KV_BLOCKS + jj, b, g, K, V, K8, VT8, Scales, CuK, Rot, sk_t, sk_h,
                          sv_t, sv_h, vt_stride, ss_w, heads, m_nn, m_rn, m_nr, m_rr, AMax,
                          FP8_MAX, HEADS_PER_PROGRAM, PARTS, PERMUTED, ROTATE, KRON, KRON_ROWS,
                          KV_BLOCKS > 1, OUTLIERS)
        else:
            _q_blocks(j - n_kv, b, g, Q, Q8, QS, CuQ, Rot, sq_t, sq_h, heads, AMax, FP8_MAX,
                      HEADS_PER_PROGRAM, Q_BLOCKS, ROTATE, KRON, KRON_ROWS, OUTLIERS)

def rotated_qkv_blocks(max_seqlen_q: int, max_seqlen_k: int, batch: int, heads: int,
                       sms: int) -> tuple[int, int]:
    """(kv_blocks, q_blocks) of the dense rotated `quantize_qkv`: ROTATED_QKV_BLOCKS when its
    grid keeps QKV_PROGRAMS_PER_SM programs per SM (`sms`), else (KV_BLOCKS, Q_BLOCKS_ROTATED)."""
    kv_blocks, q_blocks = ROTATED_QKV_BLOCKS
    n_kv = -(-max_seqlen_k // (SCALE_BLOCK * kv_blocks))
    n_q = -(-max_seqlen_q // (QBLOCK * q_blocks))
    if (n_kv + n_q) * batch * heads >= QKV_PROGRAMS_PER_SM * max(1, sms):
        return kv_blocks, q_blocks
    return KV_BLOCKS, Q_BLOCKS_ROTATED


def on_rocm(device: torch.device) -> bool:
    """Whether `device` is an AMD GPU (torch's ROCm build names it "cuda")."""
    return device.type == "cuda" and bool(torch.version.hip)


def quant_warps(device: torch.device, rotate: bool, rotation: str | None = None) -> int:
    """num_warps of the quantization kernels on this device (NUM_WARPS_ROTATED_ROCM for the
    dense rotation on ROCm, NUM_WARPS elsewhere)."""
    return warps_for(on_rocm(device), rotate, rotation)


def warps_for(rocm: bool, rotate: bool, rotation: str | None = None) -> int:
    """`quant_warps` on ROCm (`rocm`) or elsewhere."""
    return NUM_WARPS_ROTATED_ROCM if rotate and current_rotation(rotation) == "dense" and rocm else NUM_WARPS


def current_rotation(rotation: str | None = None) -> str:
    """`rotation`, or ROTATION (the module's, as it is now) for None."""
    return ROTATION if rotation is None else rotation


def check_rotation(rotation: str | None, kron_rows: int = KRON_ROWS) -> bool:
    """Whether `rotation` is "kron" (the Kronecker kernels' KRON constexpr); ValueError naming
    the argument unless it is one of ROTATIONS and `kron_rows` one of KRON_ROWS_ALLOWED (each
    divides the 64-row blocks the kernels cast)."""
    rotation = current_rotation(rotation)
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation: found {rotation!r}, expected one of {', '.join(ROTATIONS)}")
    if kron_rows not in KRON_ROWS_ALLOWED:
        raise ValueError(f"kron_rows: found {kron_rows!r}, expected one of {KRON_ROWS_ALLOWED}")
    return rotation == "kron"


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


def qkv_workspace_layout(total_q: int, total_k: int, batch: int, heads: int,
                         fp8_dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The regions `quantize_qkv` writes, as `Kernel.workspace_layout` lists them ([(name,
    shape, dtype), ...], for `workspace.carve`): its `out` buffers in order."""
    t_pad = vt_padded_len(total_k, batch)
    return [
        ("q8", (total_q, heads, NOPE + ROPE), fp8_dtype),
        ("q_scales", (total_q, heads), torch.float32),
        ("k8", (total_k, heads, NOPE + ROPE), fp8_dtype),
        ("vt8", (heads * DV, t_pad), fp8_dtype),
        ("scales", (2, heads, t_pad // 16), torch.float32),
    ]


_ROTATIONS: dict[tuple[torch.device, torch.dtype, str], torch.Tensor] = {}


def kron_operand(dtype: torch.dtype, device=None) -> torch.Tensor:
    """[3, 16, 16] in `dtype`, the Kronecker kernels' operands (`load_kron`): [0] H16
    (Sylvester's), [1] H12 (`fp8._paley12`) in its top-left 12 x 12, zeros elsewhere, [2] the
    signs: -0.0 at [a, b] where feature 16 a + b's bit of ROTATION_SIGNS is set, +0.0
    elsewhere (bit patterns 0x8000 / 0 in bf16 and fp16, xor-ed onto the inputs). Every entry
    is exact in bf16 and fp16. M = diag(signs) (H12 ⊗ H16) is `fp8.rotation_pm1`."""
    from ..fp8 import _paley12

    h16 = torch.ones(1, 1)
    while h16.shape[0] < 16:
        h16 = torch.cat((torch.cat((h16, h16), 1), torch.cat((h16, -h16), 1)), 0)
    h12 = torch.zeros(16, 16)
    h12[:12, :12] = torch.tensor(_paley12(), dtype=torch.float32)
    neg = torch.tensor([(ROTATION_SIGNS >> j) & 1 for j in range(ROTATION_DIM)], dtype=torch.bool)
    signs = torch.zeros(256)
    signs[:ROTATION_DIM] = torch.where(neg, -0.0, 0.0)
    return torch.stack((h16, h12, signs.view(16, 16))).to(dtype=dtype, device=device).contiguous()


def rotation_operand(device: torch.device, dtype: torch.dtype,
                     rotation: str | None = None) -> torch.Tensor:
    """The rotation's device operand in `dtype` (bf16/fp16: its entries are exact) on `device`:
    M = `fp8.rotation_pm1()` [192, 192] for "dense", `kron_operand` [3, 16, 16] for "kron",
    `gluon_rotate.gluon_operand` [12, 16, 16] for "gluon";
    made once per (device, dtype, rotation) and kept: a launch recorded for replay
    (triton_launch) may point at it for the life of the process. Make it before recording
    (its first creation copies to the device)."""
    rotation = current_rotation(rotation)
    kron = check_rotation(rotation)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype, rotation)
    m = _ROTATIONS.get(key)
    if m is None:
        if rotation == "gluon":
            from .gluon_rotate import gluon_operand

            made = gluon_operand(dtype, device)
        else:
            made = kron_operand(dtype, device) if kron else rotation_pm1(dtype, device).contiguous()
        m = _ROTATIONS.setdefault(key, made)
    return m


def quantize_qkv(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor,
    batch: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    fp8_dtype: torch.dtype,
    fp8_max: float | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
    *,
    rotate: bool = False,
    rotation: str | None = None,
    heads_per_program: int = HEADS_PER_PROGRAM,
    num_warps: int | None = None,
    parts: int = PARTS,
    q_blocks: int | None = None,
    kron_rows: int = KRON_ROWS,
    permuted: bool | None = None,
    kv_blocks: int | None = None,
    sms: int | None = None,
    outliers: torch.Tensor | None = None,
    maxima: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """(q8 [Tq, H, 192], q scales float32 [Tq, H], k8 [Tk, H, 192], vt8 [H * 128, T_pad],
    scales float32 [2, H, T_pad / 16]) in one launch (module doc for the layouts).

    `outliers` = amax, int32 [B, H, 2, 192] of zeros (`outlier_buffers`): core/fp8.py's
    fp8_outliers, whose per-feature maxima of q and k this launch merges there for
    `write_outlier_sides` (needs q; not with `rotate`); q8, k8 and vt8 are as without.
    `maxima` (OUTLIER_MAXIMA_MODES; None: OUTLIER_MAXIMA, read at the call) says how.

    q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128]: bf16/fp16, any token and head strides,
    contiguous features. q None (with cu_seqlens_q None): k and v only, q8 and q scales
    come back as None. `out`: the five buffers to write into (the workspace's), else they
    are allocated. `cu_seqlens_*` int32 on k's device; `batch` and the longest lengths from
    the host (the plan), so nothing is read back from the device. `fp8_max` overrides the
    format's largest value (tests run the fp8 logic with fp16 storage in Triton's
    interpreter). `rotate`: q and k rotated (core/fp8.py), `rotation` (ROTATIONS) saying how:
    "dense" (x @ M, M from `rotation_operand`) or "kron" (`kron_to_fp8`); not read without
    `rotate`; `kron_rows`: rows of one Kronecker tile (KRON_ROWS). `heads_per_program`,
    `num_warps` (default `quant_warps`), `parts` and `q_blocks` (64-row q blocks per program,
    default Q_BLOCKS, Q_BLOCKS_ROTATED with `rotate`) and `kv_blocks` (128-key blocks per
    k/v program, default KV_BLOCKS: more amortize the rotation's operand load) are tuning
    knobs, chosen by `rotated_qkv_blocks` for the dense rotation when `sms` (the device's SM
    count) is given and neither is; the amax rule's outputs do not depend on them (bit
    for bit); rotated, a knob
    could only change the order of the products' float32 sums (benchmarks/quant_bench.py
    compares every configuration). `permuted`: vt8's key order (module doc), `permuted_v(k.device)` by
    default, which is what the attention kernels read.
    """
    kron = check_rotation(rotation, kron_rows)
    if rotate and current_rotation(rotation) == "gluon":
        raise ValueError("rotation: found 'gluon', implemented for the per-head cast only "
                         "(triton_heads.quantize_heads, the FA3 provider's); pass "
                         "rotation='dense' or 'kron' to the block rule's quantize_qkv")
    if outliers is not None:
        if q is None:
            raise ValueError("outliers: found a buffer with q None, expected q (the selection "
                             "reads q and k)")
        if rotate:
            raise ValueError("rotate: found True with outliers, expected one of the two "
                             "(core/fp8.py's rotation_applies)")
    total_k, heads = k.shape[0], k.shape[1]
    total_q = 0 if q is None else q.shape[0]
    t_pad = vt_padded_len(total_k, batch)
    if out is not None:
        q8, qs, k8, vt8, scales = out
    else:
        q8, qs, k8, vt8, scales = (
            None if q is None and name.startswith("q") else
            torch.empty(shape, dtype=dtype, device=k.device)
            for name, shape, dtype in qkv_workspace_layout(total_q, total_k, batch, heads, fp8_dtype))
    if batch == 0 or (total_k == 0 and total_q == 0):
        return q8, qs, k8, vt8, scales
    limit = fp8_max if fp8_max is not None else float(torch.finfo(fp8_dtype).max)
    # at least one block per sequence when there are keys: an empty one still writes its
    # zero columns
    if rotate and not kron and sms is not None and kv_blocks is None and q_blocks is None:
        kv_blocks, q_blocks = rotated_qkv_blocks(max_seqlen_q, max_seqlen_k, batch, heads, sms)
    if kv_blocks is None:
        kv_blocks = KV_BLOCKS
    if kv_blocks < 1:
        raise ValueError(f"kv_blocks: found {kv_blocks}, expected 1 or more")
    n_kv = max(1, triton.cdiv(max_seqlen_k, SCALE_BLOCK * kv_blocks)) if total_k else 0
    if q_blocks is None:
        # dense: each program first fills shared memory with M, which more blocks amortize;
        # kron's operands are 1.5 KB
        q_blocks = Q_BLOCKS_ROTATED if rotate and not kron else Q_BLOCKS
    n_q = triton.cdiv(max_seqlen_q, QBLOCK * q_blocks) if total_q else 0
    if n_kv + n_q == 0:
        return q8, qs, k8, vt8, scales
    hpp = max(d for d in range(1, max(1, heads_per_program) + 1) if heads % d == 0)
    rot = rotation_operand(k.device, k.dtype, rotation) if rotate else k
    qa = q if q is not None and total_q else k  # not read when there are no q programs
    grid = (n_kv + n_q, batch, heads // hpp)
    amax = outliers if outliers is not None else scales  # not read without
    maxima = OUTLIER_MAXIMA if maxima is None else maxima
    if maxima not in OUTLIER_MAXIMA_MODES:
        raise ValueError(f"maxima: found {maxima!r}, expected one of {OUTLIER_MAXIMA_MODES}")
    mode = 0 if outliers is None else {"held": 1, "reload": 2}[maxima]
    _quant_qkv_kernel[grid](
        qa, k, v, q8 if q8 is not None else k8, qs if qs is not None else scales, k8, vt8, scales,
        cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens_k, cu_seqlens_k, rot,
        amax,
        qa.stride(0), qa.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), t_pad,
        scales.stride(0), heads, n_kv,
        FP8_MAX=limit, HEADS_PER_PROGRAM=hpp, PARTS=parts,
        PERMUTED=permuted_v(k.device) if permuted is None else permuted, ROTATE=bool(rotate),
        Q_BLOCKS=q_blocks, KRON=bool(rotate) and kron, KRON_ROWS=kron_rows, KV_BLOCKS=kv_blocks,
        OUTLIERS=mode,
        # "reload": publish_rows took ptxas to 82 registers, 1 CTA per SM; capped at the plain
        # kernel's 64: no spill (sm_90, tests/compile), 2 CTAs
        **({"maxnreg": 64} if mode == 2 and not on_rocm(k.device) else {}),
        num_warps=quant_warps(k.device, rotate, rotation) if num_warps is None else num_warps,
    )
    return q8, qs, k8, vt8, scales


def tl_dtype_of(dtype: torch.dtype):
    """The Triton type of an fp8 storage dtype (or fp16, the interpreter's stand-in)."""
    return {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e4m3fnuz: tl.float8e4b8,
            torch.float16: tl.float16}[dtype]


def outlier_buffers(q: torch.Tensor, k: torch.Tensor, batch: int, side_dtype: torch.dtype,
                    used: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8_outliers' scratch, allocated per call (the Triton provider does not replay such
    calls): (amax int32 [B, H, 2, 192] zeroed, `quantize_qkv`'s `outliers`; sel int32
    [B, H, 8]; q_side [Tq, H, 32]; k_side [Tk, H, 32] in `side_dtype`, the fp8 storage
    dtype), the last three for `write_outlier_sides`, which writes every row of every
    sequence. `used` = (cu_seqlens_q[-1], cu_seqlens_k[-1]) from the host: only the side
    tiles' rows past them are zeroed here (no memset of what the launch writes); None:
    all of them."""
    heads = k.shape[1]
    amax = torch.zeros(batch, heads, 2, ROTATION_DIM, dtype=torch.int32, device=k.device)
    sel = torch.empty(batch, heads, OUTLIER_FEATURES, dtype=torch.int32, device=k.device)
    sides = []
    for x, n in zip((q, k), used or (0, 0), strict=True):
        side = torch.empty(x.shape[0], heads, OUTLIER_WIDTH, dtype=side_dtype, device=x.device)
        if n < x.shape[0]:
            side[n:].zero_()
        sides.append(side)
    return amax, sel, sides[0], sides[1]


def write_outlier_sides(q: torch.Tensor, k: torch.Tensor, q_scales: torch.Tensor,
                        scales: torch.Tensor, buffers: tuple[torch.Tensor, ...],
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, batch: int,
                        max_seqlen_q: int, max_seqlen_k: int, fp8_max: float, *,
                        rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_side, k_side) of `outlier_buffers` filled after `quantize_qkv(..., outliers=amax)`
    (its q scales [Tq, H] and scales [2, H, T_pad / 16]): each (sequence, head)'s selection
    (stored at sel) and its features' corrections (core/fp8.py's side_cast), one launch of
    `rows`-row spans (OUTLIER_ROWS; the result does not depend on it). Rows past the last
    sequence stay zero."""
    amax, sel, q_side, k_side = buffers
    rows = OUTLIER_ROWS if rows is None else rows
    if rows < OUTLIER_CHUNK or rows % OUTLIER_CHUNK:
        raise ValueError(f"rows: found {rows}, expected a multiple of {OUTLIER_CHUNK}")
    spans = triton.cdiv(max(max_seqlen_q, max_seqlen_k), rows)
    if batch and spans:
        # the side tiles as int32 words (write_side packs them: no 8-bit tile in the launch)
        _outlier_side_kernel[(spans, batch, k.shape[1])](
            q, k, q_scales, scales, amax, sel, q_side.view(torch.int32), k_side.view(torch.int32),
            cu_seqlens_q, cu_seqlens_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            vt_padded_len(k.shape[0], batch), k.shape[1], FP8_MAX=fp8_max, ROWS=rows,
            CHUNK=OUTLIER_CHUNK, SIDE_TY=tl_dtype_of(q_side.dtype), num_warps=OUTLIER_WARPS)
    return q_side, k_side


def quantize_qkv_outliers(q, k, v, cu_seqlens_q, cu_seqlens_k, batch: int, max_seqlen_q: int,
                          max_seqlen_k: int, fp8_dtype: torch.dtype, fp8_max: float | None = None,
                          out: tuple[torch.Tensor, ...] | None = None, *,
                          buffers: tuple[torch.Tensor, ...] | None = None,
                          used: tuple[int, int] | None = None, maxima: str | None = None,
                          rows: int | None = None, sms: int | None = None):
    """fp8_outliers' quantization, its two launches in order: (quantize_qkv's five tensors,
    sel int32 [B, H, 8], (q_side, k_side)). `buffers`: `outlier_buffers`' four (else
    allocated here, with `used`); `maxima` and `rows`: the two launches' knobs."""
    limit = fp8_max if fp8_max is not None else float(torch.finfo(fp8_dtype).max)
    if buffers is None:
        buffers = outlier_buffers(q, k, batch, fp8_dtype, used)
    quantized = quantize_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q,
                             max_seqlen_k, fp8_dtype, limit, out, sms=sms, outliers=buffers[0],
                             maxima=maxima)
    sides = write_outlier_sides(q, k, quantized[1], quantized[4], buffers, cu_seqlens_q,
                                cu_seqlens_k, batch, max_seqlen_q, max_seqlen_k, limit, rows=rows)
    return quantized, buffers[1], sides


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
    rotate: bool = False,
    rotation: str | None = None,
    heads_per_program: int = HEADS_PER_PROGRAM,
    num_warps: int | None = None,
    parts: int = PARTS,
    permuted: bool | None = None,
    kron_rows: int = KRON_ROWS,
    kv_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k8 [T, H, 192], vt8 [H * 128, T_pad], scales float32 [2, H, T_pad / 16]):
    `quantize_qkv` without q (the same kernel, no q programs)."""
    _, _, k8, vt8, scales = quantize_qkv(
        None, k, v, None, cu_seqlens_k, batch, 0, max_seqlen_k, fp8_dtype, fp8_max,
        None if out is None else (None, None, *out), rotate=rotate, rotation=rotation,
        heads_per_program=heads_per_program, num_warps=num_warps, parts=parts, permuted=permuted,
        kron_rows=kron_rows, kv_blocks=kv_blocks)
    return k8, vt8, scales
