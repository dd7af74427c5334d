"""Times the k/v block quantization (triton_quant.quantize_kv) against the previous kernel.

For each configuration (warps, heads per program) of the current kernel: bitwise equality
with the previous kernel (commit 7e6833e) on fresh random bf16 inputs with a NaN, an inf
and irregular sequence lengths, registers/spills of the compiled kernel, and TB/s of
(bytes read + bytes written) from triton.testing.do_bench.

    PYTHONPATH=. python benchmarks/quant_bench.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_plugins.core.kernels import triton_quant as tq
from mla_plugins.core.kernels.triton_quant import (  # noqa: F401 (used inside the jit source)
    DV_C,
    NOPE_C,
    ROPE_C,
    SCALE_BLOCK_C,
    max_nan,
    nan_aware_amax,
    scale_from_amax,
    to_fp8,
)

FP8 = torch.float8_e4m3fn
CONFIGS = [(8, 1), (4, 1), (8, 2), (4, 2), (8, 4)]
SHAPES = {"B8-S2048-H128": ([2048] * 8, 128), "B1-S8192-H128": ([8192], 128)}
CHECKS = {"irregular H5": ([333, 0, 64, 517, 1, 15, 4096], 5),
          "irregular H128": ([333, 0, 64, 517, 1, 15, 1000], 128)}


# the previous kernel (commit 7e6833e), verbatim, for the comparison
@triton.jit
def old_quant_kv_kernel(
    K, V, K8, VT8, Scales, CuK,
    sk_t, sk_h, sv_t, sv_h, vt_stride, ss_w,
    FP8_MAX: tl.constexpr, CHUNK: tl.constexpr,
):
    """Grid (key blocks of the longest sequence, sequences, heads)."""
    j = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    heads = tl.num_programs(2)
    k0 = tl.load(CuK + b)
    k1 = tl.load(CuK + b + 1)
    r0 = k0 + j * SCALE_BLOCK_C
    if (r0 < k1) | ((j == 0) & (k0 == k1)):
        # two sweeps over the block in CHUNK-row slices: the amax, then the cast. The
        # second reads what the first just brought into L2 (device memory is read once)
        # and the slices keep the registers low enough not to spill.
        out_ty = K8.dtype.element_ty
        c_nope = tl.arange(0, NOPE_C)
        c_rope = tl.arange(0, ROPE_C)
        c_v = tl.arange(0, DV_C)
        kbase = K + h.to(tl.int64) * sk_h
        vbase = V + h.to(tl.int64) * sv_h
        amax_k = 0.0
        amax_v = 0.0
        for c in range(0, SCALE_BLOCK_C, CHUNK):
            rows = r0 + c + tl.arange(0, CHUNK)
            ok = (rows < k1)[:, None]
            src = kbase + rows.to(tl.int64)[:, None] * sk_t
            kn = tl.load(src + c_nope[None, :], mask=ok, other=0.0).to(tl.float32)
            kr = tl.load(src + NOPE_C + c_rope[None, :], mask=ok, other=0.0).to(tl.float32)
            amax_k = max_nan(amax_k, max_nan(nan_aware_amax(kn), nan_aware_amax(kr)))
            x = tl.load(vbase + rows.to(tl.int64)[:, None] * sv_t + c_v[None, :], mask=ok,
                        other=0.0).to(tl.float32)
            amax_v = max_nan(amax_v, nan_aware_amax(x))
        s_k = scale_from_amax(amax_k, FP8_MAX)
        s_v = scale_from_amax(amax_v, FP8_MAX)
        shift = 16 * b - k0 % 16
        # scalar 64-bit base, 32-bit offsets (128 * T_pad < 2^31): fewer address registers
        vbase8 = VT8 + (h * DV_C).to(tl.int64) * vt_stride + (r0 + shift)
        vrow = c_v[None, :] * vt_stride - r0
        for c in range(0, SCALE_BLOCK_C, CHUNK):
            rows = r0 + c + tl.arange(0, CHUNK)
            ok = (rows < k1)[:, None]
            src = kbase + rows.to(tl.int64)[:, None] * sk_t
            dst = K8 + (rows.to(tl.int64) * heads + h)[:, None] * (NOPE_C + ROPE_C)
            kn = tl.load(src + c_nope[None, :], mask=ok, other=0.0).to(tl.float32)
            tl.store(dst + c_nope[None, :], to_fp8(kn, s_k, FP8_MAX, out_ty), mask=ok)
            kr = tl.load(src + NOPE_C + c_rope[None, :], mask=ok, other=0.0).to(tl.float32)
            tl.store(dst + NOPE_C + c_rope[None, :], to_fp8(kr, s_k, FP8_MAX, out_ty), mask=ok)
        # v in one 64-row tile: its transposed store then writes 64 contiguous bytes per row
        rows = r0 + tl.arange(0, SCALE_BLOCK_C)
        ok = (rows < k1)[:, None]
        x = tl.load(vbase + rows.to(tl.int64)[:, None] * sv_t + c_v[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        tl.store(vbase8 + vrow + rows[:, None], to_fp8(x, s_v, FP8_MAX, out_ty), mask=ok)
        if r0 + SCALE_BLOCK_C >= k1:
            # zeros from the sequence's end to the next one's first column (< 32 of them):
            # a tile of a sequence's last keys reads there, masked, and must see zeros
            gap = k1 + shift + tl.arange(0, 32)
            next_start = k1 - k1 % 16 + 16 * (b + 1)
            zeros = tl.zeros([32, DV_C], dtype=tl.float32).to(out_ty)
            tl.store(vbase8 + vrow + (gap - shift)[:, None], zeros, mask=(gap < next_start)[:, None])
        if r0 < k1:
            sidx = (r0 + shift) // 16
            tl.store(Scales + h * (vt_stride // 16) + sidx, s_k)
            tl.store(Scales + ss_w + h * (vt_stride // 16) + sidx, s_v)



def old_quantize_kv(k, v, ck, batch, max_len, out):
    k8, vt8, scales = out
    grid = (max(1, triton.cdiv(max_len, 64)), batch, k.shape[1])
    old_quant_kv_kernel[grid](
        k, v, k8, vt8, scales, ck, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        vt8.shape[1], scales.stride(0), FP8_MAX=448.0, CHUNK=16, num_warps=8)
    return out


def buffers(total, heads, batch, seed=0):
    """(k8, vt8, scales) pre-filled with the same random bytes, so unwritten cells compare too."""
    t_pad = tq.vt_padded_len(total, batch)
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [((total, heads, 192), FP8), ((heads * 128, t_pad), FP8), ((2, heads, t_pad // 16), torch.float32)]
    out = []
    for shape, dt in shapes:
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dt).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
        out.append(raw.view(dt).view(shape))
    return out


def inputs(lens, heads):
    total = sum(lens)
    k = torch.randn(total, heads, 192, device="cuda", dtype=torch.bfloat16) * 3
    v = torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16) * 3
    if total > 400:
        k[400, heads - 1, 7] = float("nan")
        v[300, 0, 5] = float("inf")
    ck = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return k, v, ck


def same(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def main():
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for name, (lens, heads) in {**CHECKS, **SHAPES}.items():
        k, v, ck = inputs(lens, heads)
        total, batch = k.shape[0], len(lens)
        ref = old_quantize_kv(k, v, ck, batch, max(lens), buffers(total, heads, batch))
        for w, hpp in CONFIGS:
            got = tq.quantize_kv(k, v, ck, batch, max(lens), FP8, out=buffers(total, heads, batch),
                                 heads_per_program=hpp, num_warps=w)
            print(f"{name} w{w} hpp{hpp}: bitwise equal to the previous kernel: {same(ref, got)}")
    for (w, hpp), kern in zip(CONFIGS, _compiled(), strict=True):
        print(f"compiled w{w} hpp{hpp}: {kern.n_regs} registers, {kern.n_spills} spills")
    for name, (lens, heads) in SHAPES.items():
        _time(name, lens, heads)


def _time(name, lens, heads):
    k, v, ck = inputs(lens, heads)
    total, batch = k.shape[0], len(lens)
    moved = total * heads * (192 + 128) * 3 + 2 * heads * tq.vt_padded_len(total, batch) // 16 * 4
    out = buffers(total, heads, batch)
    ms = triton.testing.do_bench(lambda: old_quantize_kv(k, v, ck, batch, max(lens), out))
    print(f"{name} previous kernel: {ms * 1e3:.0f} us, {moved / ms / 1e9:.2f} TB/s")
    for w, hpp in CONFIGS:
        ms = triton.testing.do_bench(lambda w=w, hpp=hpp: tq.quantize_kv(
            k, v, ck, batch, max(lens), FP8, out=out, heads_per_program=hpp, num_warps=w))
        print(f"{name} w{w} hpp{hpp}: {ms * 1e3:.0f} us, {moved / ms / 1e9:.2f} TB/s")
    dst = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    src = torch.empty_like(dst)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    print(f"{name} copy of the same bytes: {moved / ms / 1e9:.2f} TB/s")


def _compiled():
    """The compiled kernel of each configuration at B8-S2048-H128 (its registers, spills)."""
    lens, heads = SHAPES["B8-S2048-H128"]
    k, v, ck = inputs(lens, heads)
    total, batch = k.shape[0], len(lens)
    k8, vt8, scales = buffers(total, heads, batch)
    for w, hpp in CONFIGS:
        grid = (triton.cdiv(max(lens), 64), batch, heads // hpp)
        yield tq._quant_kv_kernel[grid](
            k, v, k8, vt8, scales, ck, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            vt8.shape[1], scales.stride(0), heads, FP8_MAX=448.0, HEADS_PER_PROGRAM=hpp, num_warps=w)


if __name__ == "__main__":
    main()
