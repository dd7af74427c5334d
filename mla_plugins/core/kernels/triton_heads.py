"""Per-(sequence, head) FP8 quantization of q, k and v (`core/fp8.py`'s `head_quantize`), for
the FlashAttention-3 provider, whose FP8 kernel takes one descale per (sequence, head).

One scale per (sequence, head) needs the whole sequence read before its first value is
cast, so two launches (the amax rule's floor: inputs read twice, fp8 written once):
- pass 1 (`_head_bound_kernel`), programs (split, sequence, head group): each reads its
  chunk of the sequence's rows (1 / `splits` of them, 64-row tiles) of q, k and v and writes
  the chunk's amax (rotated q and k: its l1 bound, the largest sum_j |x_j| of its rows times
  ROTATION_SCALE) to `partials [splits, 3, B, H]`; an empty chunk writes 0;
- pass 2 (`_head_cast_kernel`), programs (row blocks of q, of k, of v; sequence; head group):
  each takes the max of its (tensor, sequence, head)'s `splits` partials (NaN-aware, a
  32-wide vector: `MAX_SPLITS`), the scale amax / fp8 max (1 for zero, so 1 for an empty
  sequence), writes it to `descales [3, B, H]` (q, k, v) from the sequence's first block,
  and casts its rows (q and k rotated with `rotate`, as `triton_quant`'s block rule does
  it: `rotation="dense"`, x @ M on the tensor cores with M in shared memory, or "kron",
  Kronecker tiles of 16 x 16 products, `triton_quant.kron_to_fp8`); with "gluon" pass 2 is
  `gluon_rotate`'s Gluon kernel instead (the same grid, descales and outputs, NVIDIA GPUs).

Layouts written are the natural ones FA3 reads: q8 [Tq, H, 192], k8 [Tk, H, 192] (rotated
with `rotate`), v8 [Tk, H, 128], contiguous. Inputs may be strided views (token and head
strides; features contiguous: vLLM's v is a view of a wider tensor). Nothing is read back
from the device and no torch operation runs between the two launches, so
`triton_launch` can record and replay them (wrap this module's kernels first:
`triton_launch.wrap_kernels(triton_heads)`; make `triton_quant.rotation_operand` before
recording, and count it and the partials among the recording's constant buffers).

With PDL (programmatic dependent launch, `head_pdl`: CUDA devices of compute capability 9.0
or later), pass 1 lets pass 2 start early (`griddepcontrol.launch_dependents` at its top)
and pass 2 is launched with the attribute that allows it: its programs load what does not
depend on pass 1 (the Gluon cast's operands and first rows, the sequence bounds) while pass
1 runs, and wait (`griddepcontrol.wait`: pass 1 complete, its stores visible) before the
partials. The next launch (FA3's) is an ordinary one and waits for pass 2 as before. The
Gluon cast runs without PDL by default (PDL_GLUON, measured).

Stored fp8 values are finite (NaN -> 0); a NaN or inf of a (sequence, head) travels in its
descale, which no other (sequence, head) shares. This module imports triton when imported.
"""

from __future__ import annotations

import torch

from . import gluon_rotate as gr
from . import triton_quant as tq

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the provider reports "triton is not installed"
    triton = None

#: the cast of `rotation="gluon"` (gluon_rotate), a name of this module so that
#: `triton_launch.wrap_kernels(triton_heads)` records and replays it with the others
_gluon_cast_kernel = gr._gluon_cast_kernel if gr.gluon is not None else None

#: rows of one tile (pass 1) and of one cast block (pass 2)
HEAD_BLOCK = 64
#: the most chunks a sequence is cut into in pass 1 (pass 2 reduces them as one vector)
MAX_SPLITS = 32
assert gr.MAX_SPLITS == MAX_SPLITS
#: rows below which a chunk is not worth its own program (head_splits): one tile. Measured
#: (benchmarks/NOTES.md, stop 31, H100): 64 in place of 256 took the FA3 provider's fp8 call
#: from 40.0 to 33.0 us at B1-S1024-H16 and 49.8 to 41.2 at B1-S2048-H8 (pass 1 ran 64
#: programs on 132 SMs there), and changes no byte: a partial is a max over its rows
MIN_CHUNK = 64
#: pass-2 blocks one program casts in turn; rotated, each program first fills shared memory
#: with M (72 KB from L2), which more blocks per program amortize
BLOCKS = 1
BLOCKS_ROTATED = 2
#: the dense rotation with `sms` given: up to this many blocks per program where the grid
#: still has CAST_PROGRAMS_PER_SM programs per SM (`rotated_blocks`). Measured on the H200
#: (benchmarks/NOTES.md, stop 25): 8 blocks took the rotated pair from 1.90-1.97 to 2.19-2.25
#: TB/s at B1-S8192-H128 / B8-S2048-H128, and lost at B1-S1024-H16 / B1-S2048-H8 (96 programs);
#: the stored bytes do not depend on it
BLOCKS_ROTATED_MAX = 8
CAST_PROGRAMS_PER_SM = 4
#: software-pipeline stages of a cast program's q and k blocks (`quantize_heads`' `stages`)
#: and the warps of both launches. Measured on the H200 (benchmarks/NOTES.md, stop 27): with
#: the dense rotation, 3 stages at 8 warps took the pair from 2.21-2.27 to 2.50-2.77 TB/s at
#: the H128 shapes, 1.82 -> 2.29 at B16-S512-H16 and 1.96 -> 2.52 at B1-S16384-H16 (2 stages:
#: within 1%; 3 stages at 16 warps: 2.05-2.63); unrotated, stages change nothing (3.2-3.8
#: TB/s either way). ROCm keeps 1 stage and quant_warps (not measured there)
STAGES = 1
STAGES_ROTATED = 3
WARPS_ROTATED = 8
#: warps of pass 1 rotated on CUDA (the l1 bounds), for the dense and the Gluon cast alike:
#: both take their descales from these partials, whose float32 row sums the warps order.
#: 16 (the unrotated pass's) measured against 8 on an H100 (benchmarks/NOTES.md, stop 35):
#: pass 1 faster at B1-S8192-H128 and B16-S512-H16, slower at B8-S2048-H128, and the FA3
#: call's rotation cost worse at three of the four large shapes; so 8, as before
BOUND_WARPS_ROTATED = 8

if triton is not None:
    from .triton_quant import (
        DV_C,
        NOPE_C,
        ROPE_C,
        _imax,
        abs_bits,
        kron_cast,
        l1_bits,
        load_operands,
        load_rows,
        qk_cast,
        reciprocal,
        scale_from_amax,
        store_rows,
        to_fp8,
    )

    HEAD_BLOCK_C = tl.constexpr(HEAD_BLOCK)
    MAX_SPLITS_C = tl.constexpr(MAX_SPLITS)
    ROTATION_SCALE_C = tl.constexpr(tq.ROTATION_SCALE)

    # PTX's grid dependency control, as triton.language.extra.cuda.gdc_* write it (that module
    # is absent from a Triton built for ROCm alone); compiled only where PDL is set
    @triton.jit
    def gdc_launch_dependents():
        """The dependent launch may start once every program of this one got here."""
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def gdc_wait():
        """Wait until the launch this one depends on has completed, its stores visible."""
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _chunk(Cu, b, s, splits):
        """Rows [c0, c1) of sequence b's chunk s of `splits`: ceil-sized and rounded up to
        whole HEAD_BLOCK tiles, so no chunk but the last non-empty one ends in a part tile
        (the last ones may be short or empty)."""
        r0 = tl.load(Cu + b)
        r1 = tl.load(Cu + b + 1)
        size = tl.cdiv(tl.cdiv(r1 - r0, splits), HEAD_BLOCK_C) * HEAD_BLOCK_C
        c0 = tl.minimum(r0 + s * size, r1)
        return c0, tl.minimum(c0 + size, r1)

    @triton.jit
    def _qk_chunk_bound(X, Cu, b, s, h, sx_t, sx_h, splits, ROTATE: tl.constexpr):
        """float32 amax (ROTATE: l1 bound) of chunk s of sequence b, head h, of q or k."""
        c0, c1 = _chunk(Cu, b, s, splits)
        t = tl.arange(0, HEAD_BLOCK_C)
        off = t[:, None] * sx_t
        base = X + h.to(tl.int64) * sx_h
        m = tl.full([], 0, tl.int32)
        for i in tl.range(0, tl.cdiv(c1 - c0, HEAD_BLOCK_C)):
            r = c0 + i * HEAD_BLOCK_C
            xn, xr = load_rows(base + r.to(tl.int64) * sx_t, off, (t < c1 - r)[:, None])
            if ROTATE:
                m = tl.maximum(m, tl.reduce(l1_bits(xn, xr), 0, _imax))
            else:
                b16 = tl.maximum(tl.reduce(abs_bits(xn), 1, _imax), tl.reduce(abs_bits(xr), 1, _imax))
                m = tl.maximum(m, tl.reduce(b16, 0, _imax).to(tl.int32))
        if ROTATE:
            # max_r(sum_r) * c rounds as max_r(sum_r * c) does (triton_quant.bound_scale)
            bound = m.to(tl.float32, bitcast=True) * ROTATION_SCALE_C
        else:
            bound = m.to(tl.int16).to(X.dtype.element_ty, bitcast=True).to(tl.float32)
        return bound

    @triton.jit
    def _v_chunk_amax(V, Cu, b, s, h, sv_t, sv_h, splits):
        c0, c1 = _chunk(Cu, b, s, splits)
        t = tl.arange(0, HEAD_BLOCK_C)
        off = t[:, None] * sv_t + tl.arange(0, DV_C)[None, :]
        base = V + h.to(tl.int64) * sv_h
        m = tl.full([], 0, tl.int32)
        for i in tl.range(0, tl.cdiv(c1 - c0, HEAD_BLOCK_C)):
            r = c0 + i * HEAD_BLOCK_C
            x = tl.load(base + r.to(tl.int64) * sv_t + off, mask=(t < c1 - r)[:, None], other=0.0)
            m = tl.maximum(m, tl.reduce(tl.reduce(abs_bits(x), 1, _imax), 0, _imax).to(tl.int32))
        return m.to(tl.int16).to(V.dtype.element_ty, bitcast=True).to(tl.float32)

    # what follows the batch is not specialized on: one variant per model
    @triton.jit(do_not_specialize=["batch", "splits"])
    def _head_bound_kernel(
        Q, K, V, CuQ, CuK, Partials, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, batch, heads, splits,
        ROTATE: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, PDL: tl.constexpr = False,
        PDL_EARLY: tl.constexpr = True,
    ):
        """Grid (splits, sequences, heads / HEADS_PER_PROGRAM): partials[s, t, b, h] for
        t = q, k, v (module doc). PDL and PDL_EARLY: pass 2 may start at once (it waits for
        this launch's completion before reading the partials); PDL alone: once every
        program of this launch has exited (no trigger)."""
        if PDL and PDL_EARLY:
            gdc_launch_dependents()
        s = tl.program_id(0)
        b = tl.program_id(1)
        g = tl.program_id(2)
        bh = batch * heads
        for hh in tl.range(0, HEADS_PER_PROGRAM, num_stages=1):
            h = g * HEADS_PER_PROGRAM + hh
            dst = Partials + (s * 3 * bh + b * heads + h).to(tl.int64)
            tl.store(dst, _qk_chunk_bound(Q, CuQ, b, s, h, sq_t, sq_h, splits, ROTATE))
            tl.store(dst + bh, _qk_chunk_bound(K, CuK, b, s, h, sk_t, sk_h, splits, ROTATE))
            tl.store(dst + 2 * bh, _v_chunk_amax(V, CuK, b, s, h, sv_t, sv_h, splits))

    @triton.jit
    def _head_scale(Partials, which, b, h, bh, heads, splits, FP8_MAX: tl.constexpr):
        """The scale of tensor `which` (0 q, 1 k, 2 v) for (sequence b, head h) from its
        `splits` partials: their NaN-aware max (bit patterns, sign cleared: non-negative
        floats order as integers, NaN above inf) / fp8 max, 1 for 0."""
        i = tl.arange(0, MAX_SPLITS_C)
        p = tl.load(Partials + (i * 3 * bh + which * bh + b * heads + h).to(tl.int64),
                    mask=i < splits, other=0.0)
        bits = tl.reduce(p.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0, _imax)
        return scale_from_amax(bits.to(tl.float32, bitcast=True), FP8_MAX)

    @triton.jit(do_not_specialize=["batch", "splits", "n_q", "n_k"])
    def _head_cast_kernel(
        Q, K, V, Q8, K8, V8, Descales, CuQ, CuK, Partials, Rot,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, batch, heads, splits, n_q, n_k,
        FP8_MAX: tl.constexpr, ROTATE: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
        BLOCKS: tl.constexpr, KRON: tl.constexpr, KRON_ROWS: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """Grid (n_q + 2 * n_k, sequences, heads / HEADS_PER_PROGRAM): programs j < n_q cast
        q's rows [j * BLOCKS * 64, ...) of the sequence, the next n_k k's, the last n_k v's;
        each sequence's first program of each tensor writes its descales (module doc).
        KRON (with ROTATE): q and k rotated as Kronecker tiles (`triton_quant.kron_cast`,
        Rot `triton_quant.kron_operand`), else x @ M (Rot M). STAGES > 1 (not with KRON):
        the q and k blocks loop has no branch (a block past the sequence's end is all
        masked), so Triton's pipeliner can load the next blocks into shared memory while
        the current one is multiplied and stored. PDL: launched while pass 1 may still run,
        so every program waits for it (`gdc_wait`) before its first partial."""
        j = tl.program_id(0)
        b = tl.program_id(1)
        g = tl.program_id(2)
        bh = batch * heads
        width: tl.constexpr = NOPE_C + ROPE_C
        t = tl.arange(0, HEAD_BLOCK_C)
        if PDL:
            gdc_wait()
        if j < n_q + n_k:
            # q or k: the same code on the one or the other's pointers
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
            r_start = tl.load(Cu + b)
            r_end = tl.load(Cu + b + 1)
            first = r_start + jb * (BLOCKS * HEAD_BLOCK_C)
            if (first < r_end) | (jb == 0):
                out_ty = X8.dtype.element_ty
                off = t[:, None] * sx_t
                off8 = t[:, None] * (heads * width)
                if ROTATE:
                    # once per program, kept across its heads and blocks (dense: M in shared
                    # memory; kron: the 16 x 16 operands)
                    m_nn, m_rn, m_nr, m_rr = load_operands(Rot, KRON)
                else:
                    m_nn, m_rn, m_nr, m_rr = 0, 0, 0, 0
                for hh in tl.range(0, HEADS_PER_PROGRAM, num_stages=1):
                    h = g * HEADS_PER_PROGRAM + hh
                    s = _head_scale(Partials, which, b, h, bh, heads, splits, FP8_MAX)
                    if jb == 0:
                        tl.store(Descales + (which * bh + b * heads + h), s)
                    if STAGES > 1:
                        src_h = X + h.to(tl.int64) * sx_h
                        dst_h = X8 + h * width
                        for i in tl.range(0, BLOCKS, num_stages=STAGES):
                            r0 = first + i * HEAD_BLOCK_C
                            ok = (t < r_end - r0)[:, None]  # none past the end
                            xn, xr = load_rows(src_h + r0.to(tl.int64) * sx_t, off, ok)
                            yn, yr = qk_cast(xn, xr, s, FP8_MAX, out_ty, ROTATE, m_nn, m_rn,
                                             m_nr, m_rr)
                            store_rows(dst_h + r0.to(tl.int64) * heads * width, off8, ok, yn, yr)
                    else:
                        for i in tl.range(0, BLOCKS, num_stages=1):
                            r0 = first + i * HEAD_BLOCK_C
                            if r0 < r_end:
                                ok = (t < r_end - r0)[:, None]
                                src = X + h.to(tl.int64) * sx_h + r0.to(tl.int64) * sx_t
                                dst = X8 + (r0.to(tl.int64) * heads + h) * width
                                if ROTATE and KRON:
                                    kron_cast(src, sx_t, dst, heads * width, r_end - r0,
                                              reciprocal(s) * ROTATION_SCALE_C, m_nn, m_rn,
                                              m_nr, FP8_MAX, out_ty, HEAD_BLOCK_C, KRON_ROWS)
                                else:
                                    xn, xr = load_rows(src, off, ok)
                                    yn, yr = qk_cast(xn, xr, s, FP8_MAX, out_ty, ROTATE, m_nn,
                                                     m_rn, m_nr, m_rr)
                                    store_rows(dst, off8, ok, yn, yr)
        else:
            jb = j - n_q - n_k
            r_start = tl.load(CuK + b)
            r_end = tl.load(CuK + b + 1)
            first = r_start + jb * (BLOCKS * HEAD_BLOCK_C)
            if (first < r_end) | (jb == 0):
                out_ty = V8.dtype.element_ty
                c = tl.arange(0, DV_C)[None, :]
                off = t[:, None] * sv_t + c
                off8 = t[:, None] * (heads * DV_C) + c
                for hh in tl.range(0, HEADS_PER_PROGRAM, num_stages=1):
                    h = g * HEADS_PER_PROGRAM + hh
                    s = _head_scale(Partials, 2, b, h, bh, heads, splits, FP8_MAX)
                    if jb == 0:
                        tl.store(Descales + (2 * bh + b * heads + h), s)
                    inv = reciprocal(s)
                    for i in tl.range(0, BLOCKS, num_stages=1):
                        r0 = first + i * HEAD_BLOCK_C
                        if r0 < r_end:
                            ok = (t < r_end - r0)[:, None]
                            x = tl.load(V + h.to(tl.int64) * sv_h + r0.to(tl.int64) * sv_t + off,
                                        mask=ok, other=0.0)
                            tl.store(V8 + (r0.to(tl.int64) * heads + h) * DV_C + off8,
                                     to_fp8(x, inv, FP8_MAX, out_ty), mask=ok)


#: the rotation the FA3 provider's per-head cast runs (`head_rotation`): "gluon" where it runs,
#: measured faster than "dense" through FA3 at every shape (benchmarks/NOTES.md, stop 30: the
#: rotation's cost +0.3-5% at the large shapes against dense's +5-17%); elsewhere, or None,
#: `triton_quant.ROTATION` (what benchmarks and tests switch to time or check the others)
HEAD_ROTATION: str | None = "gluon"
#: per device: whether the Gluon cast runs (key (type, index)) and whether PDL does ("pdl", index)
_gluon_runs: dict[tuple[str, int | None], bool] = {}


def head_rotation(device: torch.device) -> str:
    """The per-head cast's rotation on `device`: HEAD_ROTATION where set and able to run
    there, else `triton_quant.ROTATION`. Whether Gluon runs is looked up once per device."""
    if HEAD_ROTATION is None:
        return tq.current_rotation()
    if HEAD_ROTATION == "gluon":
        key = (device.type, device.index)
        runs = _gluon_runs.get(key)
        if runs is None:
            runs = _gluon_runs[key] = not gluon_reasons(device)
        if not runs:
            return tq.current_rotation()
    return HEAD_ROTATION


#: programmatic dependent launch of pass 2 after pass 1 (module doc) where `head_pdl` allows
#: it; False: two ordinary launches (what benchmarks switch to compare)
PDL = True
#: with PDL, pass 1 triggers pass 2's launch at its top (its programs then take SM slots
#: while pass 1 runs); False: no trigger, so pass 2's programs start as pass 1's have all
#: exited, its launch still prepared ahead (the trigger's placement measured, NOTES stop 33)
PDL_EARLY = True
#: PDL for the Gluon cast too: measured off (NOTES stop 33: with the early trigger its
#: pass-2 programs take SM slots during pass 1 and undo the q-and-k-first order, without the
#: trigger it gains nothing; two ordinary launches: the two passes 1.1-1.3 us faster at
#: B1-S1024-H16 and B1-S2048-H8 on an H100, 0.4-0.5 us through FA3)
PDL_GLUON = False


def _pdl_capable(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or later, not ROCm (the interpreter's tensors
    are on the CPU); looked up once per device."""
    if device.type != "cuda" or torch.version.hip:
        return False
    key = ("pdl", device.index)
    runs = _gluon_runs.get(key)
    if runs is None:
        runs = _gluon_runs[key] = torch.cuda.get_device_capability(device)[0] >= 9
    return runs


def head_pdl(device: torch.device, gluon: bool = False) -> bool:
    """Whether `quantize_heads` launches its passes with PDL on `device` by default: PDL set
    (and PDL_GLUON where pass 2 is the Gluon cast, `gluon`) and the device able to
    (`_pdl_capable`)."""
    return PDL and (PDL_GLUON or not gluon) and _pdl_capable(device)


def gluon_reasons(device: torch.device) -> list[str]:
    """Why `rotation="gluon"` cannot run on `device` (`gluon_rotate.gluon_reasons`; empty:
    it can). A name of this module, which the compile recorder answers for sm_90."""
    return gr.gluon_reasons(device)


def head_splits(max_len: int, batch: int, heads: int, sms: int) -> int:
    """`splits` for `quantize_heads`: enough chunks per sequence that pass 1 runs ~4
    programs per SM (`sms` multiprocessors), none shorter than MIN_CHUNK rows of the
    longest sequence, at most MAX_SPLITS."""
    programs = max(1, batch * heads)
    want = -(-4 * max(1, sms) // programs)
    return max(1, min(MAX_SPLITS, want, -(-max_len // MIN_CHUNK)))


def rotated_blocks(max_seqlen_q: int, max_seqlen_k: int, batch: int, head_groups: int,
                   sms: int) -> int:
    """64-row blocks per program of the dense rotated cast: the most of BLOCKS_ROTATED_MAX,
    4 and BLOCKS_ROTATED that keeps CAST_PROGRAMS_PER_SM programs per SM (`sms`), else
    BLOCKS_ROTATED."""
    for blocks in (BLOCKS_ROTATED_MAX, 4, BLOCKS_ROTATED):
        rows = HEAD_BLOCK * blocks
        n_q, n_k = max(1, -(-max_seqlen_q // rows)), max(1, -(-max_seqlen_k // rows))
        if (n_q + 2 * n_k) * batch * head_groups >= CAST_PROGRAMS_PER_SM * max(1, sms):
            return blocks
    return BLOCKS_ROTATED


def head_workspace_layout(total_q: int, total_k: int, batch: int, heads: int, splits: int,
                          fp8_dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The regions `quantize_heads` writes, as `Kernel.workspace_layout` lists them
    ([(name, shape, dtype), ...], for `workspace.carve`): its `out` buffers in order."""
    return [
        ("q8", (total_q, heads, tq.NOPE + tq.ROPE), fp8_dtype),
        ("k8", (total_k, heads, tq.NOPE + tq.ROPE), fp8_dtype),
        ("v8", (total_k, heads, tq.DV), fp8_dtype),
        ("descales", (3, batch, heads), torch.float32),
        ("partials", (splits, 3, batch, heads), torch.float32),
    ]


def quantize_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    batch: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    splits: int,
    fp8_dtype: torch.dtype,
    *,
    rotate: bool,
    rotation: str | None = None,
    fp8_max: float | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
    heads_per_program: int = 1,
    num_warps: int | None = None,
    blocks: int | None = None,
    kron_rows: int = tq.KRON_ROWS,
    sms: int | None = None,
    stages: int | None = None,
    rows_per_warp: int | None = None,
    prefetch: bool | None = None,
    paired_stores: bool | None = None,
    pdl: bool | None = None,
    qk_first: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """(q8 [Tq, H, 192], k8 [Tk, H, 192], v8 [Tk, H, 128], descales float32 [3, B, H] (q, k,
    v), partials float32 [splits, 3, B, H]): `fp8.head_quantize` of q, k (rotated with
    `rotate`, as `rotation` says: "dense", "kron" or "gluon", `triton_quant.ROTATIONS`) and v
    in two launches (module doc; "gluon": pass 2 is `gluon_rotate._gluon_cast_kernel`, on
    NVIDIA GPUs only, ValueError naming `rotation` elsewhere, `gluon_reasons`).

    q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128]: bf16/fp16, any token and head strides,
    contiguous features. `cu_seqlens_*` int32 on q's device; `batch`, the longest lengths
    and `splits` (1 ... MAX_SPLITS, `head_splits`) from the host, so nothing is read back.
    `out`: the five buffers to write into (`head_workspace_layout`), else allocated.
    `fp8_max` overrides the format's largest value (the interpreter's fp16 storage).
    `heads_per_program`, `num_warps` (`triton_quant.quant_warps` by default) and `blocks`
    (64-row blocks per pass-2 program) are tuning knobs, and `kron_rows` (rows of one
    Kronecker tile, `triton_quant.KRON_ROWS`) with "kron"; as for `triton_quant.quantize_qkv`,
    the amax rule's outputs do not depend on them, the rotated ones at most by the order of
    float32 sums. `sms` (the device's SM count) lets the dense rotated cast take
    `rotated_blocks` blocks per program (None: BLOCKS_ROTATED). `stages` > 1 pipelines the
    q and k blocks of a program (`_head_cast_kernel`; None: STAGES_ROTATED at WARPS_ROTATED
    warps for the dense rotation on CUDA, pass 1 at BOUND_WARPS_ROTATED, else STAGES, or 1
    with "kron" and "gluon"). With "gluon", `num_warps` is the cast's alone
    (`gluon_rotate.NUM_WARPS` by default) and pass 1 runs as the dense rotation's
    (BOUND_WARPS_ROTATED); `rows_per_warp` (8 or 16, default
    `gluon_rotate.ROWS_PER_WARP`) is the rows each warp casts per step, `prefetch` and
    `paired_stores` (default `gluon_rotate.PREFETCH`, `PAIRED_STORES`) its load pipelining
    and store width, `qk_first` (default `gluon_rotate.QK_FIRST`) its programs' order; the
    bytes do not depend on any of them. `pdl`: pass 2 launched as pass 1's programmatic
    dependent (module doc; None: `head_pdl`, off for the Gluon cast by default, True where
    it cannot run: ValueError naming `pdl`).
    """
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits: found {splits}, expected 1 ... {MAX_SPLITS} (head_splits)")
    kron = tq.check_rotation(rotation, kron_rows)
    glu = bool(rotate) and tq.current_rotation(rotation) == "gluon"
    if glu:
        reasons = gluon_reasons(q.device)
        if reasons:
            raise ValueError("rotation: found 'gluon', which cannot run here ("
                             + "; ".join(reasons) + "); pass rotation='dense' or 'kron'")
    # the dense rotation on CUDA: the pipelined cast at 8 warps (measured, STAGES_ROTATED)
    tuned = bool(rotate) and not kron and not glu and not tq.on_rocm(q.device)
    if stages is None:
        stages = STAGES_ROTATED if tuned else 1 if rotate and (kron or glu) else STAGES
    if stages < 1 or (stages > 1 and rotate and (kron or glu)):
        raise ValueError(f"stages: found {stages}, expected 1 or more, and 1 with rotation="
                         f"'{tq.current_rotation(rotation)}'")
    for name, x, width in (("q", q, tq.NOPE + tq.ROPE), ("k", k, tq.NOPE + tq.ROPE), ("v", v, tq.DV)):
        if x.dim() != 3 or x.shape[2] != width or x.stride(2) != 1:
            raise ValueError(f"{name}: found shape {tuple(x.shape)} with strides {x.stride()}, "
                             f"expected [T, H, {width}] with contiguous features")
    total_q, total_k, heads = q.shape[0], k.shape[0], q.shape[1]
    if out is None:
        dev = q.device
        out = tuple(torch.empty(shape, dtype=dtype, device=dev) for _, shape, dtype in
                    head_workspace_layout(total_q, total_k, batch, heads, splits, fp8_dtype))
    q8, k8, v8, descales, partials = out
    if batch == 0 or heads == 0:
        return q8, k8, v8, descales, partials
    if pdl is None:
        pdl = head_pdl(q.device, gluon=glu)
    elif pdl and not _pdl_capable(q.device):
        raise ValueError(f"pdl: found True on {q.device}, expected False: programmatic "
                         f"dependent launch needs a CUDA device of compute capability 9.0 or later")
    pdl = bool(pdl)
    limit = fp8_max if fp8_max is not None else float(torch.finfo(fp8_dtype).max)
    hpp = max(d for d in range(1, max(1, heads_per_program) + 1) if heads % d == 0)
    if num_warps is not None and not glu:
        warps = bound_warps = num_warps
    else:
        warps = WARPS_ROTATED if tuned or glu else tq.quant_warps(q.device, rotate, rotation)
        # gluon: pass 1 as the dense rotation's on CUDA, so the partials (each row's float32
        # l1 sum, in an order the warps decide) and the descales are its bits
        bound_warps = BOUND_WARPS_ROTATED if tuned or glu else warps
    _head_bound_kernel[(splits, batch, heads // hpp)](
        q, k, v, cu_seqlens_q, cu_seqlens_k, partials, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), batch, heads, splits,
        ROTATE=bool(rotate), HEADS_PER_PROGRAM=hpp, PDL=pdl, PDL_EARLY=bool(PDL_EARLY),
        num_warps=bound_warps,
    )
    if blocks is None:
        # dense: M's 72 KB load per program, which more blocks amortize (`rotated_blocks`
        # where the caller gives the SM count `sms`); gluon: its 6 KB of operands, the
        # same way (not measured apart); kron: 1.5 KB
        if rotate and not kron:
            blocks = (BLOCKS_ROTATED if sms is None else
                      rotated_blocks(max_seqlen_q, max_seqlen_k, batch, heads // hpp, sms))
        else:
            blocks = BLOCKS
    rows = HEAD_BLOCK * blocks
    cast_warps = (num_warps or gr.NUM_WARPS) if glu else warps
    if glu:
        per_warp = gr.ROWS_PER_WARP if rows_per_warp is None else rows_per_warp
        step = per_warp * cast_warps
        if per_warp not in (8, 16) or rows % step:
            raise ValueError(f"rows_per_warp: found {per_warp} at {cast_warps} warps, expected "
                             f"8 or 16 with steps of rows_per_warp * num_warps rows dividing "
                             f"the {rows} rows of {blocks} blocks")
    # at least one program per sequence and tensor: an empty sequence still writes descales
    n_q = max(1, -(-max_seqlen_q // rows))
    n_k = max(1, -(-max_seqlen_k // rows))
    rot = tq.rotation_operand(q.device, q.dtype, rotation) if rotate else q
    # the launch option only where it is on: ROCm's backend has no such option
    launch = {"launch_pdl": True} if pdl else {}
    if glu:
        # one dimension, q and k programs first (gluon_rotate's module doc, "Program order")
        _gluon_cast_kernel[((n_q + 2 * n_k) * batch * (heads // hpp),)](
            q, k, v, q8, k8, v8, descales, cu_seqlens_q, cu_seqlens_k, partials, rot,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            batch, heads, splits, n_q, n_k,
            FP8_MAX=limit, HEADS_PER_PROGRAM=hpp, BLOCKS=rows // step,
            ROWS_PER_WARP=per_warp, SATURATES=limit == float(torch.finfo(fp8_dtype).max),
            PREFETCH=gr.PREFETCH if prefetch is None else bool(prefetch),
            PAIRED=gr.PAIRED_STORES if paired_stores is None else bool(paired_stores),
            PDL=pdl, QK_FIRST=gr.QK_FIRST if qk_first is None else bool(qk_first),
            num_warps=cast_warps, **launch,
        )
        return q8, k8, v8, descales, partials
    _head_cast_kernel[(n_q + 2 * n_k, batch, heads // hpp)](
        q, k, v, q8, k8, v8, descales, cu_seqlens_q, cu_seqlens_k, partials, rot,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        batch, heads, splits, n_q, n_k,
        FP8_MAX=limit, ROTATE=bool(rotate), HEADS_PER_PROGRAM=hpp, BLOCKS=blocks,
        KRON=bool(rotate) and kron, KRON_ROWS=kron_rows, STAGES=stages, PDL=pdl,
        num_warps=warps, **launch,
    )
    return q8, k8, v8, descales, partials
