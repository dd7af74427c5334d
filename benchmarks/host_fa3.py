"""Host time of FlashAttention-3's forward op, piece by piece, against the flash_attn provider.

    PYTHONPATH=. python benchmarks/host_fa3.py [--out benchmarks/results/h200-host-fa3.json]

Where the host time of a planned call through the flash_attn provider goes (issue 20's
goal: <= 40 µs per planned call). Per shape, bf16 and fp8 (e4m3 inputs quantized
beforehand), host µs per call of a loop of 61 calls (median of 15 loops; the loop is
host-bound: 61 calls' launches fit in the GPU's queue):
- `args`: building the op's argument list the provider's way (no call): our Python;
- `raw`: the raw op `torch.ops.<ns>.fwd.default(*args)` on a prebuilt argument list
  (num_splits 0: FA3's heuristic), i.e. the dispatcher and FA3's C++ host code;
- `raw_split1`: num_splits=1;
- `raw_sched`: with `scheduler_metadata` from FA3's `get_scheduler_metadata` made once
  (what vLLM's FA3 metadata builder does per batch): FA3 then skips its
  prepare-varlen kernel; its output is checked equal to `raw`'s;
- `provider` / `provider_lse`: `mla_prefill(q, k, v, plan=plan, kernel="flash_attn")`
  (fp8 from bf16 for the fp8 rows: the quantization's replayed launches included), with
  the scheduler metadata the provider makes once per plan where the binding has
  get_scheduler_metadata (`provider_metadata`);
- `provider_nosched`: the same with the binding's metadata op hidden (FA3's prepare-varlen
  kernel at every call, the provider before issue 20);
- `public`: FA3's `flash_attn_varlen_func` (the autograd wrapper);
- `il_*`: the op (with the scheduler metadata where the binding has it, as the provider calls
  it), the provider and the provider with lse timed again interleaved, one loop of each per
  round (ROUNDS rounds): the median and min of each, and `ours_us` / `ours_lse_us`, the
  median over rounds of the provider's loop minus the op's loop of the same round, what our
  code adds to FA3's own host time (the device VM's clock drifts between loops measured
  apart: stop 28's op figures ranged 27-48 µs).
GPU ms per call of `raw` and `raw_sched` from one CUDA graph of 61 calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving  # noqa: E402  (benchmarks/: the serving loop's timing helpers)

CALLS = serving.CALLS
SHAPES = [
    ("B1-S512-H16", [512], [512], 16),
    ("B16-S512-H16", [512] * 16, [512] * 16, 16),
    ("B4-S2048-H16", [2048] * 4, [2048] * 4, 16),
    ("q512-k8192-H16", [512], [8192], 16),
    ("B1-S8192-H128", [8192], [8192], 128),
]


def _host_us(fn) -> float:
    return round(serving._measure(fn, warm=5)[1], 1)


def _graph_ms(fn) -> float:
    return round(serving._graph_ms(fn) / CALLS, 5)


#: rounds of the interleaved timing (one loop of CALLS calls per variant a round)
ROUNDS = 21


def _interleaved(row, fns) -> None:
    """`il_<name>_us` (median) and `il_<name>_min_us` per variant, timed one loop each per
    round, and ours_us / ours_lse_us: medians of the per-round differences from "op"."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    host = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            host[name].append(serving._loop(fn)[1])
    for name, got in host.items():
        row[f"il_{name}_us"] = round(statistics.median(got), 1)
        row[f"il_{name}_min_us"] = round(min(got), 1)
    for name, key in (("provider", "ours_us"), ("provider_lse", "ours_lse_us")):
        row[key] = round(statistics.median(a - b for a, b in zip(host[name], host["op"], strict=True)), 1)


def _offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def measure(name, lens_q, lens_k, heads, fp8, b, fa_module) -> dict:
    import mla_plugins
    from mla_plugins.core.kernels import flash_attn as fa

    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda n, d: torch.randn(n, heads, d, generator=gen).to(device, torch.bfloat16)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = mk(tq, 192), mk(tk, 192), mk(tk, 128)
    cq_h, ck_h = _offsets(lens_q), _offsets(lens_k)
    cq = torch.tensor(cq_h, dtype=torch.int32, device=device)
    ck = torch.tensor(ck_h, dtype=torch.int32, device=device)
    mq, mk_ = max(lens_q), max(lens_k)
    scale = 192 ** -0.5
    if fp8:
        e4m3 = torch.float8_e4m3fn
        xq, xk, xv = q.to(e4m3), k.to(e4m3), v.to(e4m3)
        ones = torch.ones(len(lens_q), heads, device=device)
        descales = (ones, ones, ones)
    else:
        xq, xk, xv, descales = q, k, v, None
    out = torch.empty(tq, heads, 128, device=device, dtype=torch.bfloat16)
    row = {"shape": name, "fp8": fp8, "binding": b.describe()}

    def build(num_splits=None, sched=None):
        args = fa.call_args(b, xq, xk, xv, out, cq, ck, mq, mk_, descales, scale, True, num_splits)
        if sched is not None:
            args[b.schema_names.index("scheduler_metadata")] = sched
        return args

    row["args_us"] = _host_us(build)
    args = build()
    op = b.op
    row["raw_us"] = _host_us(lambda: op(*args))
    reference = out.clone()
    row["raw_gpu_ms"] = _graph_ms(lambda: op(*args))
    args1 = build(num_splits=1)
    row["raw_split1_us"] = _host_us(lambda: op(*args1))
    row["raw_split1_gpu_ms"] = _graph_ms(lambda: op(*args1))
    meta_op = getattr(getattr(torch.ops, b.candidate.namespace), "get_scheduler_metadata", None)
    if meta_op is not None and hasattr(b, "schema_names"):
        try:
            sched = meta_op(len(lens_q), mq, mk_, heads, heads, 192, 128, xq.dtype,
                            ck[1:] - ck[:-1], cq, ck, None, None, None, None, 0, True, -1, -1, 0,
                            False, 0, None, 0)
            args_s = build(sched=sched)
            out.fill_(float("nan"))
            op(*args_s)
            row["sched_max_diff"] = (out.float() - reference.float()).abs().max().item()
            row["raw_sched_us"] = _host_us(lambda: op(*args_s))
            row["raw_sched_gpu_ms"] = _graph_ms(lambda: op(*args_s))
        except Exception as exc:  # noqa: BLE001 - a measurement, not a test
            row["sched_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    plan = mla_plugins.plan_prefill(cq_h, ck_h, num_heads=heads, device=device,
                                    dtype=torch.bfloat16, fp8=fp8, kernel="flash_attn")
    row["provider_us"] = _host_us(lambda: mla_plugins.mla_prefill(
        q, k, v, plan=plan, kernel="flash_attn", out=out))
    row["provider_lse_us"] = _host_us(lambda: mla_plugins.mla_prefill(
        q, k, v, plan=plan, kernel="flash_attn", out=out, return_lse=True))
    row["provider_gpu_ms"] = _graph_ms(lambda: mla_plugins.mla_prefill(
        q, k, v, plan=plan, kernel="flash_attn", out=out))
    row["provider_metadata"] = any(m is not None for m in plan.memo.get("fa3_metadata", {}).values())
    with_metadata = out.clone()
    hidden, b.metadata_op = b.metadata_op, None
    try:
        plain = mla_plugins.plan_prefill(cq_h, ck_h, num_heads=heads, device=device,
                                         dtype=torch.bfloat16, fp8=fp8, kernel="flash_attn")
        row["provider_nosched_us"] = _host_us(lambda: mla_plugins.mla_prefill(
            q, k, v, plan=plain, kernel="flash_attn", out=out))
        row["provider_nosched_gpu_ms"] = _graph_ms(lambda: mla_plugins.mla_prefill(
            q, k, v, plan=plain, kernel="flash_attn", out=out))
        row["provider_sched_max_diff"] = (out.float() - with_metadata.float()).abs().max().item()
    finally:
        b.metadata_op = hidden
    base = args_s if "raw_sched_us" in row and row["provider_metadata"] else args
    _interleaved(row, {
        "op": lambda: op(*base),
        "provider": lambda: mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", out=out),
        "provider_lse": lambda: mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn",
                                                        out=out, return_lse=True),
    })
    if not fp8:
        row["public_us"] = _host_us(lambda: fa_module.flash_attn_varlen_func(
            q, k, v, cq, ck, mq, mk_, causal=True))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=None, help="comma-separated names")
    args = parser.parse_args()
    try:
        import fa3_fwd_interface as fa_module
    except ImportError:
        import flash_attn_interface as fa_module
    from mla_plugins.core.kernels import flash_attn as fa

    b = fa.binding()
    if b is None:
        print("no usable FA3:", [x.describe() for x in fa.bindings()])
        sys.exit(1)
    b.schema_names = [a.name for a in b.op._schema.arguments]
    rows = []
    for name, lq, lk, h in SHAPES:
        if args.shapes and name not in args.shapes.split(","):
            continue
        for fp8 in (False, True):
            rows.append(measure(name, lq, lk, h, fp8, b, fa_module))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                               "binding": b.describe()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
