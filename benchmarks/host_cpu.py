"""Host time of a planned `mla_prefill` call without its launches, on any machine (CPU).

What a layer of a serving loop pays in Python before the GPU sees a launch: the API
(argument checks, the plan's fast path, kernel dispatch, trace), and the Triton provider's
replay path (workspace views, the replay key) with the recorded launches replaced by a
no-op; `--provider api`: the API alone, with a no-op kernel. Min and median of `--rounds`
rounds of `--calls` calls, in µs per call (min: the machine's noise least); `--profile` prints cProfile's top entries.

    .nox/triton/bin/python benchmarks/host_cpu.py            # triton provider (needs triton)
    .nox/core/bin/python benchmarks/host_cpu.py --provider api
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import mla_plugins
from mla_plugins.core.kernels.base import Kernel


class _NoopKernel(Kernel):
    name = "noop"
    devices = frozenset({"cpu"})

    def run(self, inputs, plan, out, lse, workspace=None) -> None:
        return None


def _triton_kernel():
    """The Triton provider on the CPU with its launches stubbed: the first call 'records'
    nothing, every later call takes the replay path and calls a no-op."""
    from mla_plugins.core.kernels import triton_kernel as tk
    from mla_plugins.core.kernels import triton_launch as tl

    class _Recorder:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def replay(self):
            return lambda index, ptrs: None

    tl.Recorder = _Recorder
    tk._ensure_wrapped = lambda: None
    torch.cuda.current_device = lambda: None  # the CPU device's index
    kernel = tk.TritonKernel()
    kernel._run_ordinary = lambda *a, **k: None
    return kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--provider", choices=["triton", "api"], default="triton")
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    n, h = args.tokens, args.heads
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, h, 192, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(n, h, 128, generator=gen).bfloat16()
    out = torch.empty(n, h, 128, dtype=torch.bfloat16)
    cu = [0, n]
    kernel = _triton_kernel() if args.provider == "triton" else _NoopKernel()
    for fp8 in (True, False):
        plan = mla_plugins.plan_prefill(cu, cu, num_heads=h, fp8=fp8, kernel="torch")
        plan.memo["kernel"] = kernel  # what plan_prefill(kernel="triton") stores on a GPU
        object.__setattr__(plan, "kernel", kernel.name)
        plan.memo["replayable"] = True  # as on CUDA: later calls replay

        def loop(calls, plan=plan, fp8=fp8):
            for _ in range(calls):
                mla_plugins.mla_prefill(q, k, v, plan=plan, out=out, fp8=fp8)

        loop(10)
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            loop(args.calls)
            rounds.append((time.perf_counter() - t0) / args.calls * 1e6)
        print(f"{args.provider} fp8={fp8} B1-S{n}-H{h}: min {min(rounds):.2f} median "
              f"{statistics.median(rounds):.2f} us/call over {args.rounds} rounds")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(loop, args.calls)
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
