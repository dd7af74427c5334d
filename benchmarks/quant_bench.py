"""Times the FP8 quantization kernels per launch configuration, in one device call.

Variants (each with and without the rotation of q and k, core/fp8.py):
- `kv`: the block rule for k and v alone (triton_quant.quantize_kv: the figures of the
  NOTES before q moved out of the attention);
- `qkv`: the block rule for q, k and v in one launch (quantize_qkv, what mla_prefill runs);
- `heads`: one scale per (sequence, head), two launches (triton_heads.quantize_heads, the
  FA3 provider's quantization), splits from head_splits.

For each configuration (warps, sweeps over a key block, q blocks per program, heads per
program; rotated, also the rotation's implementation, `rotation="kron"` against the default
"dense", and the Kronecker tile's rows, ROTATED_CONFIGS): equality with the variant's
default configuration on fresh random bf16 inputs with a NaN, an inf and irregular sequence
lengths (CHECKS; outputs pre-filled with the same random bytes, so unwritten cells compare
too; bit for bit for the amax rule, and printed as the count of differing bytes, per output,
for the rotated one, whose products may sum in another order: kron against dense differs
in values at rounding ties, never in scales), then TB/s of (bytes read + bytes written)
from triton.testing.do_bench, with a device copy of the same bytes as the ceiling. Bytes:
the bf16 inputs read once and fp8 written once (block rule: 3 bytes an element), read twice
(`heads`: 5 bytes an element), plus scales.

    PYTHONPATH=. python benchmarks/quant_bench.py [--only kv,qkv,heads] [--rotate-only]
        [--amortized] [--gluon]

`--rotate-only`: unrotated, only the default configuration is timed (the ceiling the
rotated rows compare with); rotated, the default (dense) and the kron configurations, not
the dense one's other knobs (timed by the call of 2026-12-02, benchmarks/NOTES.md). The
dense-against-kron call: `--only heads,qkv --rotate-only` (~1-2 minutes on an H200, most
of it compiling; the time taken is printed at the end). `--amortized`: the rotated casts
that load M once for more rows (AMORTIZED_CONFIGS), the unrotated defaults beside them.
`--gluon`: the per-head pair alone, unrotated, then rotated as the FA3 provider calls it
(`sms` given: the dense cast at `rotated_blocks`, 3 stages, 8 warps) beside "kron" and the
Gluon cast (`rotation="gluon"`, gluon_rotate) with its knobs (GLUON_CONFIGS); the byte check
compares each with the provider's dense call (values at rounding ties only, never the
descales, partials or v8).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.testing

from mla_plugins.core.kernels import triton_heads as th
from mla_plugins.core.kernels import triton_quant as tq

FP8 = torch.float8_e4m3fn
#: per variant, configurations as keyword arguments; the first is the default
CONFIGS = {
    "kv": [dict(), dict(num_warps=8, parts=4), dict(num_warps=16, parts=4),
           dict(num_warps=8, parts=2), dict(num_warps=16, parts=1), dict(num_warps=8, parts=1)],
    "qkv": [dict(), dict(num_warps=8), dict(q_blocks=1), dict(q_blocks=4),
            dict(heads_per_program=2), dict(parts=1)],
    "heads": [dict(), dict(num_warps=8), dict(blocks=1), dict(blocks=4), dict(heads_per_program=2)],
}
#: per variant, the configurations only rotated runs add (after CONFIGS's): the Kronecker
#: rotation (triton_quant.kron_to_fp8) with its defaults and its knobs
ROTATED_CONFIGS = {
    "kv": [dict(rotation="kron"), dict(rotation="kron", kron_rows=32)],
    "qkv": [dict(rotation="kron"), dict(rotation="kron", kron_rows=32),
            dict(rotation="kron", q_blocks=2), dict(rotation="kron", num_warps=8)],
    "heads": [dict(rotation="kron"), dict(rotation="kron", kron_rows=32),
              dict(rotation="kron", blocks=2), dict(rotation="kron", num_warps=8),
              # dense: M (72 KB) is loaded once per program, so more rows per program
              dict(blocks=4), dict(blocks=8), dict(blocks=16), dict(blocks=8, num_warps=8),
              dict(blocks=8, heads_per_program=2), dict(rotation="kron", blocks=8, num_warps=8)],
}
ROTATED_CONFIGS["qkv"] += [dict(q_blocks=4), dict(q_blocks=8), dict(heads_per_program=2),
                           dict(heads_per_program=4), dict(q_blocks=8, heads_per_program=4)]
#: `--amortized`: the rotated casts that load M once for more rows, against their defaults:
#: the per-head cast's q and k blocks software-pipelined (`triton_heads.quantize_heads`'
#: `stages`) beside the same blocks one after another; the block rule's k/v programs over
#: several key blocks (`triton_quant.quantize_qkv`' `kv_blocks`)
AMORTIZED_CONFIGS = {
    "heads": [dict(blocks=8), dict(blocks=8, stages=2), dict(blocks=8, stages=3),
              dict(blocks=8, num_warps=8), dict(blocks=8, stages=2, num_warps=8),
              dict(blocks=8, stages=3, num_warps=8), dict(blocks=4, stages=3),
              dict(blocks=16, stages=3), dict(blocks=16, stages=3, num_warps=8)],
    "qkv": [dict(), dict(kv_blocks=2), dict(kv_blocks=4), dict(kv_blocks=8),
            dict(kv_blocks=4, q_blocks=4), dict(kv_blocks=4, q_blocks=8),
            dict(kv_blocks=4, num_warps=8)],
}
#: the same knobs on the unrotated casts (issue 21's k/v quantization at >= 3.5 TB/s): more
#: key blocks per program, the pipelined block loop; the first is the default
UNROTATED_AMORTIZED = {
    "heads": [dict(), dict(stages=2), dict(stages=3), dict(blocks=4, stages=3)],
    "qkv": [dict(), dict(kv_blocks=2), dict(kv_blocks=4)],
}
#: `--gluon`: the per-head pair rotated, the FA3 provider's call first (SMS: the device's SM
#: count, as the provider passes it), then the Kronecker cast in Triton and in Gluon, the
#: latter with its knobs (64-row blocks a program, warps, rows a warp casts per step, loads a
#: step ahead, paired stores: gluon_rotate.PREFETCH, PAIRED_STORES)
SMS = "sms"
GLUON_CONFIGS = [dict(rotation="dense", sms=SMS), dict(rotation="kron"),
                 dict(rotation="gluon", sms=SMS), dict(rotation="gluon", blocks=1),
                 dict(rotation="gluon", blocks=2),
                 dict(rotation="gluon", blocks=16), dict(rotation="gluon", sms=SMS, num_warps=8),
                 dict(rotation="gluon", sms=SMS, rows_per_warp=16),
                 dict(rotation="gluon", sms=SMS, num_warps=2)]
_PF, _PS = dict(prefetch=True), dict(paired_stores=True)
GLUON_CONFIGS += [dict(rotation="gluon", sms=SMS, prefetch=False, paired_stores=False),
                  dict(rotation="gluon", sms=SMS, **_PF), dict(rotation="gluon", sms=SMS, **_PS),
                  dict(rotation="gluon", sms=SMS, **_PF, **_PS),
                  dict(rotation="gluon", blocks=2, **_PF, **_PS),
                  dict(rotation="gluon", blocks=1, **_PF, **_PS),
                  dict(rotation="gluon", sms=SMS, rows_per_warp=16, **_PF, **_PS),
                  dict(rotation="gluon", sms=SMS, rows_per_warp=16, **_PS),
                  dict(rotation="gluon", sms=SMS, num_warps=8, **_PF, **_PS)]
#: do_bench's warmup and repetition times (ms): short, the kernels take 0.05-2 ms
WARMUP_MS, REP_MS = 10, 50
SHAPES = {"B8-S2048-H128": ([2048] * 8, 128), "B1-S8192-H128": ([8192], 128),
          "B16-S512-H16": ([512] * 16, 16), "B1-S16384-H16": ([16384], 16)}
#: `--gluon` adds the small shapes, where a program's chain of load latencies shows
SMALL_SHAPES = {"B1-S1024-H16": ([1024], 16), "B1-S2048-H8": ([2048], 8)}
CHECKS = {"irregular H5": ([333, 0, 64, 517, 1, 15, 4096], 5),
          "irregular H128": ([333, 0, 64, 517, 1, 15, 1000], 128)}


def random_like(shapes, seed=0):
    """Buffers of the given (shape, dtype)s pre-filled with the same random bytes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for shape, dt in shapes:
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dt).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
        out.append(raw.view(dt).view(shape))
    return out


def buffers(variant, total, heads, batch, splits):
    """The variant's `out` buffers (its workspace layout; `kv`: the block rule's without q)."""
    if variant == "heads":
        layout = th.head_workspace_layout(total, total, batch, heads, splits, FP8)
    else:
        layout = tq.qkv_workspace_layout(total, total, batch, heads, FP8)
        if variant == "kv":
            layout = layout[2:]
    return random_like([(shape, dt) for _, shape, dt in layout])


def inputs(lens, heads):
    total = sum(lens)
    mk = lambda d: torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16) * 3  # noqa: E731
    q, k, v = mk(192), mk(192), mk(128)
    if total > 400:
        k[400, heads - 1, 7] = float("nan")
        v[300, 0, 5] = float("inf")
        q[350, 0, 9] = float("inf")
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, k, v, cu


def run(variant, rotate, q, k, v, cu, lens, out, splits, config):
    n, m = len(lens), max(lens)
    if config.get("sms") == SMS:
        config = dict(config, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    if variant == "kv":
        return tq.quantize_kv(k, v, cu, n, m, FP8, out=out, rotate=rotate, **config)
    if variant == "qkv":
        return tq.quantize_qkv(q, k, v, cu, cu, n, m, m, FP8, out=out, rotate=rotate, **config)
    return th.quantize_heads(q, k, v, cu, cu, n, m, m, splits, FP8, rotate=rotate, out=out, **config)


def differing_bytes(a, b):
    """Bytes differing per output (None outputs left out)."""
    return [int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
            for x, y in zip(a, b, strict=True) if x is not None]


def configs(variant, rotate, rotate_only, amortized=False, gluon=False):
    """The configurations run for (variant, rotate); the first is the default."""
    if gluon:
        return GLUON_CONFIGS if rotate else CONFIGS[variant][:1]
    if amortized:
        return AMORTIZED_CONFIGS[variant] if rotate else UNROTATED_AMORTIZED[variant]
    if not rotate:
        return CONFIGS[variant][:1] if rotate_only else CONFIGS[variant]
    return (CONFIGS[variant][:1] if rotate_only else CONFIGS[variant]) + ROTATED_CONFIGS[variant]


def moved_bytes(variant, total, heads, batch, splits):
    elems_kv = total * heads * (192 + 128)
    elems_q = total * heads * 192
    if variant == "kv":
        return elems_kv * 3 + 2 * heads * tq.vt_padded_len(total, batch) // 16 * 4
    if variant == "qkv":
        return ((elems_kv + elems_q) * 3 + total * heads * 4
                + 2 * heads * tq.vt_padded_len(total, batch) // 16 * 4)
    return (elems_kv + elems_q) * 5 + (splits + 1) * 3 * batch * heads * 4 * 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="kv,qkv,heads")
    ap.add_argument("--rotate-only", action="store_true",
                    help="unrotated: the default configuration's timing only; rotated: the "
                         "default (dense) and the kron configurations")
    ap.add_argument("--amortized", action="store_true",
                    help="heads and qkv: the unrotated default, then the rotated "
                         "AMORTIZED_CONFIGS")
    ap.add_argument("--gluon", action="store_true",
                    help="heads only: the unrotated default, then the rotated GLUON_CONFIGS "
                         "(dense as the FA3 provider calls it, kron, the Gluon cast)")
    args = ap.parse_args()
    variants = (["heads"] if args.gluon else ["heads", "qkv"] if args.amortized
                else args.only.split(","))
    unknown = sorted(set(variants) - set(CONFIGS))
    if unknown:
        ap.error(f"--only: found {','.join(unknown)}, expected some of {','.join(CONFIGS)}")
    start = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, {sms} SMs")
    for variant in variants:
        for rotate in (False, True):
            chosen = configs(variant, rotate, args.rotate_only, args.amortized, args.gluon)
            if len(chosen) < 2:
                continue  # nothing to compare with the default
            for name, (lens, heads) in CHECKS.items():
                q, k, v, cu = inputs(lens, heads)
                total, batch = k.shape[0], len(lens)
                splits = th.head_splits(max(lens), batch, heads, sms)
                ref = run(variant, rotate, q, k, v, cu, lens,
                          buffers(variant, total, heads, batch, splits), splits, chosen[0])
                for config in chosen[1:]:
                    got = run(variant, rotate, q, k, v, cu, lens,
                              buffers(variant, total, heads, batch, splits), splits, config)
                    diff = differing_bytes(ref, got)
                    print(f"{variant} rotate={rotate} {name} {config}: bytes differing from the "
                          f"default: {sum(diff)} (per output: {diff})")
    print(f"checks done at {time.perf_counter() - start:.0f} s")
    for variant in variants:
        for rotate in (False, True):
            shapes = dict(SHAPES, **SMALL_SHAPES) if args.gluon else SHAPES
            for name, (lens, heads) in shapes.items():
                _time(variant, rotate, name, lens, heads, sms,
                      configs(variant, rotate, args.rotate_only, args.amortized, args.gluon))
        print(f"{variant} timed at {time.perf_counter() - start:.0f} s")


def _time(variant, rotate, name, lens, heads, sms, chosen):
    q, k, v, cu = inputs(lens, heads)
    total, batch = k.shape[0], len(lens)
    splits = th.head_splits(max(lens), batch, heads, sms)
    moved = moved_bytes(variant, total, heads, batch, splits)
    out = buffers(variant, total, heads, batch, splits)
    for config in chosen:
        ms = triton.testing.do_bench(
            lambda config=config: run(variant, rotate, q, k, v, cu, lens, out, splits, config),
            warmup=WARMUP_MS, rep=REP_MS)
        print(f"{variant} rotate={rotate} {name} {config or 'default'}"
              f"{f' splits={splits}' if variant == 'heads' else ''}: {ms * 1e3:.0f} us, "
              f"{moved / ms / 1e9:.2f} TB/s")
    dst = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    src = torch.empty_like(dst)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=WARMUP_MS, rep=REP_MS)
    print(f"{variant} {name} copy of the same bytes: {moved / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
