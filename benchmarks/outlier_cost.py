"""What `fp8_outliers` (core/fp8.py, issue 22) costs end to end, through the Triton provider.

    PYTHONPATH=. python benchmarks/outlier_cost.py [--shapes a,b] [--out results/x.json]

Per shape of benchmarks/prefill.py: one plan (`plan_prefill(..., kernel="triton")`), fp8 from
bf16 inputs (the quantization and the attention timed), replayed from a CUDA graph (GPU
time; median of three rounds, the variants interleaved):
- "plain": fp8 as by default (the Gluon kernel where `batch_config` takes it);
- "portable": fp8 with the Gluon kernel off (MLA_PLUGINS_GLUON=0): the kernel fp8_outliers
  runs on, without the outliers;
- "outliers": fp8_outliers=True as by default (the quantization publishing the per-feature
  maxima, the selection and side tiles' launch, the extra 32-deep fp8 product in the Gluon
  kernel where it takes the batch, else the portable one);
- "outliers_portable": the same with triton_kernel.GLUON_OUTLIERS off (the portable kernel
  takes every batch);
- "outliers_held": the default with triton_quant.OUTLIER_MAXIMA "held" (the maxima from the
  tiles the quantization casts, not from the rows read again);
- "rotated": fp8_rotate=True (dense), the rotation for comparison.
Errors against float64 on the outlier recipe (features 7 and 128-131 of q and k scaled by 10)
beside each. Issue 22's bounds: at most +3% at the four large shapes, +5% at the small ones,
against "plain". (Stop 45's run, `results/h100-outliers-stop45.json`, predates these names:
its "outliers" is today's "outliers_portable" and its "outliers_gluon" today's "outliers",
both of stop 45's rule: bf16 side tiles and a separate selection pass.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefill import SHAPES  # noqa: E402
from rotation_cost import OUTLIER_FEATURES, _knobs_set, measure_variants, summarize  # noqa: E402

VARIANTS = {"plain": {}, "portable": {"gluon": False}, "outliers": {"fp8_outliers": True},
            "outliers_portable": {"fp8_outliers": True, "knobs": {("tk", "GLUON_OUTLIERS"): False}},
            "outliers_held": {"fp8_outliers": True, "knobs": {("tq", "OUTLIER_MAXIMA"): "held"}},
            "rotated": {"fp8_rotate": True}}


def measure_shape(name, lq, lk, heads, device) -> dict:
    from prefill import make_batch

    import mla_plugins
    from mla_plugins.core.kernels import triton_kernel as tk
    from mla_plugins.core.kernels import triton_quant as tq
    from tests.gpu.conftest import reference_on_device

    q, k, v, cq, ck = make_batch(lq, lk, heads, device)
    q[..., OUTLIER_FEATURES] *= 10
    k[..., OUTLIER_FEATURES] *= 10
    ref, _ = reference_on_device(q, k, v, cq, ck, heads_per_step=4)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    row = {"shape": name}
    fns = {}
    for key, opts in VARIANTS.items():
        opts = dict(opts)
        gluon = opts.pop("gluon", True)
        knobs = {({"tk": tk, "tq": tq}[m], name): value
                 for (m, name), value in opts.pop("knobs", {}).items()}
        env = {} if gluon else {"MLA_PLUGINS_GLUON": "0"}
        # its own plan: the provider's configuration is decided per plan
        plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=heads, fp8=True,
                                        kernel="triton", device=device)

        def fn(plan=plan, opts=opts, env=env, knobs=knobs):
            os.environ.update(env)
            try:
                with _knobs_set(knobs):
                    mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=True, out=out,
                                            kernel="triton", **opts)
            finally:
                for name_ in env:
                    os.environ.pop(name_)

        fns[key] = fn
    samples = {key: [] for key in fns}
    try:
        measure_variants(fns, out, ref, row, samples)
    except Exception as exc:  # noqa: BLE001 - a measurement: say why and go on
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    summarize(row, samples)
    print(json.dumps(row), flush=True)
    return row


def shape_rows(script: str, measure, before=None):
    """(args, device, rows): the command line both outlier scripts take (--out, --shapes),
    `before(device)` first if given (its result as `args.before`), then `measure(name, q
    lens, k lens, heads, device)` per shape of benchmarks/prefill.py asked for."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"benchmarks/{script} needs a CUDA GPU")
    device = torch.device("cuda")
    args.before = before(device) if before is not None else None
    wanted = set(args.shapes.split(",")) if args.shapes else None
    return args, device, [measure(n, lq, lk, h, device) for n, lq, lk, h in SHAPES
                          if wanted is None or n in wanted]


def main() -> None:
    args, device, rows = shape_rows("outlier_cost.py", measure_shape)
    print(f"\n{'shape':>26} {'plain ms':>9} {'portable':>9} {'outliers':>9} {'outl port':>9} "
          f"{'held':>9} {'rotated':>9} {'err plain':>9} {'err outl':>9} {'err rot':>9}")
    def cost(r, key):
        x = r.get(f"{key}_cost")
        return "-" if x is None else f"{100 * x:+.1f}%"

    for r in rows:
        c = lambda key, r=r: cost(r, key)  # noqa: E731
        print(f"{r['shape']:>26} {r.get('plain_graph_ms', 0):>9.3f} {c('portable'):>9} "
              f"{c('outliers'):>9} {c('outliers_portable'):>9} "
              f"{c('outliers_held'):>9} {c('rotated'):>9} {r.get('err_plain', 0):>9.4f} {r.get('err_outliers', 0):>9.4f} "
              f"{r.get('err_rotated', 0):>9.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
