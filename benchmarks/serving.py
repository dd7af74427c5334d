"""Serving-style loop on the GPU: one plan per batch, 61 prefill calls (one per layer).

    PYTHONPATH=. python benchmarks/serving.py [--out serving.json] [--quick]

Each entry runs the core the way the adapters do: the batch is planned once from host
offsets (`plan_prefill(cu_q_host, cu_k_host, ...)`), then `mla_prefill(q, k, v, plan=plan)`
is called 61 times on the same q/k/v (a model's layers). Measured per shape and mode:
- wall_ms: synchronize, the 61 calls, synchronize (host clock);
- host_us_per_call: the host time of the loop before the final synchronize, over 61 (the
  launches of 61 calls fit in the GPU's queue, so the loop is host-bound);
- gpu_ms: the same 61 calls captured in one CUDA graph, replay timed with CUDA events
  (median of 5): the GPU time alone;
- wall_over_gpu: wall_ms / gpu_ms (1.0: the host adds nothing).
Ours also with the launch replay switched off (`host_us_per_call_ordinary`: the ordinary
Triton launch path on the same plan) and without a plan (`host_us_per_call_no_plan`:
offsets read back once per call). The peer is torch SDPA on the cuDNN backend (bf16), on
equal-length batches as [B, H, S, D] and on the chunked shape with a bottom-right mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch

CALLS = 61
DQK, DV = 192, 128
SHAPES = [
    # name, q lens, k lens, heads
    ("B1-S512-H16", [512], [512], 16),
    ("B16-S512-H16", [512] * 16, [512] * 16, 16),
    ("B4-S2048-H16", [2048] * 4, [2048] * 4, 16),
    ("B1-S8192-H128", [8192], [8192], 128),
    ("q512-k8192-H16", [512], [8192], 16),
]


def _offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _loop(fn, calls=CALLS):
    """(wall ms, host µs per call) of `calls` calls with a synchronize around the loop."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3, (t1 - t0) * 1e6 / calls


def _graph_ms(fn, calls=CALLS, replays=5):
    """GPU ms of `calls` calls captured in one CUDA graph (median of `replays` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def _measure(fn, warm=10, repeats=15):
    """Median wall ms and host µs per call over `repeats` loops (the device VM's host clock
    is noisy: single loops of the same code differed by 1.6x between runs)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    loops = [_loop(fn) for _ in range(repeats)]
    wall = statistics.median(w for w, _ in loops)
    host = statistics.median(h for _, h in loops)
    return wall, host


def _entry(name, tokens, kernel, fp8, wall, gpu, host, **extra):
    row = {
        "shape": name, "tokens": tokens, "calls": CALLS, "kernel": kernel, "fp8": fp8,
        "wall_ms": round(wall, 3), "gpu_ms": round(gpu, 3) if gpu is not None else None,
        "wall_over_gpu": round(wall / gpu, 3) if gpu else None,
        "host_us_per_call": round(host, 1),
    }
    row.update(extra)
    return row


def _ours(name, lens_q, lens_k, heads, fp8, device, kernel="auto"):
    import mla_plugins
    from mla_plugins.core.kernels import triton_launch

    gen = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda n, d: torch.randn(n, heads, d, generator=gen).to(device, torch.bfloat16)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = mk(tq, DQK), mk(tk, DQK), mk(tk, DV)
    cq, ck = _offsets(lens_q), _offsets(lens_k)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, dtype=torch.bfloat16,
                                    fp8=fp8, kernel=kernel)
    call = lambda: mla_plugins.mla_prefill(q, k, v, plan=plan, kernel=kernel)  # noqa: E731
    wall, host = _measure(call)
    replay = plan.memo.get("replay")
    replayed = bool(replay and replay[1] is not None)
    gpu = _graph_ms(call)
    triton_launch.ENABLED = False
    try:
        _, host_ordinary = _measure(call, warm=2)
    finally:
        triton_launch.ENABLED = True
    cq_dev = torch.tensor(cq, dtype=torch.int32, device=device)
    ck_dev = torch.tensor(ck, dtype=torch.int32, device=device)
    no_plan = lambda: mla_plugins.mla_prefill(q, k, v, cq_dev, ck_dev, fp8=fp8, kernel=kernel)  # noqa: E731
    wall_np, host_np = _measure(no_plan, warm=2)
    return _entry(
        name, tq, plan.kernel, fp8, wall, gpu, host, k_tokens=tk, heads=heads,
        asked=kernel, replayed=replayed, host_us_per_call_ordinary=round(host_ordinary, 1),
        host_us_per_call_no_plan=round(host_np, 1), wall_ms_no_plan=round(wall_np, 3),
        plan=plan.summary(), workspace_bytes=plan.workspace_bytes,
    )


def _sdpa(name, lens_q, lens_k, heads, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if len(set(lens_q)) != 1 or len(set(lens_k)) != 1:
        return None
    b, sq, sk = len(lens_q), lens_q[0], lens_k[0]
    gen = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda s, d: torch.randn(b, heads, s, d, generator=gen).to(device, torch.bfloat16)  # noqa: E731
    q, k, v = mk(sq, DQK), mk(sk, DQK), mk(sk, DV)
    if sq == sk:
        kwargs = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        kwargs = {"attn_mask": causal_lower_right(sq, sk)}

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    wall, host = _measure(call)
    gpu = _graph_ms(call)
    return _entry(name, b * sq, "torch-sdpa-cudnn", False, wall, gpu, host, k_tokens=b * sk,
                  heads=heads)


def _fa3(name, lens_q, lens_k, heads, device):
    """FA3 bf16 through its public flash_attn_varlen_func (the call frameworks make)."""
    try:
        import fa3_fwd_interface as fa
    except ImportError:
        import flash_attn_interface as fa
    gen = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda n, d: torch.randn(n, heads, d, generator=gen).to(device, torch.bfloat16)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = mk(tq, DQK), mk(tk, DQK), mk(tk, DV)
    cq = torch.tensor(_offsets(lens_q), dtype=torch.int32, device=device)
    ck = torch.tensor(_offsets(lens_k), dtype=torch.int32, device=device)
    mq, mk_ = max(lens_q), max(lens_k)
    call = lambda: fa.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk_, causal=True)  # noqa: E731
    wall, host = _measure(call)
    gpu = _graph_ms(call)
    return _entry(name, tq, "fa3-public", False, wall, gpu, host, k_tokens=tk, heads=heads)


def run_serving(shapes=None, modes=(True, False), peers=True) -> list[dict]:
    """The "serving" section of benchmarks/results/h200.json (see the module docstring)."""
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name, lens_q, lens_k, heads in shapes or SHAPES:
        for fp8 in modes:
            for kernel in ("auto", "triton"):
                try:
                    rows.append(_ours(name, lens_q, lens_k, heads, fp8, device, kernel))
                except Exception as exc:
                    traceback.print_exc()
                    rows.append({"shape": name, "fp8": fp8, "kernel": kernel,
                                 "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(rows[-1]), flush=True)
        if peers:
            try:
                row = _fa3(name, lens_q, lens_k, heads, device)
            except Exception as exc:
                row = {"shape": name, "fp8": False, "kernel": "fa3-public",
                       "error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if peers:
            try:
                row = _sdpa(name, lens_q, lens_k, heads, device)
            except Exception as exc:
                row = {"shape": name, "fp8": False, "kernel": "torch-sdpa-cudnn",
                       "error": f"{type(exc).__name__}: {exc}"}
            if row is not None:
                rows.append(row)
                print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return rows


def print_table(rows) -> None:
    cols = ("shape", "kernel", "asked", "fp8", "wall_ms", "gpu_ms", "wall_over_gpu", "host_us_per_call",
            "host_us_per_call_ordinary", "host_us_per_call_no_plan")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="the two smallest shapes only")
    args = ap.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    rows = run_serving(shapes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"serving": rows, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__}, f, indent=1)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
