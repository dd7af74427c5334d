"""Times the k/v block quantization (triton_quant.quantize_kv) per launch configuration.

For each configuration (warps, sweeps over the 128-key block) of the kernel: bitwise
equality with the default configuration on fresh random bf16 inputs with a NaN, an inf and
irregular sequence lengths (outputs pre-filled with the same random bytes, so unwritten
cells compare too), and TB/s of (bytes read + bytes written) from triton.testing.do_bench,
with a device copy of the same bytes as the ceiling.

    PYTHONPATH=. python benchmarks/quant_bench.py
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from mla_plugins.core.kernels import triton_quant as tq

FP8 = torch.float8_e4m3fn
#: (num_warps, parts); the default (tq.NUM_WARPS, tq.PARTS) is the reference
CONFIGS = [(16, 2), (8, 4), (16, 4), (8, 2), (16, 1), (8, 1)]
SHAPES = {"B8-S2048-H128": ([2048] * 8, 128), "B1-S8192-H128": ([8192], 128),
          "B16-S512-H16": ([512] * 16, 16)}
CHECKS = {"irregular H5": ([333, 0, 64, 517, 1, 15, 4096], 5),
          "irregular H128": ([333, 0, 64, 517, 1, 15, 1000], 128)}


def buffers(total, heads, batch, seed=0):
    """(k8, vt8, scales) pre-filled with the same random bytes."""
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


def run(k, v, ck, lens, out, warps, parts):
    return tq.quantize_kv(k, v, ck, len(lens), max(lens), FP8, out=out, num_warps=warps, parts=parts)


def main():
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}; default: "
          f"{tq.NUM_WARPS} warps, {tq.PARTS} sweep(s)")
    for name, (lens, heads) in {**CHECKS, **SHAPES}.items():
        k, v, ck = inputs(lens, heads)
        total, batch = k.shape[0], len(lens)
        ref = run(k, v, ck, lens, buffers(total, heads, batch), tq.NUM_WARPS, tq.PARTS)
        for w, parts in CONFIGS:
            got = run(k, v, ck, lens, buffers(total, heads, batch), w, parts)
            print(f"{name} w{w} parts{parts}: bitwise equal to the default: {same(ref, got)}")
    for name, (lens, heads) in SHAPES.items():
        _time(name, lens, heads)


def _time(name, lens, heads):
    k, v, ck = inputs(lens, heads)
    total, batch = k.shape[0], len(lens)
    moved = total * heads * (192 + 128) * 3 + 2 * heads * tq.vt_padded_len(total, batch) // 16 * 4
    out = buffers(total, heads, batch)
    for w, parts in CONFIGS:
        ms = triton.testing.do_bench(lambda w=w, parts=parts: run(k, v, ck, lens, out, w, parts))
        print(f"{name} w{w} parts{parts}: {ms * 1e3:.0f} us, {moved / ms / 1e9:.2f} TB/s")
    dst = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    src = torch.empty_like(dst)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    print(f"{name} copy of the same bytes: {moved / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
