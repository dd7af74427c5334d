"""Run small Triton-kernel cases one per fresh process and report error or crash for each.

    PYTHONPATH=. python benchmarks/diagnose.py

A kernel fault (illegal instruction / address) kills the CUDA context of its process;
running each case in its own process with CUDA_LAUNCH_BLOCKING=1 says which cases fault
and in which launch, instead of one fault failing everything after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CASES = [
    # name, lens_q, lens_k, heads, causal, fp8, use_tma
    ("aligned-inbounds", [256, 256], [256, 256], 4, True, True, True),
    ("ragged-end", [300], [300], 4, True, True, True),
    ("unaligned-start-inbounds", [100, 284, 1024], [100, 284, 1024], 4, True, True, True),
    ("unaligned-start-inbounds-noncausal", [100, 284, 1024], [100, 284, 1024], 4, False, True, True),
    ("ragged-end-noncausal", [600], [600], 4, False, True, True),
    ("ragged-end-bf16", [300], [300], 4, True, False, True),
    ("unaligned-start-bf16", [100, 284, 1024], [100, 284, 1024], 4, True, False, True),
    ("ragged-end-fp8-notma", [300], [300], 4, True, True, False),
    ("unaligned-start-fp8-notma", [100, 284, 1024], [100, 284, 1024], 4, True, True, False),
    ("no-key-rows", [300, 5], [100, 0], 4, True, True, True),
    ("varlen-bench", [3000, 1500, 800, 4096, 200, 2500], [3000, 1500, 800, 4096, 200, 2500], 8, True, True, True),
]


def one(spec):
    import torch

    from mla_plugins.core.api import plan_prefill
    from mla_plugins.core.kernels.triton_kernel import BF16_CONFIG, FP8_CONFIG, run_prefill
    from tests.core.helpers import random_batch
    from tests.gpu.conftest import make_inputs, reference_on_device, rel_err

    name, lq, lk, heads, causal, fp8, tma = spec
    dev = os.environ.get("DIAG_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1 for a dry run
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # the interpreter mishandles bf16
    q, k, v, cq, ck = random_batch(lq, lk, heads, device=dev, seed=1, dtype=dtype)
    inputs = make_inputs(q, k, v, cq, ck, causal=causal, fp8=fp8)
    cfg = FP8_CONFIG if fp8 else BF16_CONFIG
    from dataclasses import replace

    cfg = replace(cfg, use_tma=tma)
    plan = plan_prefill(cq, ck, num_heads=heads, causal=causal, kernel="triton", tile_q=cfg.block_m, num_workers=1)
    out = torch.full((q.shape[0], heads, 128), float("nan"), dtype=q.dtype, device=dev)
    lse = torch.full((q.shape[0], heads), float("nan"), device=dev)
    po = torch.empty(1, heads, 128, device=dev)
    pl = torch.empty(1, heads, device=dev)
    run_prefill(inputs, plan, out, lse, po, pl, config=cfg)
    if dev == "cuda":
        torch.cuda.synchronize()
    ref, ref_lse = reference_on_device(q, k, v, cq, ck, causal=causal)
    fin = torch.isfinite(ref_lse)
    return {"err": rel_err(out, ref), "nan": bool(torch.isnan(out).any()),
            "lse_inf_ok": bool(torch.equal(torch.isfinite(lse), fin))}


def main():
    if len(sys.argv) > 1:
        spec = json.loads(sys.argv[1])
        print("RESULT " + json.dumps(one(spec)), flush=True)
        return
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for spec in CASES:
        p = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True,
                           env=env, timeout=120)
        res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if res:
            print(f"{spec[0]:40s} {res[0][7:]}", flush=True)
        else:
            lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
            where = [ln for ln in lines if ln.startswith("File ") and "mla_plugins" in ln][-2:]
            err = [ln for ln in lines if "Error" in ln][-1:]
            print(f"{spec[0]:40s} FAILED rc={p.returncode}: " + " | ".join(where + err)[:700], flush=True)


if __name__ == "__main__":
    main()
