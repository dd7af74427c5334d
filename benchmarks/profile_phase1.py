"""One shape's phase 1 for Nsight Compute: fp8 (attention alone, pre-quantized k/v), or 16-bit
with `--bf16` (the caller's bf16 q, k, v; FA3's bf16 forward as the peer).

    ncu --clock-control none --kernel-name regex:mla_prefill --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        python benchmarks/profile_phase1.py --kernel gluon --shape B1-S16384-H16

Runs the chosen phase-1 kernel four times (three warm-ups for ncu's --launch-skip);
`--kernel fa3`: FlashAttention-3's FP8 forward on inputs quantized beforehand (the peer the
attention-alone goal divides by; its kernel is CUTLASS's `device_kernel`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    from prefill import SHAPES, make_batch

    from mla_plugins.core.api import plan_prefill
    from mla_plugins.core.kernels import triton_quant as tq
    from mla_plugins.core.kernels.triton_kernel import (
        BF16_CONFIG,
        FP8_CONFIG,
        GLUON_BF16_CONFIG,
        GLUON_FP8_CONFIG,
        run_prefill,
    )
    from tests.gpu.conftest import make_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=["gluon", "triton", "fa3"], default="gluon")
    ap.add_argument("--shape", default="B1-S16384-H16")
    ap.add_argument("--bf16", action="store_true",
                    help="16-bit: the Gluon (or portable) kernel's bf16 default, FA3's bf16 forward")
    args = ap.parse_args()
    lq, lk, heads = {n: (q, k, h) for n, q, k, h in SHAPES}[args.shape]
    if args.bf16:
        cfg = GLUON_BF16_CONFIG if args.kernel == "gluon" else BF16_CONFIG
    else:
        cfg = GLUON_FP8_CONFIG if args.kernel == "gluon" else FP8_CONFIG
    q, k, v, cq, ck = make_batch(lq, lk, heads, "cuda")
    if args.kernel == "fa3":
        from peers import fa3_peer, head_quant_qkv

        quantized = None if args.bf16 else head_quant_qkv(q, k, v, cq.tolist(), ck.tolist())
        run, _ = fa3_peer(q, k, v, cq, ck, max(lq), max(lk), 192 ** -0.5, fp8=not args.bf16,
                          quantized=quantized)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        return
    plan = plan_prefill(cq, ck, num_heads=heads, causal=True, kernel="triton", tile_q=cfg.block_m, num_workers=1)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device="cuda")
    po = torch.empty(1, heads, 128, device="cuda")
    pl = torch.empty(1, heads, device="cuda")
    if args.bf16:
        inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=False)
        for _ in range(4):
            run_prefill(inputs, plan, out, None, po, pl, config=cfg)
        torch.cuda.synchronize()
        return
    inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=True)
    quant = tq.quantize_qkv(q, k, v, cq, ck, len(lq), max(lq), max(lk), torch.float8_e4m3fn,
                             rotate=inputs.fp8_rotate)
    for _ in range(4):
        run_prefill(inputs, plan, out, None, po, pl, config=cfg, quantized=quant)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
