"""Phase 1 of the Triton kernel: partial attention over the plan's work items (fp8 and bf16).

One program computes one `BLOCK_M`-row slice of one work item for one head: rows
`[m0, m0 + BLOCK_M)` of the item's query tile against its keys `[kv_start, kv_end)`.
The 192-wide query/key head is two tensor-core products, a 128-wide "nope" dot and a
64-wide "rope" dot accumulated into the same float32 scores; softmax runs in float32 in
the log2 domain (`exp2`), online over `BLOCK_N`-key blocks as in FlashAttention-2.

The key loop is cut in two: blocks every row of the slice fully sees (no mask, the bulk
of the work), then the blocks on the causal diagonal / at `kv_end`, masked. A row that
sees no key keeps `l = 0` and ends with out 0 and lse -inf; the max used for the
exponent is 0 for such rows so nothing computes `-inf - -inf`.

fp8 (core/fp8.py's block rule): q, k and v come quantized from `triton_quant.quantize_qkv`
(q8 and the scale of each 64-row q block at each of its rows, read at the slice's first row;
k8, v transposed, their scales per 128-key block; q and k rotated or not, which the
attention does not need to know: q R (k R)^T = q k^T). P is cast to fp8 for the P @ V product with its exponent shifted
by +8 (`P_SHIFT`, values up to 256 instead of 1), which keeps small probabilities out
of the fp8 subnormal range at no cost (the shift cancels in out = acc / l and is taken
off the lse).

Loads of k and v use TMA tensor descriptors on Hopper (`USE_TMA`), plain pointer loads
elsewhere (and in the interpreter).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the provider reports "triton is not installed"
    triton = None


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

#: Phase-1 launch shape per device arch and compute mode: (block_m, block_n, num_warps,
#: num_stages). Chosen so that no configuration spills on its arch (tests/compile compiles
#: each one for sm_90, gfx942 and gfx950 and fails on spills; figures in benchmarks/NOTES.md).
#: "cuda" covers every NVIDIA arch (measured on the H200, sm_90); the ROCm entries keep the
#: VGPR count under 256 where 8 warps run (two waves per SIMD) and BLOCK_M at 64 in fp8,
#: the query block of core/fp8.py's block-scaling rule.
ARCH_CONFIGS: dict[str, dict[bool, tuple[int, int, int, int]]] = {
    "cuda": {True: (64, 64, 4, 4), False: (128, 64, 8, 3)},
    "gfx942": {True: (64, 32, 4, 2), False: (128, 32, 8, 2)},
    "gfx950": {True: (64, 32, 4, 2), False: (128, 32, 8, 2)},
}


def arch_config(arch: str, fp8: bool) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for a device arch ("cuda", "gfx942", ...)."""
    return ARCH_CONFIGS.get(arch, ARCH_CONFIGS["cuda"])[fp8]

if triton is not None:
    from .triton_quant import DV_C, NOPE_C, ROPE_C, SCALE_BLOCK_C, SIDE_C, in_v_order

    LN2_C = tl.constexpr(LN2)

    @triton.jit
    def _load_k(K, Kr, row0, head, sk_t, sk_h, kv_end, MASK_ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
        """k tile rows [row0, row0 + BLOCK_N) of one head: ([BLOCK_N, 128], [BLOCK_N, 64])."""
        if USE_TMA:
            # the descriptors span [T, (H - 1) * sk_h + 192]: a head starts sk_h columns on
            kn = K.load([row0, head * sk_h])
            kr = Kr.load([row0, head * sk_h + NOPE_C])
        else:
            n = row0 + tl.arange(0, BLOCK_N)
            base = K + n.to(tl.int64)[:, None] * sk_t + head.to(tl.int64) * sk_h
            if MASK_ROWS:
                ok = (n < kv_end)[:, None]
                kn = tl.load(base + tl.arange(0, NOPE_C)[None, :], mask=ok, other=0.0)
                kr = tl.load(base + NOPE_C + tl.arange(0, ROPE_C)[None, :], mask=ok, other=0.0)
            else:
                kn = tl.load(base + tl.arange(0, NOPE_C)[None, :])
                kr = tl.load(base + NOPE_C + tl.arange(0, ROPE_C)[None, :])
        return kn, kr

    @triton.jit
    def _load_v(V, row0, head, sv_t, sv_h, vt_stride, kv_end, MASK_ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, FP8: tl.constexpr, USE_TMA: tl.constexpr):
        """v tile [BLOCK_N, 128]; in fp8 it comes from the transposed copy [H * 128, T]."""
        # fp8: a TMA load of the transposed copy starts at token `row0` in its innermost dim;
        # on the H200 that faults (illegal instruction) unless row0 is 16-aligned, so the
        # host passes USE_TMA=False for v when some item starts unaligned.
        if FP8:
            if USE_TMA:
                vt = V.load([head * DV_C, row0])
            else:
                n = row0 + tl.arange(0, BLOCK_N)
                ptr = V + (head * DV_C + tl.arange(0, DV_C)).to(tl.int64)[:, None] * vt_stride + n[None, :]
                if MASK_ROWS:
                    vt = tl.load(ptr, mask=(n < kv_end)[None, :], other=0.0)
                else:
                    vt = tl.load(ptr)
            v = tl.trans(vt)
        else:
            if USE_TMA:
                v = V.load([row0, head * sv_h])
                if MASK_ROWS:
                    # the box's rows past kv_end are the next sequence's: their p is 0, but
                    # 0 * inf is NaN, so one request's inf would reach another's output
                    n = row0 + tl.arange(0, BLOCK_N)
                    v = tl.where((n < kv_end)[:, None], v, 0.0)
            else:
                n = row0 + tl.arange(0, BLOCK_N)
                ptr = V + n.to(tl.int64)[:, None] * sv_t + head.to(tl.int64) * sv_h + tl.arange(0, DV_C)[None, :]
                if MASK_ROWS:
                    v = tl.load(ptr, mask=(n < kv_end)[:, None], other=0.0)
                else:
                    v = tl.load(ptr)
        return v

    @triton.jit
    def _attend_blocks(
        acc, l_i, m_i, c_v, q_nope, q_rope, K, Kr, V, SBase, ss_w, vshift,
        lo, n_blocks, offs_m, head, kv_start, kv_end, kv_offset, qk_scale,
        sk_t, sk_h, sv_t, sv_h, vt_stride, q_side, KSide, side_t,
        causal, MASKED: tl.constexpr, FP8: tl.constexpr, P_SHIFT: tl.constexpr,
        BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, V_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
        V_PERM: tl.constexpr, OUTLIERS: tl.constexpr,
    ):
        """Online softmax over `n_blocks` key blocks starting at row `lo`.

        MASKED: keys at or past `kv_end` and, when causal, past each row's diagonal are
        masked. fp8: each block's k scale multiplies its scores; acc is kept in units of the
        last block's v scale `c_v` (the rescale rides on alpha), so a block's v scale costs
        one multiply per row, not a second accumulator. `SBase` points at the k scale of
        the item's first 128-key scale block (its v scale `ss_w` further); the next scale
        block's are 8 entries on (a scale row has one entry per 16 columns). `vshift` moves a key
        row to its column of the transposed fp8 v (triton_quant). V_PERM: that copy holds
        its keys in `triton_quant.key_of_column` order, and P takes the same order.
        OUTLIERS (fp8, core/fp8.py's fp8_outliers): the block's side tile [BLOCK_N, 32] (fp8,
        the corrections in the fp8 product's units) times q's, `q_side`, accumulated onto the
        scores after the two fp8 products (one more 32-deep fp8 step).
        """
        p_ty = q_nope.dtype
        for i in tl.range(0, n_blocks, warp_specialize=WARP_SPEC):
            start = lo + i * BLOCK_N
            if FP8:
                sptr = SBase + ((start - kv_start) // SCALE_BLOCK_C) * (SCALE_BLOCK_C // 16)
                s_k = tl.load(sptr)
                s_v = tl.load(sptr + ss_w)
                blk_scale = qk_scale * s_k
                vcol = start + vshift
            else:
                s_v = 1.0
                blk_scale = qk_scale
                vcol = start
            kn, kr = _load_k(K, Kr, start, head, sk_t, sk_h, kv_end, MASKED, BLOCK_N, USE_TMA)
            s = tl.dot(q_nope, tl.trans(kn))
            s = tl.dot(q_rope, tl.trans(kr), s)
            if OUTLIERS:
                keys = start + tl.arange(0, BLOCK_N)
                ks = tl.load(KSide + keys.to(tl.int64)[:, None] * side_t + head * SIDE_C
                             + tl.arange(0, SIDE_C)[None, :], mask=(keys < kv_end)[:, None], other=0.0)
                s = tl.dot(q_side, tl.trans(ks), s)
            if MASKED:
                cols = start + tl.arange(0, BLOCK_N)
                visible = cols[None, :] < kv_end
                visible = visible & ((cols[None, :] <= offs_m[:, None] + kv_offset) | (causal == 0))
                s = tl.where(visible, s * blk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # rows with nothing visible yet keep m = -inf; exponentiate against 0 instead
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - (m_use - P_SHIFT)[:, None])
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1) * blk_scale)
                m_use = m_new
                p = tl.math.exp2(s * blk_scale - (m_use - P_SHIFT)[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP8:
                acc = acc * (alpha * (c_v / s_v))[:, None]
                c_v = s_v
            else:
                acc = acc * alpha[:, None]
            v_end = kv_end + (vcol - start)
            if V_PERM:
                # a column of the sequence's last 16-group may hold a key before kv_end;
                # its keys past kv_end read finite values (fp8 stores) with p = 0
                v_end = (v_end + 15) // 16 * 16
            v = _load_v(V, vcol, head, sv_t, sv_h, vt_stride, v_end, MASKED, BLOCK_N, FP8, V_TMA)
            if V_PERM:
                p = in_v_order(p, BLOCK_N)
            acc = tl.dot(p.to(p_ty), v, acc)
            m_i = m_new
        return acc, l_i, m_i, c_v

    # what varies from batch to batch of one model is not specialized on (ss_w: the scale rows'
    # length), so one model compiles one variant
    @triton.jit(do_not_specialize=["ss_w", "sl_t", "sl_h", "spl_t", "spl_h", "num_sub", "causal",
                                   "has_lse"])
    def mla_prefill_kernel(
        Q, K, Kr, V, Out, Lse, PartO, PartLse, WorkInfo, Scales, QScales, QSide, KSide,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, vt_stride, ss_w, sqs_t, side_t,
        so_t, so_h, sl_t, sl_h, spo_t, spo_h, spl_t, spl_h,
        qk_scale, num_sub, causal, has_lse,
        FP8: tl.constexpr, P_SHIFT: tl.constexpr,
        USE_TMA: tl.constexpr, V_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_PERM: tl.constexpr,
        OUTLIERS: tl.constexpr = False,
    ):
        """Grid: (num_items * num_sub, heads per cluster).

        fp8: Q is q8 and QScales [Tq, H] (row stride sqs_t) the q scales of
        `triton_quant.quantize_qkv`; BLOCK_M is the 64-row query block of core/fp8.py and
        the host guarantees that tiles start at multiples of it from the sequence start (so
        the slice's first row m0 holds its block's scale); key blocks step from
        `kv_start` (a multiple of 128 keys, the k/v scale block, from the sequence start)
        by BLOCK_N dividing 128. OUTLIERS: QSide [Tq, H, 32] and KSide [Tk, H, 32] (row stride
        side_t) the side tiles of `triton_quant.write_outlier_sides`, in q8's dtype.
        """
        pid = tl.program_id(0)
        item = pid // num_sub
        sub = pid % num_sub
        wi = WorkInfo + item * 8
        batch = tl.load(wi)
        loc = tl.load(wi + 1)
        qo_start = tl.load(wi + 2)
        qo_end = tl.load(wi + 3)
        kv_start = tl.load(wi + 4)
        kv_end = tl.load(wi + 5)
        kv_offset = tl.load(wi + 6)
        head_range = tl.load(wi + 7)
        head = (head_range & 0xFFFF) + tl.program_id(1)
        m0 = qo_start + sub * BLOCK_M
        if (head < (head_range >> 16)) & (m0 < qo_end):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < qo_end
            q_ptr = Q + offs_m.to(tl.int64)[:, None] * sq_t + head.to(tl.int64) * sq_h
            q_nope = tl.load(q_ptr + tl.arange(0, NOPE_C)[None, :], mask=row_ok[:, None], other=0.0)
            q_rope = tl.load(q_ptr + NOPE_C + tl.arange(0, ROPE_C)[None, :], mask=row_ok[:, None], other=0.0)
            if FP8:
                scale = qk_scale * tl.load(QScales + m0.to(tl.int64) * sqs_t + head)
            else:
                scale = qk_scale
            if OUTLIERS:
                q_side = tl.load(QSide + offs_m.to(tl.int64)[:, None] * side_t + head * SIDE_C
                                 + tl.arange(0, SIDE_C)[None, :], mask=row_ok[:, None], other=0.0)
            else:
                q_side = 0

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, DV_C], dtype=tl.float32)
            c_v = 1.0
            if FP8:
                vshift = 16 * batch - kv_start % 16
                sbase = Scales + head * (vt_stride // 16) + (kv_start + vshift) // 16
            else:
                vshift = 0
                sbase = Scales

            # keys every row of the slice sees: up to the diagonal of its first row
            if causal != 0:
                full_end = tl.minimum(kv_end, m0 + kv_offset + 1)
                last_row = tl.minimum(m0 + BLOCK_M, qo_end) - 1
                hi = tl.minimum(kv_end, last_row + kv_offset + 1)
            else:
                full_end = kv_end
                hi = kv_end
            n_full = tl.maximum(full_end - kv_start, 0) // BLOCK_N
            acc, l_i, m_i, c_v = _attend_blocks(
                acc, l_i, m_i, c_v, q_nope, q_rope, K, Kr, V, sbase, ss_w, vshift,
                kv_start, n_full, offs_m, head, kv_start, kv_end, kv_offset, scale,
                sk_t, sk_h, sv_t, sv_h, vt_stride, q_side, KSide, side_t,
                causal, False, FP8, P_SHIFT, BLOCK_N, USE_TMA, V_TMA, WARP_SPEC, V_PERM, OUTLIERS,
            )
            lo = kv_start + n_full * BLOCK_N
            n_masked = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
            acc, l_i, m_i, c_v = _attend_blocks(
                acc, l_i, m_i, c_v, q_nope, q_rope, K, Kr, V, sbase, ss_w, vshift,
                lo, n_masked, offs_m, head, kv_start, kv_end, kv_offset, scale,
                sk_t, sk_h, sv_t, sv_h, vt_stride, q_side, KSide, side_t,
                causal, True, FP8, P_SHIFT, BLOCK_N, USE_TMA, V_TMA, False, V_PERM, OUTLIERS,
            )

            seen = l_i > 0
            inv = tl.where(seen, c_v / tl.where(seen, l_i, 1.0), 0.0)
            o = acc * inv[:, None]
            lse = tl.where(seen, (m_i - P_SHIFT + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2_C, float("-inf"))
            offs_m64 = offs_m.to(tl.int64)
            cols = tl.arange(0, DV_C)
            if loc < 0:
                o_ptr = Out + offs_m64[:, None] * so_t + head.to(tl.int64) * so_h + cols[None, :]
                tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=row_ok[:, None])
                if has_lse != 0:
                    tl.store(Lse + offs_m64 * sl_t + head * sl_h, lse, mask=row_ok)
            else:
                prow = (loc + offs_m - qo_start).to(tl.int64)
                tl.store(PartO + prow[:, None] * spo_t + head.to(tl.int64) * spo_h + cols[None, :], o,
                         mask=row_ok[:, None])
                tl.store(PartLse + prow * spl_t + head * spl_h, lse, mask=row_ok)
