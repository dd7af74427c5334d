"""What the fp8 rotation costs end to end, per implementation, on the H200 (GPU time).

    PYTHONPATH=. python benchmarks/rotation_cost.py [--out benchmarks/results/h200-rotation.json]

Issue 22's cost goal: fp8 end to end (bf16 in, the quantization and the attention timed) at
most 3% slower with the rotation at the four large shapes, 5% at the small ones. Per shape and
provider (`flash_attn`: FA3 after `triton_heads.quantize_heads`; `triton`: ours after
`triton_quant.quantize_qkv`), one plan, `mla_prefill(..., fp8=True, fp8_rotate=...)` replayed
from a CUDA graph: unrotated, rotated with each implementation of `triton_quant.ROTATIONS`
(selected through `triton_quant.ROTATION`, which the providers read per call, with
`triton_heads.HEAD_ROTATION` set to None so that it names the FA3 provider's cast too; "gluon",
the per-head cast in Gluon, through FA3 only: ours refuses it, RUNS). Three rounds,
the variants interleaved, median per variant; errors against float64 on the outlier recipe
(features 7 and 128-131 of q and k scaled by 10) beside each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from accuracy import FEATURES  # noqa: E402
from prefill import SHAPES as PREFILL_SHAPES  # noqa: E402

#: the four large and the three small shapes of the benchmark (the chunked ones left out)
SHAPES = [s for s in PREFILL_SHAPES if not s[0].startswith("chunked")]
#: the rotations a provider runs: the block rule's quantize_qkv (ours) has no Gluon cast
RUNS = {"flash_attn": ("dense", "kron", "gluon"), "triton": ("dense", "kron")}
#: the accuracy section's outlier recipe's features (scaled by 10 here)
OUTLIER_FEATURES = list(FEATURES)


@contextlib.contextmanager
def _knobs_set(knobs):
    """{(module, name): value} of module constants set inside the block, restored after."""
    saved = {key: getattr(*key) for key in knobs}
    try:
        for (module, name), value in knobs.items():
            setattr(module, name, value)
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def _variant(mla_prefill, tq, q, k, v, plan, out, kernel, rotate, rotation, knobs=None):
    """The call of one variant; `knobs` ({(module, name): value} of module constants the
    providers read per call: triton_heads' BLOCKS_ROTATED or STAGES, triton_quant's
    KV_BLOCKS) set for the call only."""
    from mla_plugins.core.kernels import triton_heads as th

    knobs = dict(knobs or {})
    if rotation is not None:  # triton_quant.ROTATION names the per-head cast too
        knobs.setdefault((th, "HEAD_ROTATION"), None)

    def fn():
        if rotation is not None:
            tq.ROTATION = rotation
        with _knobs_set(knobs):
            mla_prefill(q, k, v, plan=plan, fp8=True, fp8_rotate=rotate, out=out, kernel=kernel)
    return fn


#: `--gluon-variants`: the Gluon cast's knobs (gluon_rotate's module constants, or
#: triton_heads' where prefixed, read per call), the others at their defaults
_OFF = {"PREFETCH": False, "PAIRED_STORES": False}
GLUON_KNOBS = {"none": _OFF, "prefetch": dict(_OFF, PREFETCH=True),
               "paired": dict(_OFF, PAIRED_STORES=True),
               "prefetch+paired": {"PREFETCH": True, "PAIRED_STORES": True},
               "w8": {"NUM_WARPS": 8}, "w2": {"NUM_WARPS": 2}, "r16": {"ROWS_PER_WARP": 16},
               # triton_heads': 64-row blocks a program where rotated_blocks falls back
               "b1": {"triton_heads.BLOCKS_ROTATED": 1},
               # the (program, sequence, head) order in place of q and k programs first
               "grid3": {"QK_FIRST": False},
               # pass 1 (the l1 bounds) at 16 warps in place of triton_heads.BOUND_WARPS_ROTATED
               "p1w16": {"triton_heads.BOUND_WARPS_ROTATED": 16}}
#: `--pdl-off`: FA3 unrotated and with the Gluon cast, the per-head quantization's two
#: passes launched as ordinary launches (triton_heads.PDL False), the Gluon cast with PDL
#: (triton_heads.PDL_GLUON True: "rot_gluon_pdl"; its default is without), and with PDL but
#: pass 1's trigger left out (triton_heads.PDL_EARLY False: "pdl_late"), beside the default


def measure_shape(name, lq, lk, heads, kernels, rotations, device, heads_blocks=(),
                  heads_stages=(), kv_blocks=(), gluon_variants=(), min_chunks=(),
                  pdl_off=False) -> list[dict]:
    from prefill import make_batch

    import mla_plugins
    from mla_plugins.core.kernels import triton_heads as th
    from mla_plugins.core.kernels import triton_quant as tq
    from tests.gpu.conftest import reference_on_device

    q, k, v, cq, ck = make_batch(lq, lk, heads, device)
    q[..., OUTLIER_FEATURES] *= 10
    k[..., OUTLIER_FEATURES] *= 10
    ref, _ = reference_on_device(q, k, v, cq, ck, heads_per_step=4)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    rows = []
    for kernel in kernels:
        row = {"shape": name, "kernel": kernel}
        rows.append(row)
        try:
            plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=heads, fp8=True,
                                            kernel=kernel, device=device)
        except Exception as exc:  # noqa: BLE001 - a measurement: say why and go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        variants = [("plain", False, None, None)] + [(f"rot_{r}", True, r, None) for r in rotations
                                                     if r in RUNS.get(kernel, (r,))]
        if kernel == "flash_attn":  # the per-head cast's rows per program and pipeline
            # stages (their own plan each: a plan's recorded launches hold their grid and
            # constexprs)
            variants += [(f"rot_dense_blocks{b}", True, "dense", {(th, "BLOCKS_ROTATED"): b})
                         for b in heads_blocks]
            variants += [(f"rot_dense_stages{n}", True, "dense", {(th, "STAGES"): n})
                         for n in heads_stages]
            from mla_plugins.core.kernels import gluon_rotate as gr

            # pass 1's rows per chunk (triton_heads.MIN_CHUNK), unrotated and with the Gluon cast
            for c in min_chunks:
                variants += [(f"plain_chunk{c}", False, None, {(th, "MIN_CHUNK"): c}),
                             (f"rot_gluon_chunk{c}", True, "gluon", {(th, "MIN_CHUNK"): c})]
            if pdl_off:
                variants += [("plain_nopdl", False, None, {(th, "PDL"): False}),
                             ("rot_gluon_nopdl", True, "gluon", {(th, "PDL"): False}),
                             ("plain_pdl_late", False, None, {(th, "PDL_EARLY"): False}),
                             ("rot_gluon_pdl", True, "gluon", {(th, "PDL_GLUON"): True}),
                             ("rot_gluon_pdl_late", True, "gluon",
                              {(th, "PDL_GLUON"): True, (th, "PDL_EARLY"): False})]
            variants += [(f"rot_gluon_{g.replace('+', '_')}", True, "gluon",
                          {(th, name.split(".")[1]) if name.startswith("triton_heads.")
                           else (gr, name): value for name, value in GLUON_KNOBS[g].items()})
                         for g in gluon_variants]
        if kernel == "triton":  # key blocks per k/v program of the block rule's launch
            variants += [(f"rot_dense_kv_blocks{n}", True, "dense", {(tq, "KV_BLOCKS"): n})
                         for n in kv_blocks]
        fns = {}
        for key, rotate, rotation, knobs in variants:
            own = plan
            if knobs is not None:  # its own plan, made with the knobs set (its workspace size)
                with _knobs_set(knobs):
                    own = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=heads,
                                                   fp8=True, kernel=kernel, device=device)
            fns[key] = _variant(mla_plugins.mla_prefill, tq, q, k, v, own, out, kernel, rotate,
                                rotation, knobs)
        samples = {key: [] for key in fns}
        saved = getattr(tq, "ROTATION", None)
        try:
            measure_variants(fns, out, ref, row, samples)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            if saved is not None:
                tq.ROTATION = saved
        summarize(row, samples)
        print(json.dumps(row), flush=True)
    return rows


def measure_variants(fns: dict, out, ref, row: dict, samples: dict[str, list[float]],
                     rounds: int = 3) -> None:
    """Each variant called once for its error against float64 `ref` (`err_{key}` in `row`,
    read from `out`), then `rounds` rounds of GPU time (CUDA-graph replay), the variants
    interleaved, appended to `samples[key]` (kept if a later round raises)."""
    from prefill import graph_ms

    from tests.gpu.conftest import rel_err

    for key, fn in fns.items():
        fn()
        row[f"err_{key}"] = rel_err(out, ref)
    for _ in range(rounds):
        for key, fn in fns.items():
            ms = graph_ms(fn)
            if ms:
                samples[key].append(ms)


def summarize(row: dict, samples: dict[str, list[float]]) -> None:
    """Each variant's median GPU time (and its samples) into `row`, and every variant after
    the first ("plain") as a cost against it: `{key}_graph_ms`, `{key}_cost`."""
    for key, got in samples.items():
        if got:
            row[f"{key}_graph_ms"] = statistics.median(got)
            row[f"{key}_graph_ms_samples"] = got
    for key in list(samples)[1:]:
        if row.get(f"{key}_graph_ms") and row.get("plain_graph_ms"):
            row[f"{key}_cost"] = row[f"{key}_graph_ms"] / row["plain_graph_ms"] - 1


def main() -> None:
    from mla_plugins.core.kernels import triton_quant as tq

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--kernels", default="flash_attn,triton")
    parser.add_argument("--heads-blocks", default="",
                        help="also the dense rotation through FA3 with these 64-row blocks per "
                             "cast program (triton_heads.BLOCKS_ROTATED), e.g. 8,16")
    parser.add_argument("--heads-stages", default="",
                        help="also the dense rotation through FA3 with the per-head cast's q "
                             "and k blocks pipelined in these stages (triton_heads.STAGES), "
                             "e.g. 2,3")
    parser.add_argument("--kv-blocks", default="",
                        help="also the dense rotation through ours with these 128-key blocks "
                             "per k/v program (triton_quant.KV_BLOCKS), e.g. 2,4")
    parser.add_argument("--gluon-variants", default="",
                        help="also the Gluon cast through FA3 with these knobs (GLUON_KNOBS): "
                             f"some of {','.join(GLUON_KNOBS)}")
    parser.add_argument("--min-chunks", default="",
                        help="also FA3 unrotated and with the Gluon cast at these rows per chunk of "
                             "the scale pass (triton_heads.MIN_CHUNK), e.g. 64,128")
    parser.add_argument("--pdl-off", action="store_true",
                        help="also FA3 unrotated and with the Gluon cast with the per-head "
                             "quantization's passes launched without PDL (triton_heads.PDL)")
    parser.add_argument("--rotations", default=None,
                        help="the implementations timed (default: all of triton_quant.ROTATIONS)")
    args = parser.parse_args()
    device = torch.device("cuda")
    rotations = list(getattr(tq, "ROTATIONS", ("dense",)))
    if args.rotations:
        unknown = sorted(set(args.rotations.split(",")) - set(rotations))
        if unknown:
            parser.error(f"--rotations: found {','.join(unknown)}, expected some of "
                         f"{','.join(rotations)}")
        rotations = args.rotations.split(",")
    rows = []
    for name, lq, lk, heads in SHAPES:
        if args.shapes and name not in args.shapes.split(","):
            continue
        blocks = [int(b) for b in args.heads_blocks.split(",") if b]
        stages = [int(n) for n in args.heads_stages.split(",") if n]
        kv_blocks = [int(n) for n in args.kv_blocks.split(",") if n]
        gluon_variants = [g for g in args.gluon_variants.split(",") if g]
        unknown = sorted(set(gluon_variants) - set(GLUON_KNOBS))
        if unknown:
            parser.error(f"--gluon-variants: found {','.join(unknown)}, expected some of "
                         f"{','.join(GLUON_KNOBS)}")
        min_chunks = [int(c) for c in args.min_chunks.split(",") if c]
        rows += measure_shape(name, lq, lk, heads, args.kernels.split(","), rotations, device,
                              blocks, stages, kv_blocks, gluon_variants, min_chunks,
                              args.pdl_off)
        torch.cuda.empty_cache()
        if args.out:  # what is measured survives a call cut short
            with open(args.out, "w") as f:
                json.dump({"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()},
                           "command": "PYTHONPATH=. python benchmarks/rotation_cost.py "
                                      + " ".join(sys.argv[1:]),
                           "rotations": rotations, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
