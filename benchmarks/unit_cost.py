"""Per-unit cost of each fp8 phase-1 kernel: fixed part and part per 128-key block.

    PYTHONPATH=. python benchmarks/unit_cost.py [--out benchmarks/results/h200-unit-cost.json]

The variants run (benchmarks/NOTES.md) fit a cost of ~16-20 us per Gluon CTA beyond its key
blocks (B16-S512-H16: 24 us per unit of 2.5 blocks on average), far above what its
prologue and epilogue should take. This measures it directly, in GPU time (CUDA graph
replay; the first run timed call by call and measured the host's ~130 us per launch): batches of equal units
(every sequence 128 query rows over 128 * n keys, not causal, so each unit is n full key
blocks; 8 units per SM), attention alone on pre-quantized k/v, for n = 1 ... 32; per kernel
a least-squares line time_per_unit = fixed + n * per_block. The same with causal masking
(bottom-right: the last key block of each unit masked) shows the masked block's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCKS = (1, 2, 4, 8, 16, 32)
HEADS = 16


def main():
    from prefill import bench, environment, graph_ms, make_batch

    from mla_plugins.core.api import plan_prefill
    from mla_plugins.core.kernels import triton_quant as tq
    from mla_plugins.core.kernels.triton_kernel import FP8_CONFIG, GLUON_FP8_CONFIG, run_prefill
    from tests.gpu.conftest import make_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200-unit-cost.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    batch = max(1, 8 * sms // HEADS)  # 8 units (128 rows, one head) per SM
    kernels = {"triton 64x64 w4 s4": FP8_CONFIG,
               f"gluon 128x128 s{GLUON_FP8_CONFIG.num_stages}": GLUON_FP8_CONFIG}
    rows = []
    for causal in (False, True):
        for n in BLOCKS:
            lq, lk = [128] * batch, [128 * n] * batch
            q, k, v, cq, ck = make_batch(lq, lk, HEADS, device)
            inputs = make_inputs(q, k, v, cq, ck, causal=causal, fp8=True)
            quant = tq.quantize_qkv(q, k, v, cq, ck, batch, max(lq), max(lk), inputs.fp8_dtype,
                                    rotate=inputs.fp8_rotate)
            for label, cfg in kernels.items():
                plan = plan_prefill(cq, ck, num_heads=HEADS, causal=causal, kernel="triton", tile_q=cfg.block_m,
                                    num_workers=1)
                out = torch.empty(q.shape[0], HEADS, 128, dtype=q.dtype, device=device)
                po = torch.empty(1, HEADS, 128, device=device)
                pl = torch.empty(1, HEADS, device=device)
                fn = (lambda i=inputs, p=plan, c=cfg, o=out, po=po, pl=pl, qz=quant:
                      run_prefill(i, p, o, None, po, pl, config=c, quantized=qz))
                # GPU time: replayed from a CUDA graph. Timed call by call (bench), the small
                # points measured the host's launch time (~130 us), not the kernel.
                ms = graph_ms(fn) or bench(fn)
                # units of 128 rows per head; the portable kernel runs two 64-row programs each
                units = batch * HEADS
                row = {"kernel": label, "causal": causal, "blocks": n, "batch": batch,
                       "ms": ms, "us_per_unit_per_sm": ms * 1e3 * sms / units}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v, inputs, quant
            torch.cuda.empty_cache()
    fits = []
    for causal in (False, True):
        for label in kernels:
            pts = [(r["blocks"], r["us_per_unit_per_sm"]) for r in rows
                   if r["kernel"] == label and r["causal"] == causal]
            x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
            y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
            a = torch.stack((torch.ones_like(x), x), 1)
            fixed, per_block = torch.linalg.lstsq(a, y[:, None]).solution[:, 0].tolist()
            fits.append({"kernel": label, "causal": causal, "fixed_us": fixed,
                         "per_block_us": per_block})
            print(f"{label} causal={causal}: {fixed:.2f} us fixed + {per_block:.3f} us per "
                  "128-key block, per unit on one SM", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"points": rows, "fits": fits, "env": environment(),
                   "command": "PYTHONPATH=. python benchmarks/unit_cost.py " + " ".join(sys.argv[1:])},
                  f, indent=1)


if __name__ == "__main__":
    main()
