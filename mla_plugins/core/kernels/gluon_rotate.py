"""The rotated per-(sequence, head) FP8 cast in Gluon (`rotation="gluon"`), for the FA3 provider.

Pass 2 of `triton_heads.quantize_heads` (pass 1, the scale bounds, is its Triton kernel,
unchanged): the grid, descales and output rule of `triton_heads._head_cast_kernel` with the
rotation, written with explicit layouts so that no value crosses shared memory or a barrier
(the Triton "kron" cast routes every tile through shared memory: benchmarks/NOTES.md).
core/fp8.py's M = diag(signs) (H12 ⊗ H16), so for a row x and output feature group c:

    (x M)[16 c + d] = sum_a H12[a, c] z_a[d],   z_a = x[16 a : 16 a + 16] @ B_a,
    B_a = diag(signs of group a) H16.

- Stage 1, on the tensor cores (mma v2, m16n8k16, bf16/fp16 operands, float32 sums): per
  input group a, z_a^T = B_a^T x_a^T, the constant ±1 matrix as the A operand
  (`gluon_operand`, loaded once per program and held in registers: 12 x 4 a thread) and
  the rows as the B operand, one n8 tile (8 rows) a warp per step (ROWS_PER_WARP 16: two).
  Exact products; 12 float32 accumulators of one layout.
- Stage 2, in registers: every thread holds the same (feature, row) positions of the 12
  accumulators, so the H12 combination is float32 adds and subtracts in place: `_h12`, a
  network of 48 (against 132 summed row by row: 6 butterflies of pairs of groups and the
  subexpressions the rows of H12 share, found by a greedy search; `_h12.fn` runs on torch
  tensors, which the tests check against H12).
- Then the scale (ROTATION_SCALE / scale, one multiply), the fp8 conversion and the store.

Orders inside a group. The B operand of m16n8k16 gives a thread (lane 4 g + t) the k slots
2 t, 2 t + 1, 2 t + 8, 2 t + 9 of column (row) g, in two consecutive registers; the product
sums over k, so which feature sits in which slot is free as long as the A operand's columns
follow. Slot k holds feature PERM[k] (bits k0 k1 k2 k3 -> b0 b2 b3 b1): a thread's four
slots are four adjacent features, one 8-byte load landing in the operand's registers as
they are (`_load_layout`, then `_to_operand`, a transpose, reshape and permute that only
renames the layout's bases; the conversion into the operand layout is asserted trivial).
The accumulator gives a thread rows m = g and g + 8 of columns 2 t, 2 t + 1; its row m
holds output feature OUT_PERM[m] = 2 (m % 8) + m // 8 (the A operand's rows), so a thread's
two values of a row and output group are adjacent fp8 bytes (`_store_layout`,
`_from_accumulator`). With PAIRED_STORES (the default) lanes 4 g + t and 4 (g ^ 1) + t trade
one row's pair (one shuffle a group, inside the warp: `_paired_layout`), so each thread
stores 4 adjacent bytes of one row and each 32-byte output sector is written by one request
(2-byte stores wrote it in two: 29% of the L2's sectors "excessive" under Nsight Compute).
H16[PERM[k], OUT_PERM[m]] is what `gluon_operand` stores, with the signs.

With PREFETCH (the default) a step's 12 loads are issued before the previous step's products,
stage 2 and stores, and a program's first step before its scale (the partials' load): the
loop carries the loaded tiles (149 registers against 127, 3 programs of 4 warps an SM
against 4), and a program waits on one load latency, not one per step.

Program order. The grid is one dimension with every q and k program (rotated: the heavy
ones) before every v program (a cast alone). The block scheduler hands out programs in
about that order, so the heavy ones spread over the SMs first and the light ones fill in;
with a (program, sequence, head) grid the mix per SM followed the head count's residues,
and at B1-S1024-H16 (384 programs, 3 an SM) some SMs held three rotated programs while the
average held two: under Nsight Compute the busiest SM was active 24% above the average
(benchmarks/NOTES.md, stop 33). The order changes no byte: each program's rows and stores
are the same.

Rows past a sequence's end load its last row (no masked loads, whose registers would be
zeroed first): each accumulator column is one row's, and those rows' stores are masked.

Special values (core/fp8.py's rule: NaN -> 0, clamped to the fp8 maximum). A finite scale
bounds every rotated value of its (sequence, head) (the l1 bound), so where the scale and
the factor ROTATION_SCALE / scale are both finite and under FAST_LIMIT (a uniform branch per
head) no value can be NaN and the fp8 conversion's own saturation (cvt.rn.satfinite) is
the clamp: a multiply and a conversion per value. Otherwise (a NaN or inf in the
sequence's rows, a scale so small its reciprocal overflows, or an `fp8_max` other than the
format's) each value takes the rule's where/clamp. v is cast unrotated, the same way.

Runs where Gluon compiles: CUDA with Triton's Gluon (not TRITON_INTERPRET, not ROCm) on a GPU
with bf16 mma.sync (compute capability 8.0 or later; compiled for sm_90 only, tests/compile;
GPU tests in tests/gpu/test_gluon_rotation.py). `gluon_reasons` says why not. This module
imports triton (and gluon) guarded; `gluon_operand` is plain torch.
"""

from __future__ import annotations

import os

import torch

from ..fp8 import ROTATION_DIM, ROTATION_SCALE, ROTATION_SIGNS

try:
    import triton  # noqa: F401  (the package gate: gluon ships inside triton)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - triton missing or without gluon
    gluon = None

#: input feature groups of 16 (H12's order) and the width of one
GROUPS, GROUP = 12, 16
#: warps of a cast program, and rows each casts per step (one or two n8 tiles of the mma):
#: a step is ROWS_PER_WARP * NUM_WARPS rows, a divisor of triton_heads.HEAD_BLOCK's 64 (the
#: host counts a program's rows in those blocks)
NUM_WARPS = 4
ROWS_PER_WARP = 8
#: issue a step's 12 loads before the previous step's products, stage 2 and stores (the
#: loop carries the loaded tiles): the cast then waits on a load's latency once per program,
#: not once per step. Measured (stop 30, H100, rotation_cost through FA3): with PAIRED_STORES
#: the rotation's cost +0.3-5.0% at the large shapes (paired alone +0.3-5.5%), +0.5% at
#: B16-S512-H16 (paired alone +7.6%); neither: +1.6-8.3% and +15.6%
PREFETCH = True
#: the grid's q and k programs before its v programs (module doc, "Program order"); False:
#: the (program, sequence, head) order of triton_heads' Triton cast
QK_FIRST = True
#: store 4 adjacent fp8 bytes of one row a thread (lanes 4 g + t and 4 (g ^ 1) + t trade a
#: row's pair: a shuffle inside the warp) instead of 2 bytes of two rows: half the store
#: requests, each output sector written by one request
PAIRED_STORES = True
#: feature of a group held in k slot k (module doc): bits k0 k1 k2 k3 -> b0 b2 b3 b1
PERM = tuple((k & 1) | ((k & 8) >> 2) | ((k & 2) << 1) | ((k & 4) << 1) for k in range(GROUP))
#: feature of an output group held in accumulator row m: rows m and m + 8 (one thread's)
#: adjacent
OUT_PERM = tuple(2 * (m % 8) + m // 8 for m in range(GROUP))
#: the partials' vector a scale is reduced from (triton_heads.MAX_SPLITS, which checks it)
MAX_SPLITS = 32
#: FAST needs the scale and its reciprocal under this (module doc): every sum of a head's
#: rotated values then stays far from float32 overflow
FAST_LIMIT = 2.0**100

assert ROTATION_DIM == GROUPS * GROUP
assert sorted(PERM) == sorted(OUT_PERM) == list(range(GROUP))


def _h16() -> list[list[int]]:
    h = [[1]]
    while len(h) < GROUP:
        h = [r + r for r in h] + [r + [-x for x in r] for r in h]
    return h


def gluon_operand(dtype: torch.dtype, device=None) -> torch.Tensor:
    """[12, 16, 16] in `dtype` (bf16/fp16: ±1, exact): [a, m, k] = sign(16 a + PERM[k]) *
    H16[PERM[k], OUT_PERM[m]], group a's constant A operand (B_a transposed, its rows and
    columns in the kernel's orders). H12 over the products A_a x_a^T gives (x M)^T, x M =
    x @ fp8.rotation_pm1, with accumulator row m holding feature OUT_PERM[m] (module doc)."""
    h16 = _h16()
    out = torch.empty(GROUPS, GROUP, GROUP)
    for a in range(GROUPS):
        for k in range(GROUP):
            b = PERM[k]
            sign = -1.0 if (ROTATION_SIGNS >> (GROUP * a + b)) & 1 else 1.0
            for m in range(GROUP):
                out[a, m, k] = sign * h16[b][OUT_PERM[m]]
    return out.to(dtype=dtype, device=device).contiguous()


def gluon_reasons(device: torch.device) -> list[str]:
    """Why the Gluon cast cannot run on `device` (empty: it can)."""
    reasons = []
    if gluon is None:
        reasons.append("this Triton has no Gluon (triton.experimental.gluon)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        reasons.append("TRITON_INTERPRET is set: Gluon kernels do not run in the interpreter")
    if device.type != "cuda" or torch.version.hip:
        reasons.append(f"device {device} is not an NVIDIA GPU (Gluon's mma v2 is NVIDIA's)")
    elif torch.cuda.get_device_capability(device) < (8, 0):
        reasons.append(f"compute capability {torch.cuda.get_device_capability(device)} has no "
                       "bf16 mma.sync (8.0 or later)")
    return reasons


if gluon is not None:
    GROUP_G = gl.constexpr(GROUP)
    ROTATION_SCALE_G = gl.constexpr(ROTATION_SCALE)
    FAST_LIMIT_G = gl.constexpr(FAST_LIMIT)
    DV_G = gl.constexpr(128)
    MAX_SPLITS_G = gl.constexpr(MAX_SPLITS)

    @gluon.constexpr_function
    def _warp_bases(warps):
        """Warp w's n8 tiles of rows: 8 w ... and 8 (w + warps) ... (warps a power of two),
        as the mma v2 layout repeats its tiles over warps along n."""
        return [[8 << i, 0] for i in range(warps.bit_length() - 1)]

    @gluon.constexpr_function
    def _row_reg_bases(warps, rows):
        """A thread's second row (8 warps further) when a step holds two n8 tiles a warp."""
        return [[8 * warps, 0]] if rows == 16 * warps else []

    @gluon.constexpr_function
    def _mma_layout(warps):
        """The accumulator [16 features, ROWS rows]: m16n8 tiles, warp w's rows 8 w ... (and
        8 (w + warps) ... with 16 rows a warp)."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, warps],
                                         instr_shape=[16, 8])

    @gluon.constexpr_function
    def _load_layout(warps, rows):
        """[rows, 16 features] in memory order, a thread holding 4 adjacent features (one
        8-byte load) of row 8 w + g (and 8 (w + warps) + g with 16 rows a warp; warp w, lane
        4 g + t): after `_to_operand`'s permutations, the B operand's own registers."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2]] + _row_reg_bases(warps, rows),
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=_warp_bases(warps), block_bases=[], shape=[rows, 16])

    @gluon.constexpr_function
    def _store_layout(warps, rows):
        """[rows, 16 features] in memory order, a thread holding 2 adjacent features (one
        2-byte fp8 store) of rows 8 w + 2 t + {0, 1} (and the same plus 8 warps with 16 rows
        a warp): `_from_accumulator`'s result with its registers renamed (module doc)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [1, 0]] + _row_reg_bases(warps, rows),
            lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
            warp_bases=_warp_bases(warps), block_bases=[], shape=[rows, 16])

    @gluon.constexpr_function
    def _paired_layout(warps, rows):
        """[rows, 16 features] in memory order, a thread holding 4 adjacent features (one
        4-byte fp8 store) of row 8 w + 2 t + (g & 1), features 4 (g >> 1) ...: `_store_layout`
        with its second register basis (the row's low bit) traded for its third lane basis
        (the features' bit 1), so the conversion stays inside a warp (PAIRED_STORES)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2]] + _row_reg_bases(warps, rows),
            lane_bases=[[2, 0], [4, 0], [1, 0], [0, 4], [0, 8]],
            warp_bases=_warp_bases(warps), block_bases=[], shape=[rows, 16])

    @gluon.jit
    def _to_operand(x, ROWS: gl.constexpr):
        """x [ROWS, 16] (row, feature b) -> [16, ROWS] (k slot, row), slot k holding feature
        PERM[k]: bits (b3 b2 b1 b0) read as (k2 k1 k3 k0). Permutations of the layout's
        bases: no value moves."""
        xt = gl.reshape(gl.permute(x, (1, 0)), [2, 2, 2, 2, ROWS])  # [b3, b2, b1, b0, r]
        return gl.reshape(gl.permute(xt, (2, 0, 1, 3, 4)), [16, ROWS])  # [b1, b3, b2, b0, r]

    @gluon.jit
    def _from_accumulator(y, ROWS: gl.constexpr):
        """y [16, ROWS] (accumulator row m, row) -> [ROWS, 16] (row, feature d), feature
        OUT_PERM[m] = 2 (m % 8) + m // 8 taking row m: the two rows m, m + 8 a thread holds
        become adjacent features. Permutations of the layout's bases: no value moves."""
        y5 = gl.reshape(y, [2, 2, 2, 2, ROWS])  # [m3, m2, m1, m0, r]
        z = gl.reshape(gl.permute(y5, (1, 2, 3, 0, 4)), [16, ROWS])  # [m2, m1, m0, m3, r]
        return gl.permute(z, (1, 0))

    @gluon.jit
    def _h12(z0, z1, z2, z3, z4, z5, z6, z7, z8, z9, z10, z11):
        """y_c = sum_a H12[a, c] z_a (fp8._paley12) in 48 adds and subtracts (module doc),
        except that outputs 0, 8 and 9 come back negated (-y_c: their terms all enter with a
        minus, and a negation alone would cost an instruction; the caller scales them by
        -c). Any values supporting + and - (the kernel's float32 tiles; torch tensors in
        tests)."""
        t0 = z6 + z11
        t1 = z3 - z4
        t2 = z0 + z9
        t3 = z7 - z8
        t4 = z1 - z10
        t5 = z6 - z11
        t6 = z3 + z4
        t7 = z0 - z9
        t8 = z1 + z10
        t9 = z2 + z5
        t10 = z2 - z5
        t11 = z7 + z8
        t12 = t4 - t9
        t13 = t7 + t11
        t14 = t7 - t9
        t15 = t1 - t2
        t16 = t11 - t14
        t17 = t3 + t15
        t18 = t0 - t8
        t19 = t2 + t3
        t20 = t11 + t12
        t21 = t1 - t3
        t22 = t1 - t5
        t23 = t10 - t18
        t24 = t8 - t10
        t25 = t5 + t19
        t26 = t6 - t10
        t27 = t4 - t13
        t28 = t4 + t9
        t29 = t6 - t24
        t30 = t0 + t6
        t31 = t5 + t21
        t32 = t7 + t28
        t33 = t8 + t30
        t34 = t2 + t22
        t35 = t0 - t26
        n0 = t16 + t33
        y1 = t20 + t34
        y2 = t23 - t17
        y3 = t34 - t20
        y4 = t33 - t16
        y5 = t32 - t31
        y6 = t31 + t32
        y7 = t25 + t29
        n8 = t27 + t35
        n9 = t17 + t23
        y10 = t25 - t29
        y11 = t35 - t27
        return n0, y1, y2, y3, y4, y5, y6, y7, n8, n9, y10, y11

    @gluon.jit
    def _to_fp8(y, c, FAST: gl.constexpr, FP8_MAX: gl.constexpr, out_ty: gl.constexpr):
        """y * c in `out_ty`: FAST, the conversion's saturation as the clamp (no NaN can
        occur, module doc); else NaN -> 0 and the clamp first (core/fp8.py's block_cast)."""
        y = y * c
        if not FAST:
            y = gl.where(y != y, 0.0, y)
            y = gl.minimum(gl.maximum(y, -FP8_MAX), FP8_MAX)
        return y.to(out_ty)

    @gluon.jit
    def _store_group(dst, off8, ok, y, c, group: gl.constexpr, FAST: gl.constexpr,
                     FP8_MAX: gl.constexpr, out_ty: gl.constexpr, ST: gl.constexpr,
                     SO: gl.constexpr, ROWS: gl.constexpr, PAIRED: gl.constexpr):
        """Output group `group`'s float32 accumulator [16, ROWS] scaled by c, cast and stored
        at columns 16 group ... (memory order: `_from_accumulator`, then a renaming of
        registers into ST; PAIRED: the fp8 values then traded between lane pairs into SO,
        `_paired_layout`). `off8`, `ok` in SO."""
        yt = gl.convert_layout(_from_accumulator(y, ROWS), ST, assert_trivial=True)
        y8 = _to_fp8(yt, c, FAST, FP8_MAX, out_ty)
        if PAIRED:
            y8 = gl.convert_layout(y8, SO)
        gl.store(dst + off8 + group * GROUP_G, y8, mask=ok)

    @gluon.jit
    def _store_groups(dst, off8, ok, c, n0, y1, y2, y3, y4, y5, y6, y7, n8, n9, y10, y11,
                      FAST: gl.constexpr, FP8_MAX: gl.constexpr, out_ty: gl.constexpr,
                      ST: gl.constexpr, SO: gl.constexpr, ROWS: gl.constexpr,
                      PAIRED: gl.constexpr):
        """The 12 output groups (`_h12`'s, three of them negated: scaled by -c)."""
        _store_group(dst, off8, ok, n0, -c, 0, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y1, c, 1, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y2, c, 2, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y3, c, 3, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y4, c, 4, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y5, c, 5, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y6, c, 6, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y7, c, 7, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, n8, -c, 8, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, n9, -c, 9, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y10, c, 10, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        _store_group(dst, off8, ok, y11, c, 11, FAST, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)

    @gluon.jit
    def _stage1(x, op, zero, B: gl.constexpr, ROWS: gl.constexpr):
        """z^T = B_group^T x^T: the rows' 16 features of one group as loaded (`_load_rows`),
        which are the B operand's registers as they land (`_to_operand`), times the constant
        A operand `op`: one m16 x n(ROWS) x k16 product."""
        return mma_v2(op, gl.convert_layout(_to_operand(x, ROWS), B, assert_trivial=True), zero)

    @gluon.jit
    def _load_operand(Rot, group: gl.constexpr, A: gl.constexpr):
        """The constant A operand [m, k] of group `group` (`gluon_operand`, row-major)."""
        m = gl.arange(0, GROUP_G, layout=gl.SliceLayout(1, A))
        k = gl.arange(0, GROUP_G, layout=gl.SliceLayout(0, A))
        return gl.load(Rot + group * (GROUP_G * GROUP_G) + m[:, None] * GROUP_G + k[None, :])

    @gluon.jit
    def _load_rows(src, off):
        """The 12 groups of 16 features of ROWS rows (src at the first row; `off` [ROWS, 16]
        offsets of group 0's features in the load layout), one 8-byte load a thread each."""
        return (gl.load(src + off), gl.load(src + off + GROUP_G),
                gl.load(src + off + 2 * GROUP_G), gl.load(src + off + 3 * GROUP_G),
                gl.load(src + off + 4 * GROUP_G), gl.load(src + off + 5 * GROUP_G),
                gl.load(src + off + 6 * GROUP_G), gl.load(src + off + 7 * GROUP_G),
                gl.load(src + off + 8 * GROUP_G), gl.load(src + off + 9 * GROUP_G),
                gl.load(src + off + 10 * GROUP_G), gl.load(src + off + 11 * GROUP_G))

    @gluon.jit
    def _load_rows_from(src_h, r0, r_end, t, f, sx_t):
        """`_load_rows` of the ROWS rows from row r0 of one head (src_h at its row 0; `t`,
        `f` the rows and features of the load layout), rows past the sequence's end r_end
        loading its last row (module doc): r0 at or past r_end loads that row alone."""
        return _load_rows(src_h + r0.to(gl.int64) * sx_t,
                          gl.minimum(t, r_end - r0 - 1)[:, None] * sx_t + f[None, :])

    @gluon.jit
    def _cast_rows(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, dst, off8, ok8, c, fast,
                   a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, FP8_MAX: gl.constexpr,
                   out_ty: gl.constexpr, B: gl.constexpr, ACC: gl.constexpr,
                   ST: gl.constexpr, SO: gl.constexpr, ROWS: gl.constexpr,
                   PAIRED: gl.constexpr):
        """One block of ROWS rows of one head, loaded (`_load_rows`; dst at its first row,
        `off8`, `ok8` the offsets and the rows in the sequence in the store layout SO):
        stage 1, stage 2, the cast and the stores (module doc)."""
        zero = gl.zeros([GROUP_G, ROWS], gl.float32, ACC)
        z0 = _stage1(x0, a0, zero, B, ROWS)
        z1 = _stage1(x1, a1, zero, B, ROWS)
        z2 = _stage1(x2, a2, zero, B, ROWS)
        z3 = _stage1(x3, a3, zero, B, ROWS)
        z4 = _stage1(x4, a4, zero, B, ROWS)
        z5 = _stage1(x5, a5, zero, B, ROWS)
        z6 = _stage1(x6, a6, zero, B, ROWS)
        z7 = _stage1(x7, a7, zero, B, ROWS)
        z8 = _stage1(x8, a8, zero, B, ROWS)
        z9 = _stage1(x9, a9, zero, B, ROWS)
        z10 = _stage1(x10, a10, zero, B, ROWS)
        z11 = _stage1(x11, a11, zero, B, ROWS)
        n0, y1, y2, y3, y4, y5, y6, y7, n8, n9, y10, y11 = _h12(z0, z1, z2, z3, z4, z5, z6, z7,
                                                                 z8, z9, z10, z11)
        if fast:
            _store_groups(dst, off8, ok8, c, n0, y1, y2, y3, y4, y5, y6, y7, n8, n9, y10, y11,
                          True, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)
        else:
            _store_groups(dst, off8, ok8, c, n0, y1, y2, y3, y4, y5, y6, y7, n8, n9, y10, y11,
                          False, FP8_MAX, out_ty, ST, SO, ROWS, PAIRED)

    @gluon.jit
    def _head_scale(Partials, which, b, h, bh, heads, splits, FP8_MAX: gl.constexpr,
                    L1: gl.constexpr):
        """triton_heads._head_scale: the NaN-aware max of the `splits` partials (bit patterns,
        sign cleared) / fp8 max, 1 for 0; the same operations, so the same bits."""
        i = gl.arange(0, MAX_SPLITS_G, layout=L1)
        p = gl.load(Partials + (i * 3 * bh + which * bh + b * heads + h).to(gl.int64),
                    mask=i < splits, other=0.0)
        bits = gl.max(p.to(gl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        amax = bits.to(gl.float32, bitcast=True)
        return gl.where(amax == 0, 1.0, gl.div_rn(amax, gl.full([], FP8_MAX, gl.float32)))

    @gluon.jit
    def _grid_wait():
        """griddepcontrol.wait (triton_heads.gdc_wait, in Gluon): the launch this one depends
        on has completed and its stores are visible."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _reciprocal(scale):
        return gl.div_rn(gl.full([], 1.0, gl.float32), scale)

    @gluon.jit
    def _qk_scale(Partials, Descales, which, b, h, bh, heads, splits, jb,
                  FP8_MAX: gl.constexpr, SATURATES: gl.constexpr, L1: gl.constexpr):
        """q's or k's scale of (b, h) (`_head_scale`), stored as its descale by the
        sequence's first program; (c, fast): ROTATION_SCALE / scale and whether every value
        of the head takes the fast cast (module doc)."""
        s = _head_scale(Partials, which, b, h, bh, heads, splits, FP8_MAX, L1)
        if jb == 0:
            gl.store(Descales + (which * bh + b * heads + h), s)
        c = _reciprocal(s) * ROTATION_SCALE_G
        return c, (s <= FAST_LIMIT_G) & (c <= FAST_LIMIT_G) & SATURATES

    # what follows the batch is not specialized on: one variant per model (as the Triton cast)
    @gluon.jit(do_not_specialize=["batch", "splits", "n_q", "n_k"])
    def _gluon_cast_kernel(
        Q, K, V, Q8, K8, V8, Descales, CuQ, CuK, Partials, Rot,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, batch, heads, splits, n_q, n_k,
        FP8_MAX: gl.constexpr, HEADS_PER_PROGRAM: gl.constexpr, BLOCKS: gl.constexpr,
        ROWS_PER_WARP: gl.constexpr, SATURATES: gl.constexpr, PREFETCH: gl.constexpr,
        PAIRED: gl.constexpr, PDL: gl.constexpr = False, QK_FIRST: gl.constexpr = True,
    ):
        """triton_heads._head_cast_kernel with the rotation (the same programs, descales and
        outputs), q and k rotated as the module doc says. Grid ((n_q + 2 n_k) * sequences *
        heads / HEADS_PER_PROGRAM,): the (n_q + n_k) * sequences * groups q and k programs
        first, then the v programs (module doc, "Program order"; QK_FIRST False: program
        fastest, then sequence, then head group); a program casts BLOCKS
        steps of ROWS_PER_WARP (8 or 16) * num_warps rows. SATURATES: FP8_MAX is the fp8 format's own largest value, so the
        conversion's saturation is the clamp (FAST heads); else every head takes the rule's
        clamp. PDL: launched while pass 1 may still run (triton_heads' module doc): the
        operands, the sequence's bounds and (PREFETCH) the first step's rows are loaded
        before `_grid_wait`, the partials after."""
        W: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = ROWS_PER_WARP * W
        ACC: gl.constexpr = _mma_layout(W)
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=2)
        LD: gl.constexpr = _load_layout(W, ROWS)
        ST: gl.constexpr = _store_layout(W, ROWS)
        SO: gl.constexpr = _paired_layout(W, ROWS) if PAIRED else ST
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        # one dimension, the q and k programs first (module doc, "Program order")
        groups = heads // HEADS_PER_PROGRAM
        pid = gl.program_id(0)
        if QK_FIRST:
            heavy = (n_q + n_k) * batch * groups
            if pid < heavy:
                j = pid % (n_q + n_k)
                rest = pid // (n_q + n_k)
            else:
                j = n_q + n_k + (pid - heavy) % n_k
                rest = (pid - heavy) // n_k
        else:
            j = pid % (n_q + 2 * n_k)
            rest = pid // (n_q + 2 * n_k)
        b = rest % batch
        g = rest // batch
        bh = batch * heads
        width: gl.constexpr = 192
        if j < n_q + n_k:
            if j < n_q:
                which = 0
                jb = j
                X = Q
                X8 = Q8
                Cu = CuQ
                sx_t = sq_t
                sx_h = sq_h
            else:
                which = 1
                jb = j - n_q
                X = K
                X8 = K8
                Cu = CuK
                sx_t = sk_t
                sx_h = sk_h
            r_start = gl.load(Cu + b)
            r_end = gl.load(Cu + b + 1)
            first = r_start + jb * (BLOCKS * ROWS)
            if (first < r_end) | (jb == 0):
                out_ty: gl.constexpr = X8.dtype.element_ty
                t = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LD))
                f = gl.arange(0, GROUP_G, layout=gl.SliceLayout(0, LD))
                t8 = gl.arange(0, ROWS, layout=gl.SliceLayout(1, SO))
                f8 = gl.arange(0, GROUP_G, layout=gl.SliceLayout(0, SO))
                off8 = t8[:, None] * (heads * width) + f8[None, :]
                # the 12 constant operands, once per program (6 KB, from L2/L1), kept in
                # registers
                a0 = _load_operand(Rot, 0, A)
                a1 = _load_operand(Rot, 1, A)
                a2 = _load_operand(Rot, 2, A)
                a3 = _load_operand(Rot, 3, A)
                a4 = _load_operand(Rot, 4, A)
                a5 = _load_operand(Rot, 5, A)
                a6 = _load_operand(Rot, 6, A)
                a7 = _load_operand(Rot, 7, A)
                a8 = _load_operand(Rot, 8, A)
                a9 = _load_operand(Rot, 9, A)
                a10 = _load_operand(Rot, 10, A)
                a11 = _load_operand(Rot, 11, A)
                for hh in range(0, HEADS_PER_PROGRAM):
                    h = g * HEADS_PER_PROGRAM + hh
                    src_h = X + h.to(gl.int64) * sx_h
                    if PREFETCH:
                        if first < r_end:
                            # the first step's loads before the scale's (both latencies in
                            # flight at once: a short sequence's program is that chain).
                            # Rows past the sequence's end load its last row (no masked
                            # loads, whose registers would be zeroed first): each accumulator
                            # column is one row's, and their stores are masked off; the step
                            # after the last loads that row too
                            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11 = _load_rows_from(
                                src_h, first, r_end, t, f, sx_t)
                            if PDL:
                                _grid_wait()
                            c, fast = _qk_scale(Partials, Descales, which, b, h, bh, heads,
                                                splits, jb, FP8_MAX, SATURATES, L1)
                            steps = (gl.minimum(r_end - first, BLOCKS * ROWS) + ROWS - 1) // ROWS
                            for i in range(0, steps):
                                r0 = first + i * ROWS
                                n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11 = (
                                    _load_rows_from(src_h, r0 + ROWS, r_end, t, f, sx_t))
                                ok8 = (t8 < r_end - r0)[:, None] & (f8 < GROUP_G)[None, :]
                                dst = X8 + (r0.to(gl.int64) * heads + h) * width
                                _cast_rows(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, dst,
                                           off8, ok8, c, fast, a0, a1, a2, a3, a4, a5, a6, a7,
                                           a8, a9, a10, a11, FP8_MAX, out_ty, B, ACC, ST, SO,
                                           ROWS, PAIRED)
                                x0, x1, x2, x3, x4, x5 = n0, n1, n2, n3, n4, n5
                                x6, x7, x8, x9, x10, x11 = n6, n7, n8, n9, n10, n11
                        else:  # an empty sequence's program: its descale alone
                            if PDL:
                                _grid_wait()
                            _qk_scale(Partials, Descales, which, b, h, bh, heads, splits, jb,
                                      FP8_MAX, SATURATES, L1)
                    else:
                        if PDL:
                            _grid_wait()
                        c, fast = _qk_scale(Partials, Descales, which, b, h, bh, heads, splits,
                                            jb, FP8_MAX, SATURATES, L1)
                        for i in range(0, BLOCKS):
                            r0 = first + i * ROWS
                            if r0 < r_end:
                                ok8 = (t8 < r_end - r0)[:, None] & (f8 < GROUP_G)[None, :]
                                dst = X8 + (r0.to(gl.int64) * heads + h) * width
                                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11 = _load_rows_from(
                                    src_h, r0, r_end, t, f, sx_t)
                                _cast_rows(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, dst,
                                           off8, ok8, c, fast, a0, a1, a2, a3, a4, a5, a6, a7,
                                           a8, a9, a10, a11, FP8_MAX, out_ty, B, ACC, ST, SO,
                                           ROWS, PAIRED)
        else:
            jb = j - n_q - n_k
            r_start = gl.load(CuK + b)
            r_end = gl.load(CuK + b + 1)
            first = r_start + jb * (BLOCKS * ROWS)
            if (first < r_end) | (jb == 0):
                out_ty: gl.constexpr = V8.dtype.element_ty
                LV: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
                t = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LV))
                cv = gl.arange(0, DV_G, layout=gl.SliceLayout(0, LV))
                off = t[:, None] * sv_t + cv[None, :]
                off8 = t[:, None] * (heads * DV_G) + cv[None, :]
                for hh in range(0, HEADS_PER_PROGRAM):
                    h = g * HEADS_PER_PROGRAM + hh
                    if PDL:
                        _grid_wait()
                    s = _head_scale(Partials, 2, b, h, bh, heads, splits, FP8_MAX, L1)
                    if jb == 0:
                        gl.store(Descales + (2 * bh + b * heads + h), s)
                    inv = _reciprocal(s)
                    # v unrotated: |x| <= amax = scale * fp8 max, so a finite scale with a
                    # finite reciprocal leaves no NaN and the conversion's saturation clamps
                    fast = (s <= FAST_LIMIT_G) & (inv <= FAST_LIMIT_G) & SATURATES
                    for i in range(0, BLOCKS):
                        r0 = first + i * ROWS
                        if r0 < r_end:
                            ok = (t < r_end - r0)[:, None] & (cv < DV_G)[None, :]
                            x = gl.load(V + h.to(gl.int64) * sv_h + r0.to(gl.int64) * sv_t + off,
                                        mask=ok, other=0.0).to(gl.float32)
                            dst = V8 + (r0.to(gl.int64) * heads + h) * DV_G + off8
                            if fast:
                                gl.store(dst, _to_fp8(x, inv, True, FP8_MAX, out_ty), mask=ok)
                            else:
                                gl.store(dst, _to_fp8(x, inv, False, FP8_MAX, out_ty), mask=ok)
