"""Where `fp8_outliers`' time goes (issue 22): each launch of the Triton provider's fp8 path
timed alone, with and without the outliers, through the same functions the provider calls.

    PYTHONPATH=. python benchmarks/outlier_parts.py [--shapes a,b] [--out results/x.json]

First a check (a small batch): the side tiles of `write_outlier_sides` against core/fp8.py's
`split_quantize`, byte for byte, printing the first mismatches if any (the GPU test
`test_quantization_is_the_rule` says only that they differ). Then per shape of
benchmarks/prefill.py (bf16 inputs with features 7 and 128-131 of q and k x10), GPU time of
CUDA-graph replays (serving._graph_ms, per call):
- "quant": `quantize_qkv` as by default; "quant_maxima": the same publishing the per-feature
  maxima (`outliers=`, its int32 buffer zeroed in the same graph), "reload" (the rows read
  again after the cast), "quant_maxima_held": from the held tiles;
- "sides": `write_outlier_sides` (the selection and the side tiles);
- "attn": phase 1 on the quantized tensors (`run_prefill(quantized=...)`, the Gluon kernel
  where `batch_config` takes the batch), "attn_sides": the same with the side product
  (the Gluon kernel where GLUON_OUTLIERS lets it), "attn_portable_sides": the portable
  kernel's.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from accuracy import FEATURES  # noqa: E402
from outlier_cost import shape_rows  # noqa: E402
from prefill import make_batch  # noqa: E402
from serving import _graph_ms  # noqa: E402

CALLS = 10


def check_sides(device) -> bool:
    from mla_plugins.core import fp8
    from tests.core.helpers import random_batch
    from tests.gpu.conftest import quantize_outliers, scale_outliers

    lens_q, lens_k = [300, 0, 520, 200], [700, 40, 520, 333]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 4, device=device)
    scale_outliers(q, k, 20.0)
    f8 = torch.float8_e4m3fn
    _, _, _, sel, sides = quantize_outliers(q, k, v, cq, ck, f8)
    feats = fp8.outlier_features(q.cpu(), k.cpu(), cq.tolist(), ck.tolist())
    ok = torch.equal(sel.long().cpu(), feats)
    print(f"selection as the rule: {ok}")
    for x, side, cu, block, op in ((q, sides[0], cq.tolist(), fp8.Q_BLOCK, "q"),
                                   (k, sides[1], ck.tolist(), fp8.KV_BLOCK, "k")):
        want = fp8.split_quantize(x.cpu(), cu, feats, f8, block=block, operand=op)[2]
        got = side.cpu().view(torch.uint8)
        bad = (got != want.view(torch.uint8)).nonzero()
        print(f"{op} side: {len(bad)} of {got.numel()} bytes differ")
        for t, h, c in bad[:8].tolist():
            print(f"  row {t} head {h} column {c}: got {got[t, h, c].item():#04x}, want "
                  f"{want.view(torch.uint8)[t, h, c].item():#04x}")
        ok = ok and not len(bad)
    return ok


def measure_shape(name, lq, lk, heads, device) -> dict:
    import mla_plugins
    from mla_plugins.core.api import _prefill_inputs
    from mla_plugins.core.kernels import triton_kernel as tk
    from mla_plugins.core.kernels import triton_quant as tq

    q, k, v, cq, ck = make_batch(lq, lk, heads, device)
    q[..., FEATURES] *= 10
    k[..., FEATURES] *= 10
    plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=heads, fp8=True,
                                    kernel="triton", device=device)
    f8 = torch.float8_e4m3fn
    batch, mq, mk = len(lq), max(lq), max(lk)
    limit = float(torch.finfo(f8).max)
    quantized = tq.quantize_qkv(q, k, v, cq, ck, batch, mq, mk, f8, limit)
    bufs = tq.outlier_buffers(q, k, batch, f8, (sum(lq), sum(lk)))
    row = {"shape": name}

    def quant_maxima(maxima="reload"):
        bufs[0].zero_()
        tq.quantize_qkv(q, k, v, cq, ck, batch, mq, mk, f8, limit, out=quantized, outliers=bufs[0],
                        maxima=maxima)

    quant_maxima()
    sides = tq.write_outlier_sides(q, k, quantized[1], quantized[4], bufs, cq, ck, batch, mq, mk,
                                   limit)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    scratch = {}

    def attn(outliers, portable=False):
        inputs = _prefill_inputs(q, k, v, cq, ck, None, True, True, plan, fp8_outliers=outliers)
        part_o = torch.empty(plan.partial_rows, heads, 128, device=device)
        part_l = torch.empty(plan.partial_rows, heads, device=device)
        scratch[(outliers, portable)] = (part_o, part_l)

        def fn():
            saved = tk.GLUON_OUTLIERS
            tk.GLUON_OUTLIERS = not portable
            try:
                tk.run_prefill(inputs, plan, out, None, part_o, part_l, quantized=quantized,
                               sides=sides if outliers else None)
            finally:
                tk.GLUON_OUTLIERS = saved
        return fn

    fns = {"quant": lambda: tq.quantize_qkv(q, k, v, cq, ck, batch, mq, mk, f8, limit, out=quantized),
           "quant_maxima": quant_maxima, "quant_maxima_held": lambda: quant_maxima("held"),
           "sides": lambda: tq.write_outlier_sides(q, k, quantized[1], quantized[4], bufs, cq, ck,
                                                   batch, mq, mk, limit),
           "attn": attn(False), "attn_sides": attn(True), "attn_portable_sides": attn(True, True)}
    for key, fn in fns.items():
        try:
            row[f"{key}_us"] = round(1e3 * _graph_ms(fn, calls=CALLS) / CALLS, 2)
        except Exception as exc:  # noqa: BLE001 - a measurement: say why and go on
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    args, device, rows = shape_rows("outlier_parts.py", measure_shape, check_sides)
    ok = args.before
    keys = ("quant", "quant_maxima", "quant_maxima_held", "sides", "attn", "attn_sides", "attn_portable_sides")
    print(f"\n{'shape':>26} " + " ".join(f"{k[:12]:>12}" for k in keys) + "   (µs, GPU time)")
    for r in rows:
        print(f"{r['shape']:>26} " + " ".join(f"{r.get(k + '_us', float('nan')):>12.1f}" for k in keys))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "sides_as_the_rule": ok,
                       "rows": rows}, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
