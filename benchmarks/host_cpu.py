"""Host time of a planned `mla_prefill` call without its launches, on any machine (CPU).

What a layer of a serving loop pays in Python before the GPU sees a launch: the API
(argument checks, the plan's fast path, kernel dispatch, trace), and the Triton provider's
replay path (workspace views, the replay key) with the recorded launches replaced by a
no-op; `--provider flash_attn`: the FlashAttention-3 provider with FA3's op replaced by a
stub that returns its (out, lse) and the fp8 quantization's replay by a no-op (what our
Python adds around FA3's own host code); `--provider api`: the API alone, with a no-op kernel. Min and median of `--rounds`
rounds of `--calls` calls, in µs per call (min: the machine's noise least); `--profile` prints cProfile's top entries.

    .nox/triton/bin/python benchmarks/host_cpu.py            # triton provider (needs triton)
    .nox/core/bin/python benchmarks/host_cpu.py --provider api
    .nox/core/bin/python benchmarks/host_cpu.py --provider flash_attn [--lse]
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
    torch._C._cuda_getDevice = lambda: None  # (what the provider reads; absent from CPU builds)
    kernel = tk.TritonKernel()
    kernel._run_ordinary = lambda *a, **k: None
    return kernel


def _flash_attn_kernel(n: int, h: int, batch: int = 1):
    """The flash_attn provider on the CPU: a usable binding whose op returns preallocated
    (out, lse [H, T]) at once, on the fa3-fwd schema's argument positions; the fp8
    quantization's recorded launches replaced by a no-op (as the Triton provider's above)."""
    from mla_plugins.core.kernels import flash_attn as fa

    # FA3's lse: [H, T] from its varlen call, [B, H, S] from its batched one (equal lengths)
    lse_ht = torch.randn(h, n) if batch == 1 else torch.randn(batch, h, n // batch)
    # fa3-fwd 0.0.3's fwd schema, argument names in order (read from its library)
    names = ("q k v k_new v_new q_v out cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q "
             "seqused_k max_seqlen_q max_seqlen_k page_table kv_batch_idx leftpad_k rotary_cos "
             "rotary_sin seqlens_rotary q_descale k_descale v_descale softmax_scale is_causal "
             "window_size_left window_size_right attention_chunk softcap is_rotary_interleaved "
             "scheduler_metadata num_splits pack_gqa sm_margin").split()
    binding = fa.Binding(fa.CANDIDATES[-1], version="fa3-fwd (stub)")
    binding.positions = {name: i for i, name in enumerate(names) if name in fa.SLOTS}
    binding.template = tuple(fa.CONSTANTS.get(name) for name in names)
    binding.op = lambda *args: (args[binding.positions["out"]], lse_ht, None, None)
    fa._bindings = [binding]
    kernel = fa.FlashAttnKernel()
    kernel._quantize = lambda inputs, plan, scratch, token: None
    return kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--provider", choices=["triton", "api", "flash_attn"], default="triton")
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences of --tokens / --batch tokens each (flash_attn: FA3's "
                             "batched layout from 2 on)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--lse", action="store_true", help="return_lse=True")
    args = parser.parse_args()

    n, h = args.tokens, args.heads
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, h, 192, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(n, h, 128, generator=gen).bfloat16()
    out = torch.empty(n, h, 128, dtype=torch.bfloat16)
    b = args.batch
    if b < 1 or n % b:
        parser.error(f"--batch: found {b}, expected a divisor of --tokens {n}")
    cu = [i * (n // b) for i in range(b + 1)]
    kernel = {"triton": _triton_kernel, "api": _NoopKernel,
              "flash_attn": lambda: _flash_attn_kernel(n, h, b)}[args.provider]()
    for fp8 in (True, False):
        plan = mla_plugins.plan_prefill(cu, cu, num_heads=h, fp8=fp8, kernel="torch")
        plan.memo["kernel"] = kernel  # what plan_prefill(kernel="triton") stores on a GPU
        object.__setattr__(plan, "kernel", kernel.name)
        plan.memo["replayable"] = True  # as on CUDA: later calls replay
        plan.memo.setdefault("empty_rows", False)  # what FlashAttnKernel.build_plan stores
        plan.memo.setdefault("num_splits", None)
        if args.provider == "flash_attn":
            from mla_plugins.core.kernels import flash_attn as fa

            plan.memo["fa3_uniform"] = fa.equal_lengths((cu, cu))  # FlashAttnKernel.build_plan's

        def loop(calls, plan=plan, fp8=fp8):
            for _ in range(calls):
                mla_plugins.mla_prefill(q, k, v, plan=plan, out=out, fp8=fp8, return_lse=args.lse)

        loop(10)
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            loop(args.calls)
            rounds.append((time.perf_counter() - t0) / args.calls * 1e6)
        print(f"{args.provider} fp8={fp8} B{b}-S{n // b}-H{h}: min {min(rounds):.2f} median "
              f"{statistics.median(rounds):.2f} us/call over {args.rounds} rounds")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(loop, args.calls)
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
