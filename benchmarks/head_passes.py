"""GPU time of the per-(sequence, head) quantization's two launches apart
(`triton_heads.quantize_heads`, what the FA3 provider runs for fp8): pass 1 (the scale pass)
and pass 2 (the cast), unrotated and with the Gluon cast, so that the rotation's cost at a
shape can be put on the pass that carries it.

    PYTHONPATH=. python benchmarks/head_passes.py [--shapes B1-S1024-H16,...] [--out F.json]

Per shape: bf16 q, k, v (normal, fresh), the provider's `splits` and `sms`; each pass replayed
alone from a CUDA graph (the other launch swapped for one that launches nothing, its outputs
left from a full call before), three rounds with the variants interleaved, the median. The
variants: "plain" (the amax rule), "gluon" (rotated, the provider's default), "gluon_p1w16" and
"gluon_p1w4" (pass 1 rotated at 16 and 4 warps in place of triton_heads.BOUND_WARPS_ROTATED),
"plain_nopdl" and "gluon_nopdl" (the passes as two ordinary launches, triton_heads.PDL False;
the others launch pass 2 as pass 1's programmatic dependent where `head_pdl` allows: the
plain ones; the Gluon cast without PDL by default, "gluon_pdl" with it, PDL_GLUON),
"gluon_grid3" (the Gluon cast's programs in (program, sequence, head) order,
gluon_rotate.QK_FIRST False; "gluon_grid3_nopdl" also without PDL), "plain_late" and
"gluon_late" (PDL without pass 1's early trigger, triton_heads.PDL_EARLY False).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefill import SHAPES, graph_ms  # noqa: E402
from rotation_cost import _knobs_set  # noqa: E402

#: name: (rotate, {triton_heads constant, or gluon_rotate's as "gr.NAME": value} set for the
#: variant's calls)
VARIANTS = {"plain": (False, {}), "gluon": (True, {}),
            "gluon_p1w16": (True, {"BOUND_WARPS_ROTATED": 16}),
            "gluon_p1w4": (True, {"BOUND_WARPS_ROTATED": 4}),
            "plain_nopdl": (False, {"PDL": False}), "gluon_nopdl": (True, {"PDL": False}),
            "gluon_grid3": (True, {"gr.QK_FIRST": False}),
            "plain_late": (False, {"PDL_EARLY": False}),
            "gluon_late": (True, {"PDL_GLUON": True, "PDL_EARLY": False}),
            "gluon_pdl": (True, {"PDL_GLUON": True}),
            "gluon_grid3_nopdl": (True, {"gr.QK_FIRST": False, "PDL": False})}


class _NoLaunch:
    """A kernel's stand-in that launches nothing (`kernel[grid](...)` returns None)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _call(th, q, k, v, cu_q, cu_k, lens_q, lens_k, splits, out, sms, rotate):
    def fn():
        th.quantize_heads(q, k, v, cu_q, cu_k, len(lens_q), max(lens_q), max(lens_k), splits,
                          torch.float8_e4m3fn, rotate=rotate, rotation="gluon" if rotate else None,
                          sms=sms, out=out)
    return fn


def measure(name, lens_q, lens_k, heads, variants):
    from mla_plugins.core.kernels import gluon_rotate as gr
    from mla_plugins.core.kernels import triton_heads as th

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, heads, 192, device=dev, generator=gen).bfloat16()
    k = torch.randn(tk, heads, 192, device=dev, generator=gen).bfloat16()
    v = torch.randn(tk, heads, 128, device=dev, generator=gen).bfloat16()
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    splits = th.head_splits(max(lens_q + lens_k), len(lens_q), heads, sms)
    out = tuple(torch.empty(shape, dtype=dtype, device=dev) for _, shape, dtype in
                th.head_workspace_layout(tq, tk, len(lens_q), heads, splits, torch.float8_e4m3fn))
    row = {"shape": name, "splits": splits, "sms": sms}
    samples = {}
    for _ in range(3):
        for key in variants:
            rotate, knobs = VARIANTS[key]
            fn = _call(th, q, k, v, cu_q, cu_k, lens_q, lens_k, splits, out, sms, rotate)
            # each pass alone: the other one's launch left out
            skip = {"pass1": "_gluon_cast_kernel" if rotate else "_head_cast_kernel",
                    "pass2": "_head_bound_kernel"}
            with _knobs_set({(gr, n[3:]) if n.startswith("gr.") else (th, n): val
                             for n, val in knobs.items()}):
                samples.setdefault(f"{key}_both", []).append(graph_ms(fn))
                for which, left_out in skip.items():
                    fn()  # the left-out pass's outputs, fresh
                    with _knobs_set({(th, left_out): _NoLaunch()}):
                        samples.setdefault(f"{key}_{which}", []).append(graph_ms(fn))
    for key, got in samples.items():
        got = [g for g in got if g]
        if got:
            row[f"{key}_us"] = round(1000 * statistics.median(got), 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="B1-S1024-H16,B1-S2048-H8,B16-S512-H16,B1-S8192-H128")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: found {unknown}, expected some of {list(VARIANTS)}")
    by_name = {s[0]: s for s in SHAPES}
    rows = []
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.shapes.split(","):
        _, lens_q, lens_k, heads = by_name[name]
        rows.append(measure(name, lens_q, lens_k, heads, variants))
        if args.out:  # after each shape: a time limit keeps the shapes done
            with open(args.out, "w") as f:
                json.dump({"env": env, "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
