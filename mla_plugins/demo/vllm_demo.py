"""vLLM demo: a tiny random DeepSeek-V2 through vLLM's real engine, our MLA prefill vs vLLM's.

    python -m mla_plugins.demo.vllm_demo [--json FILE] [--tensor-parallel-size 2] [--also-tp 2]

Builds the checkpoint in a temp dir (nothing downloads), then runs `LLM.generate` three
times, each in a fresh multi-process engine (engine core + worker, spawned):
  1. vLLM's built-in CPU prefill (CPUSDPAMLAPrefillBackend), bf16;
  2. ours, selected by name (attention_config mla_prefill_backend=MLA_PLUGINS) and put
     in the CPU slot (MLA_PLUGINS_VLLM_OVERRIDE=CPU), bf16;
  3. ours selected as CUSTOM, FP8 (MLA_PLUGINS_FP8=1).
Prompts: 9, 61, 700 and 1100 tokens with max_num_batched_tokens=512, so the long ones are
cut into 512-row chunks (two 256-row tiles each) and later chunks read earlier ones back
from the KV cache as context chunks. It prints the greedy tokens, the MLA_PLUGINS_TRACE
summary of each run and the agreement with vLLM's built-in prefill. With
--tensor-parallel-size 2 every engine runs two worker processes (one rank and one core
each, half the heads per rank). With --also-tp 2, the three engines run again at two ranks
after those at one, compared with the built-in prefill at two ranks (`result["tp"]`; the
tests' one demo process: a rank count's own built-in is the reference, since the two-rank
all-reduce sums in another order: on the tiny random model ours at two ranks agreed with the
built-in at one rank on 87.6% of prompt positions, with the built-in at two on 99%+).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from .tiny_model import build_tiny_deepseek_v2
from .vllm_engine import make_prompts, one_plan_per_batch, run_engine, top1_agreement, trace_summary

logger = logging.getLogger("mla_plugins.demo.vllm_demo")


OURS = (
    ("ours_bf16", dict(ours=True, select_by_name="MLA_PLUGINS")),
    ("ours_fp8", dict(ours=True, fp8=True, select_by_name="CUSTOM")),
)
#: every run of one rank count: vLLM's built-in prefill (the reference), then ours
ENGINES = (("builtin_bf16", dict(ours=False)), *OURS)


def _engines(model, prompts, workdir: Path, engines, tensor_parallel_size: int) -> dict:
    runs = {}
    for label, kw in engines:
        start = time.perf_counter()
        result = run_engine(model, prompts, label=label,
                            trace_file=workdir / f"trace-{label}-tp{tensor_parallel_size}.jsonl",
                            tensor_parallel_size=tensor_parallel_size, **kw)
        data = result.to_json()
        data["seconds"] = round(time.perf_counter() - start, 1)
        data["trace_summary"] = trace_summary(result.trace, result.main_pid)
        data["one_plan_per_batch"] = one_plan_per_batch(data["trace_summary"]) if result.trace else {}
        runs[label] = data
    return runs


def _compare(runs: dict) -> dict:
    """Ours against the built-in prefill of the same rank count."""
    base = runs["builtin_bf16"]
    return {
        label: {
            "generated_equal": runs[label]["tokens"] == base["tokens"],
            "generated_top1_agreement": top1_agreement(runs[label]["tokens"], base["tokens"]),
            "prompt_top1_agreement": top1_agreement(runs[label]["prompt_top1"], base["prompt_top1"]),
        }
        for label, _ in OURS
    }


def run_all(workdir: Path, tensor_parallel_size: int = 1, also_tp: int | None = None) -> dict:
    model = build_tiny_deepseek_v2(workdir / "tiny-deepseek-v2")
    prompts = make_prompts()
    runs = _engines(model, prompts, workdir, ENGINES, tensor_parallel_size)
    result = {"prompt_lengths": [len(p) for p in prompts], "tensor_parallel_size": tensor_parallel_size,
              "runs": runs, "comparison": _compare(runs)}
    if also_tp:
        tp_runs = _engines(model, prompts, workdir, ENGINES, also_tp)
        result["tp"] = {"tensor_parallel_size": also_tp, "runs": tp_runs,
                        "comparison": _compare(tp_runs)}
    return result


def _report(result: dict) -> str:
    lines = [f"prompts (token counts): {result['prompt_lengths']}, "
             f"tensor parallel size {result['tensor_parallel_size']}"]
    lines += _report_runs(result, "against vLLM's built-in prefill")
    if "tp" in result:
        tp = result["tp"]
        lines.append(f"\n== tensor parallel size {tp['tensor_parallel_size']}")
        lines += _report_runs(tp, f"against vLLM's built-in prefill at tensor parallel size "
                                  f"{tp['tensor_parallel_size']}")
    return "\n".join(lines)


def _report_runs(result: dict, against: str) -> list[str]:
    lines = []
    for label, run in result["runs"].items():
        w, t = run["worker"], run["trace_summary"]
        pids = ", ".join(str(x["pid"]) for x in run["workers"])
        lines.append(f"\n== {label} ({run['seconds']} s, main pid {run['main_pid']}, worker pids {pids}, "
                     f"{w['heads_per_rank']} heads per rank)")
        lines.append(f"   worker: selected={w['selected_mla_prefill_backend']} "
                     f"layers use {w['layer_prefill_backends']} chunked_prefill={w['chunked_prefill']}")
        for i, toks in enumerate(run["tokens"]):
            lines.append(f"   prompt {i}: greedy tokens {toks}")
        if t["calls"]:
            lines.append(f"   trace: {t['calls']} calls {t['by_entry']} from pids {t['pids']} "
                         f"(all in workers: {t['all_from_workers']}), kernel {t['kernels']}, fp8 {t['fp8']}, "
                         f"max q {t['max_q_tokens']} / k {t['max_k_tokens']} tokens")
            for pid, p in t["per_pid"].items():
                lines.append(f"     pid {pid}: {p['new_tokens']} new-token and {p['context_chunk']} context-chunk "
                             f"calls, heads {p['heads']}, {p['batches']} batches planned ({p['plans']} plans); "
                             f"one plan per batch: {run['one_plan_per_batch'].get(pid)}")
        else:
            lines.append("   trace: no mla-plugins calls (vLLM's built-in prefill ran)")
    lines.append(f"\n== {against}")
    for label, c in result["comparison"].items():
        lines.append(f"   {label}: generated tokens equal: {c['generated_equal']}, "
                     f"top-1 agreement generated {c['generated_top1_agreement']:.1%}, "
                     f"over all prompt positions {c['prompt_top1_agreement']:.1%}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_plugins.demo.vllm_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the full results to this file")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks per engine (2: one worker process per rank, one core each)")
    parser.add_argument("--also-tp", type=int, default=None,
                        help="then the three engines again at this many ranks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with tempfile.TemporaryDirectory(prefix="mla-plugins-vllm-demo-") as tmp:
        result = run_all(Path(tmp), tensor_parallel_size=args.tensor_parallel_size,
                         also_tp=args.also_tp)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.write(_report(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
