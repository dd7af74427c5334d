"""Accuracy lead for issue 22 (CPU, float64): the outlier features of q and k kept out of the
fp8 cast, against the rotation.

    python benchmarks/outlier_split.py [--tokens 2048] [--heads 16] [--features 4,8,16]
    python benchmarks/outlier_split.py --rule        # stop 46: fp8_outliers' rule, and 16 features

For each (sequence, head) the r features with the largest amax(|q_f|) * amax(|k_f|) over the
sequence's rows are taken out of q and k before core/fp8.py's block rule and their products
added back unrounded (stop 44's lead; the rule built since: core/fp8.py's fp8_outliers); every
other feature, and v, go through the block rule (rotated or not). The logits' other terms are
what they were; P is exact here (the reference's rule). Relative L2 error of the output
against float64 on the issue's recipe (accuracy.py's: features 7 and 128-131 of q and k
scaled), two draws each, beside the block rule unrotated and rotated; "split r=N rotated":
the features left in the cast rotated (a fallback for outliers beyond the r taken out).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from accuracy import recipe  # noqa: E402

from mla_plugins.core import fp8  # noqa: E402
from mla_plugins.core.reference import reference_attention, relative_error  # noqa: E402

F8 = torch.float8_e4m3fn


def outlier_mask(q: torch.Tensor, k: torch.Tensor, r: int) -> torch.Tensor:
    """[heads, 192] True at each head's r features of largest amax(|q_f|) * amax(|k_f|)."""
    score = q.abs().amax(0) * k.abs().amax(0)
    return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(r, -1).indices, True)


def errors(kind: str, value: float, tokens: int, heads: int, seed: int, rs) -> dict:
    q, k, v, _ = recipe(kind, value, "cpu", seed, shape=(tokens, heads))
    q, k, v = (t.float() for t in (q, k, v))
    cu = torch.tensor([0, tokens])
    ref, _ = reference_attention(q, k, v, cu, cu, causal=True)
    res = {}
    for name, rot in (("block", False), ("rotated", True)):
        out, _ = reference_attention(q, k, v, cu, cu, causal=True, fp8_dtype=F8, fp8_rotate=rot)
        res[name] = relative_error(out, ref)
    rotation = fp8.rotation_matrix(torch.float32)
    for r in rs:
        keep = outlier_mask(q, k, r)
        for rot in (False, True):
            qf, kf, vf = fp8.block_fake_quantize_qkv(q * ~keep, k * ~keep, v, [0, tokens],
                                                     [0, tokens], F8, rotate_=rot)
            if rot:  # back to the features' basis (R orthonormal: the same logits)
                qf, kf = qf @ rotation.T, kf @ rotation.T
            out, _ = reference_attention(qf + q * keep, kf + k * keep, vf, cu, cu, causal=True)
            res[f"split r={r}" + (" rotated" if rot else "")] = relative_error(out, ref)
    return res


def rule_variants(kind: str, value: float, tokens: int, heads: int, seed: int) -> dict:
    """core/fp8.py's fp8_outliers (8 features, fp8 hi/lo corrections [h, l, l] x [l, h, l])
    against 16 features with two terms ([h, l] x [l, h]: the same 32 columns, ql kl
    dropped), both on the plain block rule's values (stop 46)."""
    q, k, v, cu = recipe(kind, value, "cpu", seed, shape=(tokens, heads))
    ref, _ = reference_attention(q, k, v, cu, cu)
    cq = cu.tolist()
    score = q.abs().float().amax(0) * k.abs().float().amax(0)
    feats16 = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :16].sort(-1).values

    def two_terms(x, block, operand):
        scale = fp8.block_scales(x, cq, F8, block=block)
        u = fp8.block_cast(x, scale, fp8.fp8_max(F8))
        picked = torch.gather(u, 2, feats16[None].expand(x.shape[0], -1, -1))
        h = picked.to(F8)
        lo = (picked - h.float()).to(F8)
        side = torch.cat((h, lo) if operand == "q" else (lo, h), dim=-1)
        return fp8.split_dequantize(u.to(F8), scale, side)

    vf = fp8.block_dequantize(*fp8.block_quantize(v, cq, F8, block=fp8.KV_BLOCK))
    out, _ = reference_attention(two_terms(q, fp8.Q_BLOCK, "q"), two_terms(k, fp8.KV_BLOCK, "k"),
                                 vf, cu, cu, softmax_scale=q.shape[-1] ** -0.5)
    rule, _ = reference_attention(q, k, v, cu, cu, fp8_dtype=F8, fp8_outliers=True)
    return {"rule": relative_error(rule, ref), "16 features, 2 terms": relative_error(out, ref)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--features", default="4,8,16", help="r values, comma-separated")
    ap.add_argument("--rule", action="store_true",
                    help="fp8_outliers' rule against 16 features with two correction terms")
    args = ap.parse_args()
    if args.rule:
        for kind, value in (("outliers", 10), ("outliers", 30), ("sigma", 1)):
            for seed in (0, 1):
                got = rule_variants(kind, value, args.tokens, args.heads, seed)
                print(f"{kind} {value} seed {seed}: "
                      + ", ".join(f"{key} {err:.4f}" for key, err in got.items()), flush=True)
        return
    rs = [int(x) for x in args.features.split(",")]
    for kind, value in (("outliers", 1), ("outliers", 10), ("outliers", 30), ("sigma", 1), ("sigma", 3)):
        rows = [errors(kind, value, args.tokens, args.heads, seed, rs) for seed in (0, 1)]
        mean = {key: round(sum(r[key] for r in rows) / len(rows), 4) for key in rows[0]}
        print(f"{kind} {value}: {mean}", flush=True)


if __name__ == "__main__":
    main()
