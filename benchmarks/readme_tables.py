"""Print the README's performance tables from a benchmark result file.

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
    return f"{x:.{digits}f}"


def shapes_table(result: dict) -> str:
    head = ("| shape | fp8 | fp8 graph | fp8 attn only | bf16 | cuDNN FP8 | cuDNN bf16 | "
            "fp8 / cuDNN FP8 | GPU time: fp8 / cuDNN FP8 | fp8 / cuDNN bf16 | bf16 / cuDNN bf16 | "
            "fp8 / FP8 GEMM | err fp8 / bf16 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in result["shapes"]:
        lines.append(
            f"| {s['shape']} | {_f(s.get('ours_fp8_tflops'))} | {_f(s.get('ours_fp8_graph_tflops'))} | "
            f"{_f(s.get('ours_fp8_attn_tflops'))} | {_f(s.get('ours_bf16_tflops'))} | "
            f"{_f(s.get('cudnn_fp8_tflops'))} | {_f(s.get('cudnn_bf16_tflops'))} | "
            f"{_f(s.get('ours_fp8_vs_cudnn_fp8'), 2)} | {_f(s.get('ours_fp8_vs_cudnn_fp8_gpu'), 2)} | "
            f"{_f(s.get('ours_fp8_vs_cudnn_bf16'), 2)} | "
            f"{_f(s.get('ours_bf16_vs_cudnn_bf16'), 2)} | {_f(s.get('ours_fp8_of_fp8_gemm'), 2)} | "
            f"{_f(s.get('err_fp8'), 3)} / {_f(s.get('err_bf16'), 4)} |"
        )
    return "\n".join(lines)


def serving_table(result: dict) -> str:
    head = ("| shape | kernel | fp8 | wall ms (61 calls) | GPU ms | wall / GPU | host µs per call | "
            "host µs, no plan |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in result.get("serving", []):
        lines.append(
            f"| {s['shape']} | {s['kernel']} | {s['fp8']} | {_f(s.get('wall_ms'), 2)} | "
            f"{_f(s.get('gpu_ms'), 2)} | {_f(s.get('wall_over_gpu'), 2)} | "
            f"{_f(s.get('host_us_per_call'), 1)} | {_f(s.get('host_us_per_call_no_plan'), 1)} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else "benchmarks/results/h200.json")
    result = json.loads(path.read_text())
    c = result.get("ceilings", {})
    print(f"hardware: {result.get('env')}")
    print(f"ceilings: FP8 GEMM {_f(c.get('fp8_gemm_tflops'))} TFLOP/s, bf16 GEMM "
          f"{_f(c.get('bf16_gemm_tflops'))} TFLOP/s, copy {_f(c.get('copy_tb_s'), 2)} TB/s\n")
    print(shapes_table(result) + "\n")
    print(serving_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
