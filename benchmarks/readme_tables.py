"""Print the README's performance and accuracy tables from a benchmark result file.

    python benchmarks/readme_tables.py [benchmarks/results/h200.json]

The README's numbers come from here, so they are the committed run's and nothing else.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(x, digits: int = 0) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return f"{x:.{digits}f}"


def _table(head: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def auto_table(result: dict) -> str:
    """kernel='auto' against the strongest peers, GPU time (CUDA-graph replay)."""
    head = ("shape", "auto takes (fp8 asked)", "auto fp8", "auto bf16", "FA3 FP8", "FA3 FP8 e2e",
            "FA3 bf16", "cuDNN bf16", "cuDNN FP8", "auto fp8 / FA3 FP8 e2e", "auto fp8 / FA3 bf16",
            "auto bf16 / FA3 bf16", "err auto fp8 / bf16")
    g = lambda s, k: _f(s.get(f"{k}_graph_tflops"))  # noqa: E731
    rows = [(s["shape"], _f(s.get("auto_kernel")), g(s, "auto_fp8"), g(s, "auto_bf16"), g(s, "fa3_fp8"),
             g(s, "fa3_fp8_e2e"), g(s, "fa3_bf16"), g(s, "cudnn_bf16_br"), g(s, "cudnn_fp8"),
             _f(s.get("auto_fp8_vs_fa3_fp8_e2e"), 2), _f(s.get("auto_fp8_vs_fa3_bf16"), 2),
             _f(s.get("auto_bf16_vs_fa3_bf16"), 2),
             f"{_f(s.get('err_auto_fp8'), 3)} / {_f(s.get('err_auto_bf16'), 4)}")
            for s in result["shapes"]]
    return _table(head, rows)


def ours_table(result: dict) -> str:
    """The Triton provider pinned against FA3 (issue 21's columns), GPU time."""
    head = ("shape", "ours fp8", "ours fp8 attn", "ours bf16", "FA3 FP8", "FA3 FP8 e2e", "FA3 bf16",
            "ours fp8 / FA3 FP8 e2e", "ours fp8 attn / FA3 FP8", "ours bf16 / FA3 bf16",
            "ours fp8 attn / FP8 GEMM", "err ours fp8 / bf16")
    g = lambda s, k: _f(s.get(f"{k}_graph_tflops"))  # noqa: E731
    rows = [(s["shape"], g(s, "ours_fp8"), g(s, "ours_fp8_attn"), g(s, "ours_bf16"), g(s, "fa3_fp8"),
             g(s, "fa3_fp8_e2e"), g(s, "fa3_bf16"), _f(s.get("ours_fp8_vs_fa3_fp8_e2e"), 2),
             _f(s.get("ours_fp8_attn_vs_fa3_fp8"), 2), _f(s.get("ours_bf16_vs_fa3_bf16"), 2),
             _f(s.get("ours_fp8_of_fp8_gemm"), 2),
             f"{_f(s.get('err_ours_fp8'), 3)} / {_f(s.get('err_ours_bf16'), 4)}")
            for s in result["shapes"]]
    return _table(head, rows)


def call_table(result: dict) -> str:
    """Call by call (L2 flushed, host launch time included where it exceeds the GPU's)."""
    head = ("shape", "auto fp8", "auto bf16", "ours fp8", "ours bf16", "FA3 FP8", "FA3 FP8 e2e",
            "FA3 FP8 e2e (torch per-tensor quant)", "FA3 bf16", "cuDNN bf16", "SDPA cuDNN bf16")
    c = lambda s, k: _f(s.get(f"{k}_tflops"))  # noqa: E731
    rows = [(s["shape"], c(s, "auto_fp8"), c(s, "auto_bf16"), c(s, "ours_fp8"), c(s, "ours_bf16"),
             c(s, "fa3_fp8"), c(s, "fa3_fp8_e2e"), c(s, "fa3_fp8_e2e_torch"), c(s, "fa3_bf16"),
             c(s, "cudnn_bf16_br"), c(s, "sdpa_cudnn_bf16")) for s in result["shapes"]]
    return _table(head, rows)


def accuracy_table(result: dict) -> str:
    head = ("recipe", "ours fp8 rotated", "ours fp8 not rotated", "FA3 provider fp8 rotated",
            "FA3 provider fp8 not rotated", "torch kernel fp8 rotated", "FA3 FP8 (alone)",
            "cuDNN FP8", "ours bf16", "FA3 bf16", "FA3 FP8 / ours rotated")
    keys = ("ours_fp8_rot", "ours_fp8_norot", "fa_fp8_rot", "fa_fp8_norot", "torch_fp8_rot",
            "fa3_fp8", "cudnn_fp8", "ours_bf16", "fa3_bf16")
    rows = [(f"{a['recipe']} {a['value']}", *(_f(a.get(k), 4) for k in keys),
             _f(a.get("fa3_fp8_over_ours_fp8_rot"), 1)) for a in result.get("accuracy", [])]
    return _table(head, rows)


def serving_table(result: dict) -> str:
    head = ("shape", "kernel", "asked", "fp8", "wall ms (61 calls)", "GPU ms", "wall / GPU",
            "host µs per call", "host µs, no plan")
    rows = [(s["shape"], s.get("kernel", "?"), s.get("asked", "-"), str(s.get("fp8")),
             _f(s.get("wall_ms"), 2), _f(s.get("gpu_ms"), 2), _f(s.get("wall_over_gpu"), 2),
             _f(s.get("host_us_per_call"), 1), _f(s.get("host_us_per_call_no_plan"), 1))
            for s in result.get("serving", [])]
    return _table(head, rows)


def host_table(result: dict) -> str:
    """benchmarks/host_fa3.py's pieces of host time (µs per call)."""
    head = ("shape", "fp8", "FA3 op (prebuilt args)", "op, num_splits 1", "op, scheduler metadata",
            "provider", "provider, no metadata", "provider, lse", "FA3 public",
            "GPU µs: op / provider / provider, no metadata", "interleaved: op", "provider",
            "provider, lse", "ours / ours with lse")
    us = lambda r, k: _f((r.get(k) or 0) * 1e3, 1)  # noqa: E731
    # the interleaved timing's medians (min in brackets), and our part: the per-round
    # differences from the op
    il = lambda r, k: f"{_f(r.get(k), 1)} ({_f(r.get(k[:-3] + '_min_us'), 1)})"  # noqa: E731
    rows = [(r["shape"], str(r["fp8"]), _f(r.get("raw_us"), 1), _f(r.get("raw_split1_us"), 1),
             _f(r.get("raw_sched_us"), 1), _f(r.get("provider_us"), 1),
             _f(r.get("provider_nosched_us"), 1), _f(r.get("provider_lse_us"), 1),
             _f(r.get("public_us"), 1),
             f"{us(r, 'raw_gpu_ms')} / {us(r, 'provider_gpu_ms')} / {us(r, 'provider_nosched_gpu_ms')}",
             il(r, "il_op_us"), il(r, "il_provider_us"), _f(r.get("il_provider_lse_us"), 1),
             f"{_f(r.get('ours_us'), 1)} / {_f(r.get('ours_lse_us'), 1)}")
            for r in result["rows"]]
    return _table(head, rows)


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else "benchmarks/results/h200.json")
    result = json.loads(path.read_text())
    if "rows" in result:  # benchmarks/host_fa3.py's file
        print(f"hardware: {result.get('env')}\n\n### host time through FA3\n\n{host_table(result)}")
        return 0
    c = result.get("ceilings", {})
    print(f"hardware: {result.get('env')}")
    print(f"ceilings: FP8 GEMM {_f(c.get('fp8_gemm_tflops'))} TFLOP/s, bf16 GEMM "
          f"{_f(c.get('bf16_gemm_tflops'))} TFLOP/s, copy {_f(c.get('copy_tb_s'), 2)} TB/s\n")
    for title, fn in (("auto vs peers (GPU time)", auto_table), ("ours pinned vs FA3 (GPU time)", ours_table),
                      ("call by call", call_table), ("accuracy", accuracy_table), ("serving", serving_table)):
        print(f"### {title}\n\n{fn(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
