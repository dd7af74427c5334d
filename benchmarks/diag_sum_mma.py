"""Diagnostic of `TileConfig.sum_mma` (stops 37, 39 and 40, benchmarks/NOTES.md): the ones
buffer as `_fill_ones` writes it, against the float32 splat it used to be (`splat`: stop
40's finding, ptxas filled half of each word from a register never written), one 64xN
P @ B product (`onehot`: which key each row sums and which element of B it reads, for each
way of building A), the row sums carried in the fp8 products' accumulator against fresh per
block and float32 (`chain`), the kernel's own `_fill_ones` and `_pv_and_sums` beside their
serial and register-copy forms on known P and v (`pair`), then the Gluon kernel's lse with
sum_mma against without it, per row, and (`split`, not in the default list) the isolation
test's split batch measured against each sequence alone and float64. Hopper only, from the
repository root:

    PYTHONPATH=. python benchmarks/diag_sum_mma.py
    ONEHOT_ONLY=1 PYTHONPATH=. python benchmarks/diag_sum_mma.py
    TRITON_CACHE_DIR=/tmp/tc16 PYTHONPATH=. python benchmarks/diag_sum_mma.py cols=16
    TRITON_CACHE_DIR=/tmp/tccopy PYTHONPATH=. python benchmarks/diag_sum_mma.py copy=1

The first runs splat, chain, pair and the kernel's rows (DIAG_PARTS, comma-separated, names
a subset of splat, chain, pair, rows, split); ONEHOT_ONLY runs `onehot` and
`pair`, with ONEHOT_MODES (default 0,1,2,3,4) naming the ways of building A that `onehot`
runs. `cols=` sets gluon_attention.SUM_COLS, `copy=` SUM_COPY_A (the sums read a copy of
P's registers); each run with either in a Triton cache of its own (the cache keys a kernel
by its source, not by the globals it read).
"""
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, ".")
from mla_plugins.core.kernels import gluon_attention as ga  # noqa: E402


@gluon.jit
def pair(P, VT, OutL, OutO, Z, N: gl.constexpr, MODE: gl.constexpr):
    """The kernel's own `_pv_and_sums` (P @ ones and P @ V from one cast of P, both async;
    MODE 0) on P [64, 128] float32 and vt [128, 128] fp8 (Dv x keys), one warpgroup; or the
    same two products one after the other, each waited for before the next is issued (1:
    sums first, 2: P @ V first), or both in flight with the sums' A operand a register copy
    of P @ V's (3: xor with Z >> 31, a runtime 0 for Z >= 0 that ptxas cannot fold away as it
    folds a move, so no register is read by two products in flight; the kernel's SUM_COPY_A
    for mode 0)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 32])
    o_layout: gl.constexpr = s_layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, N, 32])
    pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ol: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    ones = gl.allocate_shared_memory(gl.float8e4nv, [N, 128], sh)  # the kernel's: VT.layout
    ga._fill_ones(ones, gl.float8e4nv, 128)  # the kernel's own (SUM_COLS_G must equal N)
    vt = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], sh)
    vr = gl.arange(0, 128, layout=gl.SliceLayout(1, ol))
    vc = gl.arange(0, 128, layout=gl.SliceLayout(0, ol))
    vt.store(gl.load(VT + vr[:, None] * 128 + vc[None, :]))
    fence_async_shared()
    gl.thread_barrier()
    r = gl.arange(0, 64, layout=row_s)
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, s_layout))
    p = gl.load(P + r[:, None] * 128 + c[None, :])
    acc = gl.zeros([64, 128], gl.float32, o_layout)
    acc_l = gl.zeros([64, N], gl.float32, l_layout)
    if MODE == 0:
        l_tok, o_tok = ga._pv_and_sums(p, vt, acc, acc_l, ones, Z, gl.float8e4nv, p_layout,
                                       pl_layout, 128)
        acc, acc_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok))
    else:
        a8 = ga._p_operand(p, gl.float8e4nv, p_layout, 128)
        a8_l = gl.convert_layout(a8, pl_layout)
        if MODE == 3:
            zeros = gl.full([64, 128], (Z >> 31).to(gl.int8), gl.int8, pl_layout)
            a8_l = gl.inline_asm_elementwise("xor.b32 $0, $1, $2;", "=r,r,r", [a8_l, zeros],
                                             dtype=gl.float8e4nv, is_pure=False, pack=4)
        if MODE == 1:
            l_tok = warpgroup_mma(a8_l, ones.permute((1, 0)), acc_l, use_acc=False, is_async=True)
            acc_l = warpgroup_mma_wait(0, deps=(l_tok,))
            o_tok = warpgroup_mma(a8, vt.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
        elif MODE == 2:
            o_tok = warpgroup_mma(a8, vt.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            l_tok = warpgroup_mma(a8_l, ones.permute((1, 0)), acc_l, use_acc=False, is_async=True)
            acc_l = warpgroup_mma_wait(0, deps=(l_tok,))
        else:
            l_tok = warpgroup_mma(a8_l, ones.permute((1, 0)), acc_l, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(a8, vt.permute((1, 0)), acc, is_async=True)
            acc, acc_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok))
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, l_layout))
    co = gl.arange(0, N, layout=gl.SliceLayout(0, l_layout))
    gl.store(OutL + ro[:, None] * N + co[None, :], acc_l)
    co2 = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    gl.store(OutO + r[:, None] * 128 + co2[None, :], acc)


@gluon.jit
def chain(P, Out, NB: gl.constexpr, CHAIN: gl.constexpr):
    """Row sums of NB blocks of P [NB, 64, 128] (float32, cast to e4m3) by 64x8 wgmma against
    ones: CHAIN, carried in the products' accumulator across the blocks (stop 37's kernel);
    else each block's into a fresh one, added in float32 registers (stop 39's)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 32])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 8, 32])
    pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ones = gl.allocate_shared_memory(gl.float8e4nv, [8, 128], sh)
    ga._fill_ones(ones, gl.float8e4nv, 128)  # the kernel's own (SUM_COLS_G must be 8)
    gl.thread_barrier()
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, s_layout))
    acc = gl.zeros([64, 8], gl.float32, l_layout)
    zero = gl.zeros([64, 8], gl.float32, l_layout)
    for b in range(NB):
        p = gl.load(P + b * 64 * 128 + r[:, None] * 128 + c[None, :])
        a8 = gl.convert_layout(p.to(gl.float8e4nv), pl_layout)
        if CHAIN:
            tok = warpgroup_mma(a8, ones.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(tok,))
        else:
            tok = warpgroup_mma(a8, ones.permute((1, 0)), zero, use_acc=False, is_async=True)
            acc = acc + warpgroup_mma_wait(0, deps=(tok,))
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, l_layout))
    co = gl.arange(0, 8, layout=gl.SliceLayout(0, l_layout))
    gl.store(Out + ro[:, None] * 8 + co[None, :], acc)


@gluon.jit
def splat(Out, BITCAST: gl.constexpr):
    """The ones buffer of `_fill_ones` written both ways and read back as bytes: 1.0 cast
    from float32 (a constant splat: what `_fill_ones` did until stop 40) or e4m3's bit
    pattern bitcast from int8 (`_fill_ones` now). Out [8, 128] int8."""
    ol: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ones = gl.allocate_shared_memory(gl.float8e4nv, [8, 128], sh)
    if BITCAST:
        ga._fill_ones(ones, gl.float8e4nv, 128)
    else:
        ones.store(gl.full([8, 128], 1.0, gl.float32, ol).to(gl.float8e4nv))
    gl.thread_barrier()
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, ol))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, ol))
    gl.store(Out + r[:, None] * 128 + c[None, :], ones.load(ol).to(gl.int8, bitcast=True))


def splat_check():
    """How many bytes of the ones buffer are not e4m3's 1.0 (0x38), each way of filling it
    (the SASS of the float32 splat: one F2FP that takes half of each word from a register
    never written)."""
    for bitcast in (False, True):
        out = torch.full((8, 128), 0x7F, dtype=torch.int8, device="cuda")  # poison: e4m3 NaN
        if _launched(f"splat bitcast={bitcast}", splat, out, bitcast):
            bad = out != 0x38
            print(f"splat {'bitcast int8' if bitcast else 'float32 1.0 cast'}: {int(bad.sum())} of "
                  f"1024 bytes not 0x38; byte positions in a word: "
                  f"{sorted(set((bad.nonzero()[:, 1] % 4).tolist()))}; values "
                  f"{sorted(set(out[bad].tolist()))[:8]}")


def chain_check():
    """Is the fp8 products' accumulator short of float32 (the stop 39 reading of stop 37's
    error)? Softmax-like P (2^-6 .. 2^8) over 1, 8 and 64 blocks: the row sums carried in
    the accumulator and block by block in float32, each against the float64 sum."""
    torch.manual_seed(3)
    for nb in (1, 8, 64):
        p = torch.exp2(torch.rand(nb, 64, 128, device="cuda") * 14 - 6)
        want = p.to(torch.float8_e4m3fn).double().sum((0, 2))
        line = []
        for mode in (True, False):
            out = torch.full((64, 8), float("nan"), device="cuda")
            if _launched(f"chain NB={nb} carried={mode}", chain, p, out, nb, mode):
                r = out.double() / want[:, None]
                line.append(f"{'carried' if mode else 'fresh+fp32'} ratio min {r.min().item():.5f} "
                            f"max {r.max().item():.5f}")
        print(f"chain NB={nb}: " + "; ".join(line))


@gluon.jit
def onehot(P, B, Out, N: gl.constexpr, AMODE: gl.constexpr):
    """P [64, 128] (float32, cast to e4m3) @ B^T ([N, 128] float32 cast to e4m3, in shared
    memory at a 128-byte swizzle: ones, or a probe) by one 64xN wgmma, out [64, N]: A
    in registers converted from a blocked load (AMODE 0), from it through the scores' and P @
    V's operand layouts (1), A in shared memory (2), or P loaded in the scores' layout and
    converted (3), through vt8's key order and P @ V's operand layout (4: the kernel's path)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4)
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, N, 32])
    pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ol: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    ones = gl.allocate_shared_memory(gl.float8e4nv, [N, 128], sh)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ol))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, ol))
    rn = gl.arange(0, N, layout=gl.SliceLayout(1, ol))
    ones.store(gl.load(B + rn[:, None] * 128 + c[None, :]).to(gl.float8e4nv))
    p8 = gl.load(P + r[:, None] * 128 + c[None, :]).to(gl.float8e4nv)
    acc = gl.zeros([64, N], gl.float32, l_layout)
    if AMODE >= 3:
        # P loaded straight into the scores' layout (as `chain` and the kernel hold it)
        rs = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        cs = gl.arange(0, 128, layout=gl.SliceLayout(0, s_layout))
        ps = gl.load(P + rs[:, None] * 128 + cs[None, :])
        fence_async_shared()
        gl.thread_barrier()
        if AMODE == 3:
            a = gl.convert_layout(ps.to(gl.float8e4nv), pl_layout)
        else:  # 4: the kernel's path: vt8's key order, P @ V's operand layout, then pl_layout
            a = gl.convert_layout(ga._p_operand(ps, gl.float8e4nv, p_layout, 128), pl_layout)
        tok = warpgroup_mma(a, ones.permute((1, 0)), acc, is_async=True)
    elif AMODE == 2:
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], sh)
        a_smem.store(p8)
        fence_async_shared()
        gl.thread_barrier()
        tok = warpgroup_mma(a_smem, ones.permute((1, 0)), acc, is_async=True)
    else:
        fence_async_shared()
        gl.thread_barrier()
        if AMODE == 1:
            a = gl.convert_layout(gl.convert_layout(gl.convert_layout(p8, s_layout), p_layout),
                                  pl_layout)
        else:
            a = gl.convert_layout(p8, pl_layout)
        tok = warpgroup_mma(a, ones.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(tok,))
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, l_layout))
    co = gl.arange(0, N, layout=gl.SliceLayout(0, l_layout))
    gl.store(Out + ro[:, None] * N + co[None, :], acc)


def onehot_check():
    """Which keys a 64xN row-sum product counts: P one-hot (row m holds a 1 at key m, then
    at key 64 + m), each A path and N; prints the keys whose sum is not 1 and what came.
    Then B probes: B[n, k] = 1 + k % 16, 1 + k // 16, 1 + n % 8, 1 + n // 8 (exact in e4m3), so with one-hot
    A the output [m, n] names the element of B the product read for key k_m, column n."""
    modes = tuple(int(m) for m in os.environ.get("ONEHOT_MODES", "0,1,2,3,4").split(","))
    for n in (8, 16, 64):
        for amode in modes:
            bad = {}
            for half in (0, 1):
                p = torch.zeros(64, 128, device="cuda")
                p[torch.arange(64), torch.arange(64) + 64 * half] = 1.0
                b = torch.ones(n, 128, device="cuda")
                out = torch.full((64, n), float("nan"), device="cuda")
                if not _launched(f"onehot N={n} A={amode}", onehot, p, b, out, n, amode):
                    break
                for m in range(64):
                    got = out[m].tolist()
                    if any(g != 1.0 for g in got):
                        bad[m + 64 * half] = sorted(set(round(g, 3) for g in got))
            print(f"onehot N={n} A={amode}: {128 - len(bad)} keys right; wrong keys "
                  f"{sorted(bad)[:40]}; their values {list(bad.values())[:6]}")
    for n in (8, 64):
        for amode in modes:
            kk = torch.arange(128, device="cuda").float()[None, :].expand(n, 128)
            nn = torch.arange(n, device="cuda").float()[:, None].expand(n, 128)
            probes = {"k%16": 1 + kk % 16, "k//16": 1 + kk // 16, "n%8": 1 + nn % 8,
                      "n//8": 1 + nn // 8}
            seen = {}
            for name, b in probes.items():
                rows = []
                for half in (0, 1):
                    p = torch.zeros(64, 128, device="cuda")
                    p[torch.arange(64), torch.arange(64) + 64 * half] = 1.0
                    out = torch.full((64, n), float("nan"), device="cuda")
                    if not _launched(f"probe N={n} A={amode}", onehot, p, b.contiguous(), out, n,
                                     amode):
                        break
                    rows.append(out)
                if len(rows) == 2:
                    seen[name] = torch.cat(rows)  # [128 keys, n]
            if len(seen) < 4:
                continue
            k_read = (seen["k//16"] - 1) * 16 + (seen["k%16"] - 1)
            n_read = (seen["n//8"] - 1) * 8 + (seen["n%8"] - 1)
            # mode 4 feeds the product P's keys in vt8's order: key k sits at position v(k)
            order = torch.arange(128, device="cuda").reshape(8, 2, 2, 2, 2).permute(0, 2, 3, 1, 4)
            pos = order.reshape(128).argsort() if amode == 4 else torch.arange(128, device="cuda")
            want_k = pos.float()[:, None].expand(128, n)
            want_n = torch.arange(n, device="cuda").float()[None, :].expand(128, n)
            wrong = ((k_read != want_k) | (n_read != want_n)).nonzero().tolist()
            print(f"probe N={n} A={amode}: {len(wrong)} of {128 * n} (key, column) read elsewhere; "
                  f"first: {[(k, c, k_read[k, c].item(), n_read[k, c].item()) for k, c in wrong[:12]]}")
    # uniform P, then P spread over `span` binades (chain's and the kernel's P are spread):
    # whether what goes wrong depends on the values or on where A comes from
    torch.manual_seed(4)
    for n in (8, 64):
        for amode in modes:
            for span in (0, 2, 8, 14):
                u = torch.rand(64, 128, device="cuda")
                p = u * 200 if span == 0 else torch.exp2(u * span + 8 - span)
                want = p.to(torch.float8_e4m3fn).double().sum(1)
                out = torch.full((64, n), float("nan"), device="cuda")
                if _launched(f"rand N={n} A={amode}", onehot, p, torch.ones(n, 128, device="cuda"),
                             out, n, amode):
                    r = out.double() / want[:, None]
                    print(f"rand N={n} A={amode} {'uniform' if span == 0 else f'span 2^{span}'}: "
                          f"ratio min {r.min().item():.5f} max {r.max().item():.5f}")


def _launched(label, kernel, *args) -> bool:
    """One program of `kernel` (4 warps) run to completion; a compile or launch error is
    printed, not raised."""
    try:
        kernel[(1,)](*args, num_warps=4)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        return False
    return True


def pair_check():
    """`pair` against torch: l = the row sums of e4m3 P, o = P (in vt's key order) @ vt^T."""
    torch.manual_seed(2)
    p = (torch.rand(64, 128, device="cuda") * 200)
    p8 = p.to(torch.float8_e4m3fn).float()
    vt8 = torch.randn(128, 128, device="cuda").to(torch.float8_e4m3fn)
    perm = p8.reshape(64, 8, 2, 2, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(64, 128)
    want_o = perm @ vt8.float().t()
    n = int(ga.SUM_COLS_G.value)  # the width `_fill_ones` writes
    out_l = torch.full((64, n), float("nan"), device="cuda")
    out_o = torch.full((64, 128), float("nan"), device="cuda")
    for mode in (0, 1, 2, 3):
        out_l.fill_(float("nan"))
        out_o.fill_(float("nan"))
        if _launched(f"pair N={n} mode={mode}", pair, p, vt8, out_l, out_o, 0, n, mode):
            print(f"pair N={n} mode={mode}: l (every column) rel err "
                  f"{(out_l / p8.sum(1)[:, None] - 1).abs().max().item():.3e}; "
                  f"o rel err {((out_o - want_o).norm() / want_o.norm()).item():.3e}")


def kernel_rows():
    from dataclasses import replace

    import mla_plugins
    from mla_plugins.core import api
    from mla_plugins.core.kernels import triton_kernel as tk
    for name in ("GLUON_MIN_MEAN_KEYS", "GLUON_PERSISTENT_MIN_MEAN_KEYS"):
        setattr(tk, name, 0)
    base = replace(tk.GLUON_FP8_CONFIG, sum_mma=False)  # the vector row sums
    for s in (128, 256, 1024):
        torch.manual_seed(1)
        q = torch.randn(s, 2, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(s, 2, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(s, 2, 128, device="cuda", dtype=torch.bfloat16)
        cu = [0, s]
        res = {}
        for label, cfg in (("base", base), ("sum", replace(base, sum_mma=True)),
                           ("sum_early", replace(base, sum_mma=True, rescale_late=False))):
            tk.GLUON_FP8_CONFIG = cfg
            api._cache.clear()  # a remembered plan keeps the configuration it first ran with
            o, lse = mla_plugins.mla_prefill(q, k, v, cu, cu, causal=True, fp8=True, return_lse=True,
                                             kernel="triton")
            res[label] = (o.float(), lse)
        tk.GLUON_FP8_CONFIG = base
        o0, l0 = res["base"]
        for label in ("sum", "sum_early"):
            o1, l1 = res[label]
            ratio = torch.exp(l1 - l0)  # l_sum / l_base per row and head
            err = ((o1 - o0).norm() / o0.norm()).item()
            print(f"S={s} {label}: out err vs base {err:.3e}; l ratio min {ratio.min().item():.4f} "
                  f"median {ratio.median().item():.4f} max {ratio.max().item():.4f}; "
                  f"rows 0,1,63,64,127 head 0: {[round(x, 3) for x in ratio[[0, 1, 63, 64, 127], 0].tolist()]}; "
                  f"out/base rows 0,64: {(o1.norm(dim=-1) / o0.norm(dim=-1))[[0, 64], 0].tolist()}")


def split_spread():
    """The isolation test's split case measured instead of asserted (stop 41: with sum_mma the
    default it failed with the lse tolerance at 5e-3, which assertion unknown): the GPU test's
    batch (lengths [300, 520, 200] over [700, 520, 333] keys, 4 heads, inf / NaN / 1e30 in
    sequence 1, split into heads * 7 pieces) against sequences 0 and 2 alone, for the vector
    sums and sum_mma in each form the batch can take (one CTA per unit; persistent), over 4
    draws: the largest |lse - alone| and out's relative difference, and each one's lse and out
    against float64."""
    from dataclasses import replace

    import mla_plugins
    from mla_plugins.core import api
    from mla_plugins.core.kernels import triton_kernel as tk
    from tests.core.helpers import cu_seqlens, random_batch
    from tests.gpu.conftest import reference_on_device, rel_err

    lens_q, lens_k, heads = [300, 520, 200], [700, 520, 333], 4

    def run(q, k, v, cq, ck):
        api._cache.clear()  # a remembered plan keeps the configuration it first ran with
        plan = mla_plugins.plan_prefill(cq, ck, kernel="triton", num_heads=heads, tile_q=128,
                                        kv_granularity=128, num_workers=heads * 7)
        return mla_plugins.mla_prefill(q, k, v, cq, ck, causal=True, fp8=True, return_lse=True,
                                       plan=plan, kernel="triton")

    # the draws and their float64 references, once for every configuration
    draws = []
    for seed in range(4):
        q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, seed=seed, device="cuda")
        q[lens_q[0] + 100, 1, 3] = float("inf")
        k[lens_k[0] + 10, 0, 100] = float("nan")
        v[lens_k[0] + 300, 2, 7] = 1e30
        cqh, ckh = cq.tolist(), ck.tolist()
        alone = []
        for b in (0, 2):
            qs, ks = slice(cqh[b], cqh[b + 1]), slice(ckh[b], ckh[b + 1])
            one_q, one_k = cu_seqlens([lens_q[b]], "cuda"), cu_seqlens([lens_k[b]], "cuda")
            args = (q[qs], k[ks], v[ks], one_q, one_k)
            alone.append((qs, args, reference_on_device(*args)))
        draws.append(((q, k, v, cq, ck), alone))

    saved = {n: getattr(tk, n) for n in ("GLUON_MIN_MEAN_KEYS", "GLUON_PERSISTENT_MIN_MEAN_KEYS",
                                         "GLUON_FP8_CONFIG", "GLUON_FP8_PERSISTENT_CONFIG")}
    try:
        tk.GLUON_MIN_MEAN_KEYS = 0
        for form, several in (("one CTA", float("inf")), ("persistent", 0)):
            tk.GLUON_PERSISTENT_MIN_MEAN_KEYS = several
            for sums in (False, True):
                tk.GLUON_FP8_CONFIG = replace(saved["GLUON_FP8_CONFIG"], sum_mma=sums)
                tk.GLUON_FP8_PERSISTENT_CONFIG = replace(saved["GLUON_FP8_PERSISTENT_CONFIG"],
                                                         sum_mma=sums)
                worst = {"dlse": 0.0, "dout": 0.0, "lse64": 0.0, "out64": 0.0}
                for batch, alone in draws:
                    out, lse = run(*batch)
                    for qs, args, (ref, ref_lse) in alone:
                        one, one_lse = run(*args)
                        worst["dlse"] = max(worst["dlse"], (lse[qs] - one_lse).abs().max().item())
                        worst["dout"] = max(worst["dout"], rel_err(out[qs], one.double()))
                        worst["lse64"] = max(worst["lse64"], (lse[qs].double() - ref_lse).abs().max().item())
                        worst["out64"] = max(worst["out64"], rel_err(out[qs], ref))
                print(f"split {form}, {'sum_mma' if sums else 'vector sums'}: max |lse - alone| "
                      f"{worst['dlse']:.2e}, out vs alone {worst['dout']:.2e}; against float64: "
                      f"max |lse err| {worst['lse64']:.2e}, out rel err {worst['out64']:.3e}", flush=True)
    finally:
        for name, value in saved.items():
            setattr(tk, name, value)
        api._cache.clear()


def _settings(argv):
    """`cols=N` and `copy=0|1` (gluon_attention.SUM_COLS / SUM_COPY_A) from the command
    line; set before any kernel compiles (Triton reads a kernel's globals at its compile)."""
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise SystemExit(f"diag_sum_mma.py: arguments are name=value, got {bad}; "
                         "expected cols=N, copy=0|1")
    opts = dict(a.split("=", 1) for a in argv)
    unknown = set(opts) - {"cols", "copy"}
    if unknown:
        raise SystemExit(f"diag_sum_mma.py: unknown argument(s) {sorted(unknown)}; "
                         "expected cols=N, copy=0|1")
    if "cols" in opts:
        ga.SUM_COLS_G = gl.constexpr(int(opts["cols"]))
    if "copy" in opts:
        ga.SUM_COPY_A_G = gl.constexpr(int(opts["copy"]))
    return opts


if __name__ == "__main__":
    opts = _settings(sys.argv[1:])
    if opts:
        print(f"kernel with {opts}")
    elif "ONEHOT_ONLY" in os.environ:
        onehot_check()
        pair_check()
        raise SystemExit(0)
    else:
        parts = os.environ.get("DIAG_PARTS", "splat,chain,pair,rows").split(",")
        checks = {"splat": splat_check, "chain": chain_check, "pair": pair_check,
                  "rows": kernel_rows, "split": split_spread}
        unknown = set(parts) - set(checks)
        if unknown:
            raise SystemExit(f"diag_sum_mma.py: DIAG_PARTS names {sorted(unknown)}; expected "
                             f"some of {sorted(checks)}, comma-separated")
        for name in parts:
            checks[name]()
        raise SystemExit(0)
    pair_check()
    kernel_rows()
