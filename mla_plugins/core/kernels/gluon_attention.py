"""Phase 1 of the prefill on Hopper, in Gluon: FA3's schedule, the Triton kernel's contract.

Same inputs and outputs as `triton_attention.mla_prefill_kernel`: the plan's work items, lse
for every row, bottom-right causal masking, partial rows for split tiles, the 192 = 128 + 64
split of the query/key head as two products into the same scores. Two modes (`FP8`):
- fp8: q, k and transposed v in block-scaled fp8 with their scales from
  `triton_quant.quantize_qkv` (one q scale per 64-row block, read at the block's first row);
- 16-bit (bf16/fp16, `FP8` False): the caller's q, k and v as they are (k and v through TMA
  descriptors on their own strides, vLLM's v view included), no scales; v is the B operand
  of P @ V in its natural [keys, Dv] layout (wgmma reads 16-bit B transposed), P the A
  operand straight from the scores' registers (for 16-bit types the accumulator layout is
  the A operand's: FA3's "MmaPV_is_RS"). Two stages of 80 KB fit beside the 48 KB of q
  (FA3's bf16 configuration for head dim 192: 128 x 128 tiles, two stages).

One CTA computes one `BLOCK_M` = 128-row slice of one work item for one head, in three
warp-specialized partitions (`gl.warp_specialize`):
- a producer warp issues the TMA loads of each `BLOCK_N`-key block (k nope, k rope, v; in
  fp8 v transposed and the block one k and one v scale block of core/fp8.py) into a ring of
  `NUM_STAGES` shared-memory stages, one `ready` mbarrier per stage (`SPLIT_KV`: one for k
  and one for v, k of the next block loaded before v of this one, FA3's order);
- two consumer warpgroups, one per 64-row q block (the block of core/fp8.py's scaling rule),
  read every stage; each releases it (`empty`, two arrivals) once its P @ V is done
  (`SPLIT_KV`: k once its q k^T is done, v once its P @ V is). A
  consumer loads its q block into shared memory (the wgmma A operand) and overlaps the
  softmax of key block j with the P @ V product of block j - 1 (async wgmma: FA3's
  intra-warpgroup pipelining). The two warpgroups synchronize with nothing but the stages;
  `PINGPONG` makes them take turns issuing their products (FA3's inter-warpgroup schedule),
  which measured within 1-3% of not doing it here (benchmarks/NOTES.md).

One CTA per unit by default (the hardware schedules them as CTAs finish); `PERSISTENT`
launches one per SM looping over the units in a fixed zigzag order, longest first within
groups of heads whose k/v fit in the L2. Its first form (all heads of a slice in turn:
the CTAs running at once read every head's k/v) lost 10-25% to the dynamic scheduling at
the long shapes; the grouped order wins on batches of several sequences (+5-18%) and is
within -5..+2% on one (benchmarks/NOTES.md), so `batch_config` took it for the former until
stop 42, when one CTA per unit with the later knobs (q by TMA, the late rescale, the row sums
by the tensor cores) measured 6-8% faster there.

Register budget (`maxnreg` at launch): 12 warps (the producer's warpgroup included) share
64K registers: 240 per consumer thread, 24 per producer thread. In 16-bit mode P's operand
takes 32 registers a thread (fp8: 16), so 128-key steps carry P packed two values to a
register (`_carry`: float32 P, its operand and the next block's in-flight scores do not fit
together). Stop 28 measured 128-key steps over two stages at 0.62-0.82x FA3 bf16 against
0.79-1.06x for 64-key steps over four and took the latter; with `SPLIT_KV` the 128-key steps
measured 5.8-9.2% faster than them at the large shapes, and `GLUON_BF16_CONFIG` takes them
since stop 43 (benchmarks/NOTES.md).

Barriers: Triton 3.6 puts a 128-thread `bar.sync` before each consumer's mbarrier arrive and
wait (two a key block in fp8, three in 16-bit with `SPLIT_KV`). `LEAN_SYNC` (a version
number, 0 for off) marks a compile whose PTX `gluon_sync.lean_ptx` rewrites without them, as
CUTLASS's pipelines release a stage from one thread; the kernel's code is the same either way.

Both warpgroups consume every stage in the same order: a key block past one group's
diagonal (the second group's rows reach 64 keys further) is computed masked to nothing.

Isolation (one sequence's values never reach another's result): TMA reads whole 128-key
blocks, so a unit's last block can hold the next sequence's keys (or the next split piece's).
Their scores are masked to -inf, so P is 0 there, but 0 times an inf or NaN value row is NaN.
The fp8 path's v never holds one (the quantization stores non-finite values as 0); in 16-bit
mode each consumer zeroes the rows of such a block past the unit's keys in shared memory
before its P @ V reads them (`_zero_tail`).
"""

from __future__ import annotations

try:
    import triton  # noqa: F401  (the package gate: gluon ships inside triton)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - triton missing or without gluon
    gluon = None

#: query rows per CTA (two warpgroups of 64) and keys per step (one k/v scale block)
BLOCK_M = 128
BLOCK_N = 128
NUM_STAGES = 3
#: warps of the default partition (the first consumer); the launch's register cap
NUM_WARPS = 4
#: the CTA's warps: 4 + 4 consumers, the producer warp's warpgroup
TOTAL_WARPS = 12
MAXNREG = 168
CONSUMER_REGS = 240
PRODUCER_REGS = 24
#: SUM_MMA: columns of the row sums' B operand and accumulator (wgmma's smallest N is 8)
SUM_COLS = 8
#: SUM_MMA: the row sums read a register copy of P (xor with a runtime 0, which ptxas cannot
#: fold as it folds a move), so no register is read by the two products in flight; a
#: diagnostic's knob (stop 39, benchmarks/NOTES.md)
SUM_COPY_A = 0

if gluon is not None:
    NOPE_G = gl.constexpr(128)
    ROPE_G = gl.constexpr(64)
    DV_G = gl.constexpr(128)
    SIDE_G = gl.constexpr(32)  # core/fp8.py's OUTLIER_WIDTH
    HALF_G = gl.constexpr(64)
    LN2_G = gl.constexpr(0.6931471805599453)
    NUM_WARPS_G = gl.constexpr(NUM_WARPS)
    SUM_COLS_G = gl.constexpr(SUM_COLS)
    SUM_COPY_A_G = gl.constexpr(SUM_COPY_A)
    E4M3_ONE_G = gl.constexpr(0x38)  # 1.0 in float8_e4m3fn: sign 0, exponent 7 (bias 7), mantissa 0

    @gluon.jit
    def _in_v_order(p, BLOCK_N: gl.constexpr):
        """triton_quant.in_v_order: p's columns in vt8's key order, so that the conversion
        to the A operand of P @ V moves no value between threads (triton_quant's doc)."""
        p6 = gl.reshape(p, [HALF_G, BLOCK_N // 16, 2, 2, 2, 2])
        return gl.reshape(gl.permute(p6, (0, 1, 3, 4, 2, 5)), [HALF_G, BLOCK_N])

    @gluon.jit
    def _p_operand(p, KV_DTYPE: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """P (float32, the scores' layout) as the fp8 A operand of P @ V, in vt8's key order."""
        return gl.convert_layout(_in_v_order(p.to(KV_DTYPE), BLOCK_N), p_layout)

    @gluon.jit
    def _pv(p, v_buf, acc, KV_DTYPE: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
            FP8: gl.constexpr):
        """Issue acc += P @ V (async) for one key block: fp8, P (float32) cast into vt8's key
        order against the transposed v stage [Dv, keys]; 16-bit, P (the A operand already,
        `_operand`) against the v stage [keys, Dv]."""
        if FP8:
            return warpgroup_mma(_p_operand(p, KV_DTYPE, p_layout, BLOCK_N),
                                 v_buf.permute((1, 0)), acc, is_async=True)
        else:
            return warpgroup_mma(p, v_buf, acc, is_async=True)

    @gluon.jit
    def _pv_and_sums(p, v_buf, acc, zero_l, ones_smem, nonneg, KV_DTYPE: gl.constexpr,
                     p_layout: gl.constexpr, pl_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """fp8 with SUM_MMA: issue P @ ones (this block's row sums, into a fresh accumulator:
        `zero_l`, not read), then acc += P @ V, both async from one cast of P (float32, the
        scores' layout); returns their tokens. Fresh, so that l is carried in float32 (the
        caller folds each block's sums in), not in the fp8 products' accumulator, which keeps
        fewer bits than float32 (NOTES, stop 39). SUM_COPY_A: the sums read a copy of P's
        registers (xor with `nonneg >> 31`: 0 for the never-negative int the caller passes,
        which ptxas cannot prove 0)."""
        a8 = _p_operand(p, KV_DTYPE, p_layout, BLOCK_N)
        a8_l = gl.convert_layout(a8, pl_layout)
        if SUM_COPY_A_G != 0:
            zeros = gl.full([HALF_G, BLOCK_N], (nonneg >> 31).to(gl.int8), gl.int8, pl_layout)
            a8_l = gl.inline_asm_elementwise("xor.b32 $0, $1, $2;", "=r,r,r", [a8_l, zeros],
                                             dtype=a8_l.dtype, is_pure=False, pack=4)
        l_tok = warpgroup_mma(a8_l, ones_smem.permute((1, 0)), zero_l,
                              use_acc=False, is_async=True)
        o_tok = warpgroup_mma(a8, v_buf.permute((1, 0)), acc, is_async=True)
        return l_tok, o_tok

    @gluon.jit
    def _fill_ones(ones, KV_DTYPE: gl.constexpr, BLOCK_N: gl.constexpr):
        """SUM_MMA's B operand [SUM_COLS, keys] in shared memory, all ones (every column of
        P @ ones is then the row sum, in every thread that holds a row: no shuffle to read
        it), fenced for the tensor cores; written by NUM_WARPS warps.

        The ones are e4m3's bit pattern (0x38) as int8, bitcast: a float32 1.0 cast to fp8
        (a constant splat) compiles, in the ptxas 12.8 that Triton 3.6 ships, to one F2FP
        that fills 16 bits of each 32-bit word and takes the other 16 from a register never
        written, so half the keys met garbage instead of 1 (ptxas 13.5 compiles the same PTX
        right; stop 40, benchmarks/NOTES.md)."""
        gl.static_assert(KV_DTYPE == gl.float8e4nv)
        ol: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS_G, 1], [1, 0])
        bits = gl.full([SUM_COLS_G, BLOCK_N], E4M3_ONE_G, gl.int8, ol)
        ones.store(bits.to(KV_DTYPE, bitcast=True))
        fence_async_shared()

    @gluon.jit
    def _carry(p, KV_DTYPE: gl.constexpr, PACKED: gl.constexpr):
        """What a block's P (float32) is carried in to the next block's P @ V: float32 (fp8,
        and 16-bit 64-key steps), or (PACKED: 16-bit 128-key steps) its 16-bit values two to
        an int32 register: 32 registers a thread instead of 64, which 128-key steps need to
        fit in 240 (Triton holds a loop-carried 16-bit tensor one value to a register and
        repacks it before the product, so the pairs are packed and unpacked here by hand)."""
        if PACKED:
            a, b = gl.split(gl.reshape(p, [p.shape[0], p.shape[1] // 2, 2]))
            CVT: gl.constexpr = ("cvt.rn.bf16x2.f32 $0, $2, $1;" if KV_DTYPE == gl.bfloat16
                                 else "cvt.rn.f16x2.f32 $0, $2, $1;")
            return gl.inline_asm_elementwise(CVT, "=r,r,r", [a, b], dtype=gl.int32, is_pure=True,
                                             pack=1)
        else:
            return p

    @gluon.jit
    def _operand(p, KV_DTYPE: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr,
                 PACKED: gl.constexpr):
        """The carried P as `_pv` takes it: fp8, float32 still (cast at the product, into the
        operand's registers); 16-bit, the A operand (PACKED: unpacked from `_carry`'s pairs,
        a move ptxas folds)."""
        if FP8:
            return p
        elif PACKED:
            if KV_DTYPE == gl.bfloat16:
                lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                                   pack=1)
            else:
                lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p],
                                                   dtype=(gl.float16, gl.float16), is_pure=True,
                                                   pack=1)
            x = gl.reshape(gl.join(lo, hi), [p.shape[0], 2 * p.shape[1]])
            return gl.convert_layout(x, p_layout)
        else:
            return gl.convert_layout(p.to(KV_DTYPE), p_layout)

    @gluon.jit
    def _scores(q_n_smem, q_r_smem, q_s_smem, kn_bufs, kr_bufs, ks_bufs, st, zero_s,
                OUTLIERS: gl.constexpr):
        """q k^T of stage `st`, issued (async) as the nope and rope products chained in one
        accumulator; OUTLIERS (fp8): a third 32-deep fp8 product chained after them, the q
        side tile [64, 32] times the stage's k side tile (core/fp8.py's corrections, in the
        same units). Returns the token to wait for."""
        s_tok = warpgroup_mma(q_n_smem, kn_bufs.index(st).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        s_tok = warpgroup_mma(q_r_smem, kr_bufs.index(st).permute((1, 0)), s_tok, is_async=True)
        if OUTLIERS:
            s_tok = warpgroup_mma(q_s_smem, ks_bufs.index(st).permute((1, 0)), s_tok,
                                  is_async=True)
        return s_tok

    @gluon.jit
    def _zero_tail(v_buf, valid, BLOCK_N: gl.constexpr):
        """Rows >= `valid` of a 16-bit v stage [BLOCK_N, Dv] set to 0 in shared memory
        (module doc: isolation). Both consumer warpgroups run it on the same stage; rows below
        `valid` are written back unchanged, so neither sees a value the other changes."""
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        v = v_buf.load(zl)
        keep = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zl)) < valid
        v_buf.store(gl.where(keep[:, None], v, gl.zeros_like(v)))
        fence_async_shared()

    @gluon.jit
    def _softmax_block(s, m_i, l_i, scale, start, rows, kv_end, kv_offset, causal,
                       MASKED, P_SHIFT: gl.constexpr, col_layout: gl.constexpr,
                       BLOCK_N: gl.constexpr):
        """Online-softmax step on one score block (log2 domain), as triton_attention's."""
        if MASKED:
            cols = start + gl.arange(0, BLOCK_N, layout=col_layout)
            visible = cols[None, :] < kv_end
            visible = visible & ((cols[None, :] <= rows[:, None] + kv_offset) | (causal == 0))
            s = gl.where(visible, s * scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            # rows with nothing visible yet keep m = -inf; exponentiate against 0 instead
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - (m_use - P_SHIFT)[:, None])
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
            m_use = m_new
            p = gl.exp2(s * scale - (m_use - P_SHIFT)[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _rounds(num_units, PERSISTENT: gl.constexpr):
        """Units this CTA takes: one, or every num_programs-th when persistent."""
        if PERSISTENT:
            return gl.cdiv(num_units - gl.program_id(0), gl.num_programs(0))
        else:
            return 1

    @gluon.jit
    def _unit_index(k, num_units, PERSISTENT: gl.constexpr):
        """The CTA's k-th unit. Persistent: round k takes the next num_programs units,
        zigzag (odd rounds in reverse CTA order), which with units in decreasing cost
        evens out the sums (LPT-like) where a plain stride gives the first CTAs the most."""
        if PERSISTENT:
            g = gl.num_programs(0)
            p = gl.program_id(0)
            w = k * g + gl.where(k % 2 == 0, p, g - 1 - p)
            # the last round is partial: a CTA whose zigzag slot lies past the end takes the
            # slot its stride would give (within range by _rounds)
            w = gl.where(w < num_units, w, k * g + p)
        else:
            w = gl.program_id(0)
        return w

    @gluon.jit
    def _unit(WorkInfo, Scales, vt_stride, w, num_tiles, num_sub, heads_pc, causal, order,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PERSISTENT: gl.constexpr):
        """Work unit `w` (a BLOCK_M-row slice of a work item, one head): its plan fields and
        key-block count (0 for a slice past its tile or a head past its cluster)."""
        if PERSISTENT:
            # heads in groups of `order` (sized on the host so a group's k/v fit in half the
            # L2: the CTAs running at once read a few heads, not all of them); in a group,
            # slices last to first (causal: longest first), each slice's heads in turn, so
            # the zigzag over CTAs balances
            per_group = order * num_tiles
            g0 = (w // per_group) * order
            size = gl.minimum(order, heads_pc - g0)
            r = w - g0 * num_tiles
            tile = num_tiles - 1 - r // size
            hh = g0 + r % size
        else:
            # one CTA per unit, in launch order: neighbours read one head's k/v (L2 reuse);
            # order 1 takes each head's slices last to first (causal: longest first), so the
            # grid's last CTAs are short ones rather than a long tail
            tile = gl.where(order != 0, num_tiles - 1 - w % num_tiles, w % num_tiles)
            hh = w // num_tiles
        item = tile // num_sub
        wi = WorkInfo + item * 8
        batch = gl.load(wi)
        loc = gl.load(wi + 1)
        qo_start = gl.load(wi + 2)
        qo_end = gl.load(wi + 3)
        kv_start = gl.load(wi + 4)
        kv_end = gl.load(wi + 5)
        kv_offset = gl.load(wi + 6)
        head_range = gl.load(wi + 7)
        head = (head_range & 0xFFFF) + hh
        m0 = qo_start + (tile % num_sub) * BLOCK_M
        valid = (head < (head_range >> 16)) & (m0 < qo_end)
        if causal != 0:
            hi = gl.minimum(kv_end, gl.minimum(m0 + BLOCK_M, qo_end) - 1 + kv_offset + 1)
        else:
            hi = kv_end
        n_total = gl.where(valid, gl.cdiv(gl.maximum(hi - kv_start, 0), BLOCK_N), 0)
        vshift = 16 * batch - kv_start % 16
        sbase = Scales + head * (vt_stride // 16) + (kv_start + vshift) // 16
        return (loc, qo_start, qo_end, kv_start, kv_end, kv_offset, head, m0, valid, n_total,
                kv_start + vshift, sbase)

    @gluon.jit
    def _unit_scales(QScales, sqs_t, sbase, ss_w, r0, head, qo_end, n_total, FP8: gl.constexpr,
                     BLOCK_N: gl.constexpr):
        """fp8: a consumer group's q block scale (at the block's first row; 1 past the slice)
        and the k and v scales of the unit's first two key blocks (1 where there is none);
        16-bit: ones. Loaded by `_consumer` before the unit's q wait (stop 29 measured loading
        them and the unit's plan fields a whole unit ahead in the persistent kernel: -1..-8%,
        benchmarks/NOTES.md)."""
        if FP8:
            SSTEP: gl.constexpr = BLOCK_N // 16
            s_q = gl.load(QScales + r0.to(gl.int64) * sqs_t + head, mask=r0 < qo_end, other=1.0)
            s_k0 = gl.load(sbase, mask=n_total > 0, other=1.0)
            s_v0 = gl.load(sbase + ss_w, mask=n_total > 0, other=1.0)
            s_k1 = gl.load(sbase + SSTEP, mask=n_total > 1, other=1.0)
            s_v1 = gl.load(sbase + ss_w + SSTEP, mask=n_total > 1, other=1.0)
        else:
            s_q = gl.to_tensor(1.0)
            s_k0 = s_q
            s_v0 = s_q
            s_k1 = s_q
            s_v1 = s_q
        return s_q, s_k0, s_v0, s_k1, s_v1

    @gluon.jit
    def _consume_unit(WG: gl.constexpr, q_n_smem, q_r_smem, q_s_smem, kn_bufs, kr_bufs, ks_bufs,
                      vt_bufs, ready,
                      empty, vready, vempty, turn, q_ready, q_empty, qph, it0, Q, sq_t, sq_h, QScales, sqs_t, Out,
                      so_t, so_h, Lse, sl_t,
                      sl_h, PartO, spo_t, spo_h, PartLse, spl_t, spl_h, SBase, ss_w, m0, qo_start,
                      qo_end, kv_start, kv_end, kv_offset, loc, head, n_total, sc, causal,
                      has_lse, qk_scale, KV_DTYPE: gl.constexpr, P_SHIFT: gl.constexpr,
                      BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                      FP8: gl.constexpr, Q_TMA: gl.constexpr, RESCALE_LATE: gl.constexpr,
                      ones_smem, SUM_MMA: gl.constexpr, SPLIT_KV: gl.constexpr,
                      OUTLIERS: gl.constexpr):
        """One warpgroup's 64 rows of one unit; its key blocks are stages it0, it0 + 1, ...
        FP8: q, k, v block-scaled fp8 (the block scales applied per key block); else 16-bit.
        Q_TMA: the q block arrives in `q_n_smem`/`q_r_smem` by the producer's TMA (`q_ready`,
        phase `qph`: this group's units so far) and is released once the unit's last q k^T
        has completed (`q_empty`); else the group loads it itself.

        PINGPONG: the two warpgroups take turns issuing their products (FA3's schedule),
        one `turn` mbarrier each: a group waits for its turn, issues S = q k^T (and the
        previous block's P @ V), hands the turn over, then runs its softmax while the
        other's products occupy the tensor cores. Without it both groups, fed by the same
        stages, tend to run in lockstep: softmax against softmax, products against products.
        Turns are counted over key blocks (the ring position `it`), the same for both groups.

        RESCALE_LATE: acc takes block j's factor (alpha, and in fp8 the v scale change) after
        q k^T of block j + 1 is issued, just before the P @ V of block j that accumulates into
        it (FA3's order: the 64 multiplies a thread run under the tensor cores' q k^T), instead
        of after block j's softmax, between it and the next issue.

        SUM_MMA (fp8): each block's row sums of P taken by the tensor cores, P @ ones_smem
        ([keys, 8] ones) into a fresh [64, 8] accumulator issued beside its P @ V, then
        folded into l8 (float32 registers, every column the row sum: 4 FFMA a thread a block)
        with the block's alpha, instead of 64 FADD a thread a block; so l sums the fp8 P that
        P @ V multiplies. Its factor is alpha alone (the v scale change is acc's only).

        SPLIT_KV: k and v of a stage arrive and are released apart (`ready`/`empty` for k,
        `vready`/`vempty` for v: FA3's two pipelines). k is released as soon as its q k^T has
        completed, a block before its v, so the producer's next k load does not wait for a
        P @ V; else one `ready` covers the stage and it is released after its P @ V (`vempty`
        is then `empty` itself).

        OUTLIERS (fp8 with Q_TMA; core/fp8.py's fp8_outliers): a third fp8 product per key
        block, the q side tile [64, 32] (`q_s_smem`, by the producer's TMA with q) times the
        stage's k side tile [keys, 32] (`ks_bufs`), chained after the two others (`_scores`).
        """
        # wgmma's k per instruction: 32 bytes of the operand type (fp8 32, 16-bit 16)
        K_INSTR: gl.constexpr = 32 if FP8 else 16
        PACKED: gl.constexpr = (not FP8) and BLOCK_N == 128  # `_carry`
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, K_INSTR])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV_G, K_INSTR])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=K_INSTR // 8)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUM_COLS_G, K_INSTR])
        pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout,
                                                      k_width=K_INSTR // 8)
        row_l: gl.constexpr = gl.SliceLayout(1, l_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

        # q block: load it (fp8: triton_quant.quantize_qkv's q8; else the caller's q), park in
        # shared memory (wgmma A operand; the previous unit's products that read it have
        # completed), and in fp8 its scale, at the block's first row (a block past the slice's
        # last row: 1, as an all-zero one)
        r0 = m0 + WG * HALF_G
        if Q_TMA:
            # rows past the slice's end hold the next rows of q (TMA reads whole 64-row boxes):
            # their scores and outputs stay in their own rows, which are never stored
            mbarrier.wait(q_ready, qph & 1)
        else:
            rows_l = r0 + gl.arange(0, HALF_G, layout=gl.SliceLayout(1, ld))
            q_ok = (rows_l < qo_end)[:, None]
            q_ptr = Q + rows_l.to(gl.int64)[:, None] * sq_t + head.to(gl.int64) * sq_h
            qn = gl.load(q_ptr + gl.arange(0, NOPE_G, layout=gl.SliceLayout(0, ld))[None, :],
                         mask=q_ok, other=0.0)
            qr = gl.load(q_ptr + NOPE_G + gl.arange(0, ROPE_G, layout=gl.SliceLayout(0, ld))[None, :],
                         mask=q_ok, other=0.0)
            q_n_smem.store(qn)
            q_r_smem.store(qr)
            fence_async_shared()
        s_q, s_k0, s_v0, s_k1, s_v1 = sc  # _unit_scales
        if FP8:
            scale = qk_scale * s_q
        else:
            scale = qk_scale

        rows = r0 + gl.arange(0, HALF_G, layout=row_s)
        if causal != 0:
            full_end = gl.minimum(kv_end, r0 + kv_offset + 1)
        else:
            full_end = kv_end
        n_full = gl.maximum(full_end - kv_start, 0) // BLOCK_N

        m_i = gl.full([HALF_G], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([HALF_G], gl.float32, row_s)
        acc = gl.zeros([HALF_G, DV_G], gl.float32, o_layout)
        zero_s = gl.zeros([HALF_G, BLOCK_N], gl.float32, s_layout)
        # P of the block before, the A operand of its P @ V, issued with the next block's
        # q k^T: carried in float32 and cast to fp8 just before (the cast's F2FP writes the
        # operand registers). Carried as fp8, Triton holds it a byte per register and repacks
        # it before every P @ V: ~180 more instructions per block, 11-14% slower on the H200
        # (benchmarks/NOTES.md, stop 27). 16-bit: cast to its operand before the next block's
        # q k^T is issued (`_operand`)
        p = _carry(gl.zeros([HALF_G, BLOCK_N], gl.float32, s_layout), KV_DTYPE, PACKED)
        c_v = gl.to_tensor(1.0)  # the v scale acc is kept in (loop-carried float32)
        # RESCALE_LATE: the factor acc takes before the next P @ V (acc is 0 until the first)
        fac = gl.full([HALF_G], 1.0, gl.float32, row_s)
        # SUM_MMA: the row sums so far (every column the same), the factor they take before
        # the next block's sums are added (that block's alpha), the products' unread input
        l8 = gl.zeros([HALF_G, SUM_COLS_G], gl.float32, l_layout)
        fac_l = gl.full([HALF_G], 1.0, gl.float32, row_s)
        zero_l = gl.zeros([HALF_G, SUM_COLS_G], gl.float32, l_layout)

        if n_total > 0:
            st = it0 % NUM_STAGES
            mbarrier.wait(ready.index(st), (it0 // NUM_STAGES) & 1)
            if PINGPONG:
                # group 0's first wait passes on a fresh barrier (phase parity 1)
                mbarrier.wait(turn.index(WG), (it0 + 1 - WG) & 1)
            s_tok = _scores(q_n_smem, q_r_smem, q_s_smem, kn_bufs, kr_bufs, ks_bufs, st, zero_s,
                            OUTLIERS)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            if FP8:
                c_v = s_v0
                blk_scale = scale * s_k0
            else:
                blk_scale = scale
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            if SPLIT_KV:
                mbarrier.arrive(empty.index(st), count=1)
            p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, blk_scale, kv_start, rows, kv_end,
                                                kv_offset, causal, n_full == 0, P_SHIFT, col_s,
                                                BLOCK_N)
            p = _carry(p, KV_DTYPE, PACKED)

        # each block's two scales are loaded one step ahead (their latency off the critical path)
        SSTEP: gl.constexpr = BLOCK_N // 16
        if FP8:
            s_k_next = s_k1
            s_v_next = s_v1
        for j in range(1, n_total):
            if FP8:
                s_k = s_k_next
                s_v = s_v_next
                s_k_next = gl.load(SBase + (j + 1) * SSTEP, mask=j + 1 < n_total, other=1.0)
                s_v_next = gl.load(SBase + ss_w + (j + 1) * SSTEP, mask=j + 1 < n_total, other=1.0)
                blk_scale = scale * s_k
            else:
                blk_scale = scale
            it = it0 + j
            st = it % NUM_STAGES
            p_op = _operand(p, KV_DTYPE, p_layout, FP8, PACKED)
            mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(WG), (it + 1 - WG) & 1)
            s_tok = _scores(q_n_smem, q_r_smem, q_s_smem, kn_bufs, kr_bufs, ks_bufs, st, zero_s,
                            OUTLIERS)
            prev = (it - 1) % NUM_STAGES
            if SPLIT_KV:
                mbarrier.wait(vready.index(prev), ((it - 1) // NUM_STAGES) & 1)
            if RESCALE_LATE:
                acc = acc * gl.convert_layout(fac, row_o)[:, None]
            if SUM_MMA:
                # issued before P @ V, so the wait for S below leaves only P @ V in flight
                l_tok, o_tok = _pv_and_sums(p_op, vt_bufs.index(prev), acc, zero_l, ones_smem,
                                            kv_start, KV_DTYPE, p_layout, pl_layout, BLOCK_N)
            else:
                o_tok = _pv(p_op, vt_bufs.index(prev), acc, KV_DTYPE, p_layout, BLOCK_N, FP8)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            if SUM_MMA:
                s, blk_l = warpgroup_mma_wait(1, deps=(s_tok, l_tok))
                l8 = l8 * gl.convert_layout(fac_l, row_l)[:, None] + blk_l
            else:
                s = warpgroup_mma_wait(1, deps=(s_tok,))
            if SPLIT_KV:
                mbarrier.arrive(empty.index(st), count=1)
            p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, blk_scale, kv_start + j * BLOCK_N,
                                                rows, kv_end, kv_offset, causal, j >= n_full,
                                                P_SHIFT, col_s, BLOCK_N)
            p = _carry(p, KV_DTYPE, PACKED)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            mbarrier.arrive(vempty.index(prev), count=1)
            if FP8:
                # acc is kept in units of the last block's v scale (triton_attention's rule)
                f = alpha * (c_v / s_v)
                c_v = s_v
            else:
                f = alpha
            fac_l = alpha
            if RESCALE_LATE:
                fac = f
            else:
                acc = acc * gl.convert_layout(f, row_o)[:, None]

        if Q_TMA:
            # every q k^T of the unit has completed (each was waited for): the producer may
            # load the next unit's q block
            mbarrier.arrive(q_empty, count=1)
        if n_total > 0:
            last = (it0 + n_total - 1) % NUM_STAGES
            if SPLIT_KV:
                mbarrier.wait(vready.index(last), ((it0 + n_total - 1) // NUM_STAGES) & 1)
            if not FP8:
                # the last block may reach past the unit's keys (module doc: isolation)
                tail = kv_end - (kv_start + (n_total - 1) * BLOCK_N)
                if tail < BLOCK_N:
                    _zero_tail(vt_bufs.index(last), tail, BLOCK_N)
            if RESCALE_LATE:
                acc = acc * gl.convert_layout(fac, row_o)[:, None]
            if SUM_MMA:
                l_tok, o_tok = _pv_and_sums(p, vt_bufs.index(last), acc, zero_l, ones_smem,
                                            kv_start, KV_DTYPE, p_layout, pl_layout, BLOCK_N)
                acc, blk_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok))
                l8 = l8 * gl.convert_layout(fac_l, row_l)[:, None] + blk_l
            else:
                o_tok = _pv(_operand(p, KV_DTYPE, p_layout, FP8, PACKED), vt_bufs.index(last), acc,
                            KV_DTYPE, p_layout, BLOCK_N, FP8)
                acc = warpgroup_mma_wait(0, deps=(o_tok,))
            mbarrier.arrive(vempty.index(last), count=1)

        if SUM_MMA:
            # every column holds it, bit for bit (`_softmax_block`'s FADD sums are then dead:
            # the compiler drops them, the point of SUM_MMA)
            l_i = gl.convert_layout(gl.max(l8, 1), row_s)
        seen = l_i > 0
        inv = gl.where(seen, c_v / gl.where(seen, l_i, 1.0), 0.0)
        lse = gl.where(seen, (m_i - P_SHIFT + gl.log2(gl.where(seen, l_i, 1.0))) * LN2_G,
                       float("-inf"))
        o = acc * gl.convert_layout(inv, row_o)[:, None]
        rows_o = r0 + gl.arange(0, HALF_G, layout=row_o)
        cols = gl.arange(0, DV_G, layout=col_o)
        ok_o = (rows_o < qo_end)[:, None]
        ok_s = rows < qo_end
        if loc < 0:
            o_ptr = Out + rows_o.to(gl.int64)[:, None] * so_t + head.to(gl.int64) * so_h + cols[None, :]
            gl.store(o_ptr, o.to(Out.dtype.element_ty), mask=ok_o)
            if has_lse != 0:
                gl.store(Lse + rows.to(gl.int64) * sl_t + head * sl_h, lse, mask=ok_s)
        else:
            prow = (loc + rows_o - qo_start).to(gl.int64)
            gl.store(PartO + prow[:, None] * spo_t + head.to(gl.int64) * spo_h + cols[None, :], o,
                     mask=ok_o)
            gl.store(PartLse + (loc + rows - qo_start).to(gl.int64) * spl_t + head * spl_h, lse,
                     mask=ok_s)

    @gluon.jit
    def _consumer(WG: gl.constexpr, q_n_smem, q_r_smem, q_s_smem, kn_bufs, kr_bufs, ks_bufs,
                  vt_bufs, ready, empty,
                  vready, vempty, q_ready, q_empty,
                  turn, WorkInfo, Scales, vt_stride, num_units, num_tiles, num_sub, heads_pc, order,
                  Q, sq_t, sq_h, QScales, sqs_t, Out, so_t, so_h, Lse, sl_t, sl_h, PartO, spo_t,
                  spo_h, PartLse, spl_t, spl_h, ss_w, causal, has_lse, qk_scale,
                  KV_DTYPE: gl.constexpr, P_SHIFT: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr, FP8: gl.constexpr,
                  Q_TMA: gl.constexpr, RESCALE_LATE: gl.constexpr, ones_smem,
                  SUM_MMA: gl.constexpr, SPLIT_KV: gl.constexpr, OUTLIERS: gl.constexpr):
        it = gl.to_tensor(0)  # key blocks consumed so far: the ring position
        qph = gl.to_tensor(0)  # units consumed so far: the q barriers' phase
        for k in range(_rounds(num_units, PERSISTENT)):
            (loc, qo_start, qo_end, kv_start, kv_end, kv_offset, head, m0, valid, n_total, vcol0,
             sbase) = _unit(WorkInfo, Scales, vt_stride, _unit_index(k, num_units, PERSISTENT),
                            num_tiles, num_sub, heads_pc, causal, order, BLOCK_M, BLOCK_N, PERSISTENT)
            # loaded before the unit's q wait: their latency under it
            sc = _unit_scales(QScales, sqs_t, sbase, ss_w, m0 + WG * HALF_G, head, qo_end, n_total,
                              FP8, BLOCK_N)
            if valid:
                _consume_unit(WG, q_n_smem, q_r_smem, q_s_smem, kn_bufs, kr_bufs, ks_bufs, vt_bufs,
                              ready, empty, vready, vempty, turn,
                              q_ready, q_empty, qph, it,
                              Q, sq_t, sq_h, QScales, sqs_t, Out, so_t, so_h, Lse, sl_t, sl_h, PartO,
                              spo_t, spo_h, PartLse, spl_t, spl_h, sbase, ss_w, m0, qo_start, qo_end,
                              kv_start, kv_end, kv_offset, loc, head, n_total, sc, causal, has_lse,
                              qk_scale, KV_DTYPE, P_SHIFT, BLOCK_N, NUM_STAGES, PINGPONG, FP8, Q_TMA,
                              RESCALE_LATE, ones_smem, SUM_MMA, SPLIT_KV, OUTLIERS)
                if Q_TMA:
                    qph += 1
            it += n_total

    @gluon.jit
    def _load_k(KN, KR, KS, kn_bufs, kr_bufs, ks_bufs, bar, st, row, col, head,
                OUTLIERS: gl.constexpr):
        """k nope and k rope of one key block (rows from `row`, head at column `col`) into
        stage `st`, completing on `bar[st]`; OUTLIERS: its side tile too (head h at column
        h * 32 of the side tiles' [Tk, H * 32])."""
        tma.async_copy_global_to_shared(KN, [row, col], bar.index(st), kn_bufs.index(st))
        tma.async_copy_global_to_shared(KR, [row, col + NOPE_G], bar.index(st), kr_bufs.index(st))
        if OUTLIERS:
            tma.async_copy_global_to_shared(KS, [row, head * SIDE_G], bar.index(st),
                                            ks_bufs.index(st))

    @gluon.jit
    def _load_v(VT, vt_bufs, bar, st, row, vcol, head, vh_stride, FP8: gl.constexpr):
        """v of one key block into stage `st`, completing on `bar[st]`: fp8, vt8's [Dv, keys]
        box at column `vcol`; 16-bit, the caller's rows from `row`, head at h * vh_stride."""
        if FP8:
            tma.async_copy_global_to_shared(VT, [head * DV_G, vcol], bar.index(st), vt_bufs.index(st))
        else:
            tma.async_copy_global_to_shared(VT, [row, head * vh_stride], bar.index(st),
                                            vt_bufs.index(st))

    @gluon.jit
    def _producer(QN, QR, QS, KN, KR, KS, VT, q_n, q_r, q_s, kn_bufs, kr_bufs, ks_bufs, vt_bufs,
                  ready, empty, vready,
                  vempty, q_ready, q_empty, WorkInfo, Scales, vt_stride, num_units, num_tiles, num_sub, heads_pc,
                  causal, order, qh_stride, kh_stride, vh_stride, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
                  FP8: gl.constexpr, Q_TMA: gl.constexpr, SPLIT_KV: gl.constexpr,
                  OUTLIERS: gl.constexpr):
        """Fills the ring: per key block, k nope, k rope and v (fp8: packed k8 and vt8 from
        the quantization; 16-bit: the caller's k and v, head h's features at column
        h * kh_stride and h * vh_stride of their 2D [T, span] descriptors). Q_TMA: before a
        unit's key blocks, each consumer group's q block (its two descriptors, head h at
        column h * qh_stride) into that group's q buffer, once the group released it.
        SPLIT_KV: k and v on their own barriers, in the order the consumers use them (FA3's):
        k of block j + 1 before v of block j, whose P @ V is issued after q k^T of block j + 1."""
        kbytes: gl.constexpr = (KN.block_type.nbytes + KR.block_type.nbytes
                                + (KS.block_type.nbytes if OUTLIERS else 0))
        nbytes: gl.constexpr = kbytes + VT.block_type.nbytes
        qbytes: gl.constexpr = (QN.block_type.nbytes + QR.block_type.nbytes
                                + (QS.block_type.nbytes if OUTLIERS else 0))
        it = 0
        qph = 0
        for k in range(_rounds(num_units, PERSISTENT)):
            w = _unit_index(k, num_units, PERSISTENT)
            (loc, qo_start, qo_end, kv_start, kv_end, kv_offset, head, m0, valid, n_total, vcol0,
             sbase) = _unit(WorkInfo, Scales, vt_stride, w, num_tiles, num_sub, heads_pc, causal, order,
                            BLOCK_M, BLOCK_N, PERSISTENT)
            if Q_TMA:
                if valid:
                    for g in gl.static_range(2):
                        # a fresh mbarrier counts as having completed phase 1: the first passes
                        mbarrier.wait(q_empty.index(g), (qph & 1) ^ 1)
                        mbarrier.expect(q_ready.index(g), qbytes)
                        tma.async_copy_global_to_shared(QN, [m0 + g * HALF_G, head * qh_stride],
                                                        q_ready.index(g), q_n.index(g))
                        tma.async_copy_global_to_shared(QR, [m0 + g * HALF_G,
                                                             head * qh_stride + NOPE_G],
                                                        q_ready.index(g), q_r.index(g))
                        if OUTLIERS:
                            tma.async_copy_global_to_shared(QS, [m0 + g * HALF_G, head * SIDE_G],
                                                            q_ready.index(g), q_s.index(g))
                    qph += 1
            if FP8:
                col = head * (NOPE_G + ROPE_G)
            else:
                col = head * kh_stride
            if SPLIT_KV:
                for j in range(n_total + 1):
                    if j < n_total:
                        st = (it + j) % NUM_STAGES
                        # a fresh mbarrier counts as having completed phase 1: the first round passes
                        mbarrier.wait(empty.index(st), (((it + j) // NUM_STAGES) & 1) ^ 1)
                        mbarrier.expect(ready.index(st), kbytes)
                        _load_k(KN, KR, KS, kn_bufs, kr_bufs, ks_bufs, ready, st,
                                kv_start + j * BLOCK_N, col, head, OUTLIERS)
                    if j > 0:
                        sv = (it + j - 1) % NUM_STAGES
                        mbarrier.wait(vempty.index(sv), (((it + j - 1) // NUM_STAGES) & 1) ^ 1)
                        mbarrier.expect(vready.index(sv), VT.block_type.nbytes)
                        _load_v(VT, vt_bufs, vready, sv, kv_start + (j - 1) * BLOCK_N,
                                vcol0 + (j - 1) * BLOCK_N, head, vh_stride, FP8)
                it += n_total
            else:
                for j in range(n_total):
                    st = it % NUM_STAGES
                    # a fresh mbarrier counts as having completed phase 1: the first round passes
                    mbarrier.wait(empty.index(st), ((it // NUM_STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(st), nbytes)
                    _load_k(KN, KR, KS, kn_bufs, kr_bufs, ks_bufs, ready, st, kv_start + j * BLOCK_N,
                            col, head, OUTLIERS)
                    _load_v(VT, vt_bufs, ready, st, kv_start + j * BLOCK_N, vcol0 + j * BLOCK_N,
                            head, vh_stride, FP8)
                    it += 1

    @gluon.jit(do_not_specialize=["ss_w", "sl_t", "sl_h", "spl_t", "spl_h", "num_units",
                                  "num_tiles", "num_sub", "heads_pc", "causal", "has_lse",
                                  "order", "kh_stride", "vh_stride"])
    def mla_prefill_gluon_kernel(
        Q, QN, QR, KN, KR, VT, QS, KS, Out, Lse, PartO, PartLse, WorkInfo, Scales, QScales,
        sq_t, sq_h, vt_stride, ss_w, sqs_t, so_t, so_h, sl_t, sl_h, spo_t, spo_h, spl_t, spl_h,
        qk_scale, num_units, num_tiles, num_sub, heads_pc, causal, has_lse, order, kh_stride,
        vh_stride,
        KV_DTYPE: gl.constexpr, P_SHIFT: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
        PERSISTENT: gl.constexpr, FP8: gl.constexpr, Q_TMA: gl.constexpr,
        RESCALE_LATE: gl.constexpr, SUM_MMA: gl.constexpr, SPLIT_KV: gl.constexpr,
        LEAN_SYNC: gl.constexpr, OUTLIERS: gl.constexpr,
    ):
        """Grid (num_units,), or (CTAs,) when PERSISTENT (each then takes a unit per round,
        `_unit_index`), of num_units = num_tiles * heads_pc (num_tiles = plan items * num_sub
        slices of BLOCK_M rows; heads_pc = heads per cluster); num_warps = 4 (the first
        consumer). `order`: one CTA per unit, 0 takes each head's slices in plan order and 1
        last to first; PERSISTENT, the heads per L2 group (`_unit`), at least 1.

        FP8: Q is q8 [Tq, H, 192] fp8 (strides sq_t, sq_h), QScales its scales [Tq, H] (row
        stride sqs_t), KN/KR descriptors of k8 [Tk, H * 192], VT of vt8 [H * 128, columns],
        Scales the k/v block scales, all from `triton_quant.quantize_qkv`.
        16-bit (FP8 False): Q the caller's q [Tq, H, 192], KN/KR descriptors of its k as
        [Tk, span] (head h at column h * kh_stride), VT of its v as [Tk, span] (head h at
        column h * vh_stride); Scales and QScales unused.
        QN/QR: descriptors of the same q as [Tq, span] with [64, 128] and [64, 64] boxes (head
        h at column h * sq_h), read by the producer when Q_TMA (else Q's pointer loads).
        OUTLIERS (fp8 with Q_TMA): QS/KS descriptors of the side tiles of
        `triton_quant.write_outlier_sides` as [T, H * 32] fp8 with [64, 32] and
        [BLOCK_N, 32] boxes (head h at column h * 32); unread otherwise (any descriptor).
        Host guarantees (triton_kernel.run_prefill): BLOCK_M = 128, BLOCK_N = 128 in fp8 (64 or
        128 in 16-bit); in fp8, tiles start at multiples of 64 rows and work items at
        multiples of 128 keys from their sequence's start, v columns of a sequence start
        16-aligned (triton_quant).
        """
        gl.static_assert(BLOCK_M == 2 * HALF_G)
        gl.static_assert(BLOCK_N == 128 or not FP8)  # fp8: one k/v scale block a step
        # q's buffers (one per consumer group) in its descriptors' layouts, the TMA boxes'
        q_n = gl.allocate_shared_memory(KV_DTYPE, [2, HALF_G, NOPE_G], QN.layout)
        q_r = gl.allocate_shared_memory(KV_DTYPE, [2, HALF_G, ROPE_G], QR.layout)
        kn_bufs = gl.allocate_shared_memory(KV_DTYPE, [NUM_STAGES, BLOCK_N, NOPE_G], KN.layout)
        kr_bufs = gl.allocate_shared_memory(KV_DTYPE, [NUM_STAGES, BLOCK_N, ROPE_G], KR.layout)
        if OUTLIERS:  # the side tiles: q's per consumer group, k's per stage
            gl.static_assert(FP8 and Q_TMA)
            q_s = gl.allocate_shared_memory(KV_DTYPE, [2, HALF_G, SIDE_G], QS.layout)
            ks_bufs = gl.allocate_shared_memory(KV_DTYPE, [NUM_STAGES, BLOCK_N, SIDE_G], KS.layout)
        else:  # passed along, never read
            q_s = q_n
            ks_bufs = kn_bufs
        if FP8:  # v transposed, [Dv, keys] (the K-major B operand fp8 wgmma needs)
            vt_bufs = gl.allocate_shared_memory(KV_DTYPE, [NUM_STAGES, DV_G, BLOCK_N], VT.layout)
        else:  # v as it is, [keys, Dv]
            vt_bufs = gl.allocate_shared_memory(KV_DTYPE, [NUM_STAGES, BLOCK_N, DV_G], VT.layout)
        if SUM_MMA:
            # fp8 only: the [8, keys] B operand of the consumers' row sums (_consume_unit),
            # all ones; written here before the partitions start, read only after
            gl.static_assert(FP8)
            ones = gl.allocate_shared_memory(KV_DTYPE, [SUM_COLS_G, BLOCK_N], VT.layout)
            _fill_ones(ones, KV_DTYPE, BLOCK_N)
        else:  # passed along, never read
            ones = vt_bufs
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        if SPLIT_KV:  # v's own barriers
            vready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            vempty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        else:  # `ready`/`empty` cover the whole stage: v's release is the stage's
            vready = ready
            vempty = empty
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
            if SPLIT_KV:
                mbarrier.init(vready.index(i), count=1)
                mbarrier.init(vempty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)

        gl.warp_specialize([
            (_consumer, (0, q_n.index(0), q_r.index(0), q_s.index(0), kn_bufs, kr_bufs, ks_bufs,
                         vt_bufs, ready, empty,
                         vready, vempty, q_ready.index(0), q_empty.index(0), turn, WorkInfo, Scales, vt_stride, num_units, num_tiles, num_sub, heads_pc,
                         order, Q, sq_t, sq_h, QScales, sqs_t, Out, so_t, so_h, Lse, sl_t, sl_h, PartO,
                         spo_t, spo_h, PartLse, spl_t, spl_h, ss_w, causal, has_lse, qk_scale,
                         KV_DTYPE, P_SHIFT, BLOCK_M, BLOCK_N, NUM_STAGES, PINGPONG, PERSISTENT,
                         FP8, Q_TMA, RESCALE_LATE, ones, SUM_MMA, SPLIT_KV, OUTLIERS)),
            (_consumer, (1, q_n.index(1), q_r.index(1), q_s.index(1), kn_bufs, kr_bufs, ks_bufs,
                         vt_bufs, ready, empty,
                         vready, vempty, q_ready.index(1), q_empty.index(1), turn, WorkInfo, Scales, vt_stride, num_units, num_tiles, num_sub, heads_pc,
                         order, Q, sq_t, sq_h, QScales, sqs_t, Out, so_t, so_h, Lse, sl_t, sl_h, PartO,
                         spo_t, spo_h, PartLse, spl_t, spl_h, ss_w, causal, has_lse, qk_scale,
                         KV_DTYPE, P_SHIFT, BLOCK_M, BLOCK_N, NUM_STAGES, PINGPONG, PERSISTENT,
                         FP8, Q_TMA, RESCALE_LATE, ones, SUM_MMA, SPLIT_KV, OUTLIERS)),
            (_producer, (QN, QR, QS, KN, KR, KS, VT, q_n, q_r, q_s, kn_bufs, kr_bufs, ks_bufs, vt_bufs,
                         ready, empty,
                         vready, vempty, q_ready, q_empty, WorkInfo, Scales, vt_stride, num_units, num_tiles,
                         num_sub, heads_pc, causal, order, sq_h, kh_stride, vh_stride, BLOCK_M,
                         BLOCK_N, NUM_STAGES, PERSISTENT, FP8, Q_TMA, SPLIT_KV, OUTLIERS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
