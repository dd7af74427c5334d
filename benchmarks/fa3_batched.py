"""FA3's batched call against its varlen call on batches of equal lengths (GPU time).

Frameworks call `flash_attn_varlen_func` for prefill; a batch whose sequences all have one
length is also a [B, S, H, D] tensor, which FA3's `flash_attn_func` takes with another tile
scheduler (no varlen prologue, its own tile order). This measures whether the FA3 provider
should route such batches there: bf16 and FP8 (inputs quantized beforehand, descales
[B, H]), both public calls with their defaults, CUDA-graph replay, outputs compared.

    PYTHONPATH=. python benchmarks/fa3_batched.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.peers import fa3
from benchmarks.prefill import flops, graph_ms

SHAPES = (("B1-S8192-H128", 1, 8192, 128), ("B4-S4096-H16", 4, 4096, 16),
          ("B8-S2048-H128", 8, 2048, 128), ("B16-S512-H16", 16, 512, 16),
          ("B1-S1024-H16", 1, 1024, 16), ("B32-S256-H16", 32, 256, 16))
F8 = torch.float8_e4m3fn


def _calls(fa, q, k, v, cu, b, s, h, extra):
    """The varlen and the batched call of FA3 on the same tensors, writing into `state`."""
    state = {}
    scale = 192 ** -0.5

    def varlen():
        state["v"] = fa.flash_attn_varlen_func(q, k, v, cu, cu, s, s, softmax_scale=scale,
                                               causal=True, **extra)

    def batched():
        state["b"] = fa.flash_attn_func(q.view(b, s, h, 192), k.view(b, s, h, 192),
                                        v.view(b, s, h, 128), softmax_scale=scale, causal=True,
                                        **extra)

    return varlen, batched, state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    fa = fa3()
    dev = torch.device("cuda")
    rows = []
    for name, b, s, h in SHAPES:
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b * s, h, 192, device=dev, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(b * s, h, 192, device=dev, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(b * s, h, 128, device=dev, generator=gen, dtype=torch.bfloat16)
        cu = torch.arange(0, (b + 1) * s, s, device=dev, dtype=torch.int32)
        tflop = flops([s] * b, [s] * b, h) / 1e12
        for mode in ("bf16", "fp8"):
            if mode == "fp8":
                qq, kk, vv = (x.to(F8) for x in (q, k, v))
                ds = torch.rand(b, h, device=dev, generator=gen) + 0.5
                extra = dict(q_descale=ds, k_descale=ds, v_descale=ds)
            else:
                qq, kk, vv, extra = q, k, v, {}
            varlen, batched, state = _calls(fa, qq, kk, vv, cu, b, s, h, extra)
            varlen()
            batched()
            ov = state["v"][0] if isinstance(state["v"], tuple) else state["v"]
            ob = state["b"][0] if isinstance(state["b"], tuple) else state["b"]
            diff = (ov.float() - ob.reshape(ov.shape).float()).abs().max().item()
            mv, mb = graph_ms(varlen), graph_ms(batched)
            row = {"shape": name, "mode": mode, "varlen_ms": mv, "batched_ms": mb,
                   "varlen_tflops": tflop / mv * 1e3, "batched_tflops": tflop / mb * 1e3,
                   "batched_vs_varlen": mv / mb, "max_diff": diff}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
