"""The accuracy section of benchmarks/prefill.py: fp8 against float64 where inputs are hard.

Two recipes on one B1-S2048-H16 causal batch (bf16 inputs, fresh random draw per case):
- outliers: q and k Gaussian with features 7 and 128-131 scaled by 1, 10 or 30 (keys of
  real models carry a few such features; block scales over a row's 192 features cannot
  isolate them, and the fp8 rounding of the outlier products moves the logits by whole
  units);
- sigma: q, k, v Gaussian scaled by 1, 3 or 5 in every feature (peakier softmax).
Each case: relative L2 error of the output against float64 (and the largest lse error over
rows that see a key) for ours in fp8 with and without the rotation (the Triton provider and
the FlashAttention-3 provider), ours with the outlier features' rounding corrected
(`fp8_outliers`: the Triton and torch providers; not with the rotation), FA3 FP8
on its own (one descale per (sequence, head), no
rotation: what a framework would hand it), cuDNN FP8 (per-tensor descales), and bf16 as the
floor (ours and FA3).

    PYTHONPATH=. python benchmarks/accuracy.py     # the section alone
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

FEATURES = (7, 128, 129, 130, 131)
SHAPE = (2048, 16)


def recipe(kind: str, value: float, device, seed: int, shape: tuple[int, int] = SHAPE):
    """bf16 (q, k, v) [tokens, heads, 192 / 192 / 128] of one causal sequence of `shape`
    (tokens, heads) on `device`, and its cu_seqlens."""
    s, h = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(s, h, 192, generator=gen)
    k = torch.randn(s, h, 192, generator=gen)
    v = torch.randn(s, h, 128, generator=gen)
    if kind == "outliers":
        for f in FEATURES:
            q[..., f] *= value
            k[..., f] *= value
    else:
        q, k, v = q * value, k * value, v * value
    cu = torch.tensor([0, s], dtype=torch.int32, device=device)
    return (*(t.to(device, torch.bfloat16) for t in (q, k, v)), cu)


def accuracy_section(device) -> list[dict]:
    rows = []
    cases = [("outliers", x) for x in (1, 10, 30)] + [("sigma", x) for x in (1, 3, 5)]
    for i, (kind, value) in enumerate(cases):
        rows.append(one_case(kind, value, device, seed=100 + i))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def one_case(kind: str, value: float, device, seed: int) -> dict:
    import peers

    import mla_plugins
    from tests.gpu.conftest import reference_on_device, rel_err

    q, k, v, cu = recipe(kind, value, device, seed=seed)
    ref, ref_lse = reference_on_device(q, k, v, cu, cu)
    seen = torch.isfinite(ref_lse)
    row = {"recipe": kind, "value": value, "shape": f"B1-S{SHAPE[0]}-H{SHAPE[1]}"}

    def put(name, fn):
        try:
            got = fn()
            out, lse = got if isinstance(got, tuple) else (got, None)
            row[name] = rel_err(out.float(), ref)
            if lse is not None:
                row[f"{name}_lse_max_abs"] = (lse.double() - ref_lse)[seen].abs().max().item()
        except Exception as exc:
            row[name] = None
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            traceback.print_exc()

    def ours(kernel, fp8, rotate=None, outliers=None):
        return mla_plugins.mla_prefill(q, k, v, cu, cu, fp8=fp8, fp8_rotate=rotate, kernel=kernel,
                                       return_lse=True, fp8_outliers=outliers)

    for kernel, label in (("triton", "ours"), ("flash_attn", "fa"), ("torch", "torch")):
        for rotate in (True, False):
            put(f"{label}_fp8_{'rot' if rotate else 'norot'}",
                lambda kernel=kernel, rotate=rotate: ours(kernel, True, rotate))
        put(f"{label}_bf16", lambda kernel=kernel: ours(kernel, False))
        if kernel != "flash_attn":  # FA3's API has no place for the side product
            put(f"{label}_fp8_outliers", lambda kernel=kernel: ours(kernel, True, False, True))
    hq = cu.tolist()

    def fa3_fp8():
        return peers.fa3_peer(q, k, v, cu, cu, SHAPE[0], SHAPE[0], 192**-0.5, fp8=True,
                              quantized=peers.head_quant_qkv(q, k, v, hq, hq))[1]()

    def cudnn_fp8():
        parts = [peers.per_tensor_quant(x) for x in (q, k, v)]
        quant = tuple(t for t, _ in parts) + tuple(d for _, d in parts)
        return peers.cudnn_fp8_peer(q, k, v, [SHAPE[0]], [SHAPE[0]], SHAPE[1], 192**-0.5,
                                    quantized=quant)[1]()

    put("fa3_fp8", fa3_fp8)
    put("fa3_bf16", lambda: peers.fa3_peer(q, k, v, cu, cu, SHAPE[0], SHAPE[0], 192**-0.5)[1]())
    put("cudnn_fp8", cudnn_fp8)
    rot, fa3 = row.get("ours_fp8_rot"), row.get("fa3_fp8")
    row["fa3_fp8_over_ours_fp8_rot"] = fa3 / rot if rot and fa3 else None
    split = row.get("ours_fp8_outliers")
    row["fa3_fp8_over_ours_fp8_outliers"] = fa3 / split if split and fa3 else None
    return row


def print_accuracy(rows) -> None:
    cols = ("ours_fp8_outliers", "ours_fp8_rot", "ours_fp8_norot",
            "fa_fp8_rot", "fa_fp8_norot", "torch_fp8_outliers", "torch_fp8_rot",
            "torch_fp8_norot", "fa3_fp8", "cudnn_fp8", "ours_bf16", "fa3_bf16",
            "fa3_fp8_over_ours_fp8_rot", "fa3_fp8_over_ours_fp8_outliers")
    print("\naccuracy: relative L2 error against float64, B1-S2048-H16 causal")
    print(f"{'recipe':>14} " + " ".join(f"{c[:14]:>14}" for c in cols))
    for r in rows:
        vals = [r.get(c) for c in cols]
        print(f"{r['recipe'] + ' ' + str(r['value']):>14} "
              + " ".join(f"{('-' if x is None else f'{x:.4f}'):>14}" for x in vals))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("benchmarks/accuracy.py needs a CUDA GPU")
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    print_accuracy(accuracy_section(torch.device("cuda")))
