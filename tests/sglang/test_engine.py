"""SGLang end to end: a real `sglang.Engine(device="cpu")` generates through our prefill.

One fresh process (`python -m mla_plugins.demo.sglang_engine`) starts four engines in turn,
bf16 then fp8 (MLA_PLUGINS_FP8=1) at tp_size 1, then both at tp_size 2, each with `--prefill-attention-backend mla_plugins
--decode-attention-backend torch_native` and no kernel pinned, on a tiny random DeepSeek-V2
built here, and sends: several plain prompts in one batch, a prompt that reuses a cached
prefix, and a long prompt cut by chunked prefill so that SGLang's chunked-prefix path runs
(see that module's docstring). The reference is transformers' DeepSeek-V2 in float32.

At tp_size=2 (issue 15): two scheduler ranks, one core each
(SGLANG_CPU_OMP_THREADS_BIND="0|1", set by the runner for those engines), 2 heads per rank.

SGLang's CPU engine imports names from `sgl_kernel`; the import-only stand-in in
tests/sglang/env/sgl_kernel_standin logs every import and call, and a call would raise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

STANDIN = Path(__file__).parent / "env" / "sgl_kernel_standin"
BF16_TOP1, FP8_TOP1 = 0.95, 0.90


def _run_engines(work: Path, *args: str, **extra_env: str) -> dict:
    """One fresh process running the engines of `args`; its JSON, plus the stand-in's log,
    the plan log (split by each run's scheduler pids) and the wall time."""
    out, kernel_log, plan_log = work / "result.json", work / "sgl_kernel.jsonl", work / "plans.jsonl"
    path = os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MLA_PLUGINS_TEST_SGL_KERNEL_LOG": str(kernel_log),
           "MLA_PLUGINS_TEST_PLAN_LOG": str(plan_log), **extra_env}
    for var in ("MLA_PLUGINS_KERNEL", "MLA_PLUGINS_FP8", "MLA_PLUGINS_TRACE"):
        env.pop(var, None)  # nothing pinned from outside: the engine runner sets its own
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mla_plugins.demo.sglang_engine", str(out), "--workdir", str(work), *args],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    wall = time.perf_counter() - start
    assert proc.returncode == 0, f"engine run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    log = [json.loads(line) for line in kernel_log.read_text().splitlines()] if kernel_log.exists() else []
    plans = [json.loads(line) for line in plan_log.read_text().splitlines()] if plan_log.exists() else []
    runs = {run["label"]: run for run in result["runs"]}
    # engines run one after the other: a run's plans are those of its scheduler's pid(s)
    for run in runs.values():
        pids = set(run["trace_summary"]["pids"])
        run["plans"] = [p for p in plans if p["pid"] in pids]
    for label, run in runs.items():
        print(f"\n{label}: engine start {run['start_seconds']} s, engine total {run['total_seconds']} s "
              f"(whole process {wall:.0f} s); agreement {run['agreement']}; trace {run['trace_summary']}")
        for name, rows in run["groups"].items():
            for row in rows:
                print(f"  {name}: {row['prompt_len']} prompt tokens, {row['cached_tokens']} cached, "
                      f"greedy tokens {row['tokens']}")
    return {"runs": runs, "kernel_log": log, "wall": wall}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    # one process for the four engines (tp 1 and 2, bf16 and fp8): one SGLang import, one
    # checkpoint, one float32 reference; at tp 2 the runner binds one core per rank
    # (without a bind list SGLang wants a NUMA node per rank, and this machine has one)
    return _run_engines(tmp_path_factory.mktemp("sglang-engine"), "--tp", "1", "--tp", "2",
                        "--fp8", "0", "--fp8", "1")


@pytest.fixture(scope="module")
def engine(engines):
    return engines


@pytest.fixture(scope="module")
def engine_tp2(engines):
    return engines


@pytest.mark.parametrize("label", ["bf16-tp1", "fp8-tp1"])
def test_one_plan_per_batch_and_call_used_by_every_layer(engine, label):
    """Plans are built per batch (init_forward_metadata, init_mha_chunk_metadata), one per
    call shape, never per layer: the 2 layers' calls are exactly twice the plans."""
    run = engine["runs"][label]
    keys = [tuple(p["args"][:3]) for p in run["plans"]]  # (batch, method, call)
    assert keys and len(keys) == len(set(keys)), keys
    assert len(run["trace"]) == 2 * len(keys), (len(run["trace"]), keys)
    methods = {method for _, method, _ in keys}
    assert methods == {"extend", "extend_with_prefix", "chunked"}, methods


@pytest.mark.parametrize("label,limit", [("bf16-tp1", BF16_TOP1), ("fp8-tp1", FP8_TOP1)])
def test_agreement_with_float32_reference(engine, label, limit):
    agreement = engine["runs"][label]["agreement"]
    assert agreement["prompt_positions"] > 300
    assert agreement["prompt_top1_agreement"] >= limit, agreement
    if label.startswith("bf16"):
        assert agreement["all_first_tokens_equal"], agreement["first_token_equal"]


@pytest.mark.parametrize("label", ["bf16-tp1", "fp8-tp1"])
def test_each_extend_kind_ran_through_our_backend_in_the_scheduler(engine, label):
    run = engine["runs"][label]
    summary = run["trace_summary"]
    # plain extends, a cached prefix in one shot, and the chunked-prefix path (new tokens
    # with lse, then each prefix chunk, merged by SGLang)
    assert {"extend", "extend_with_prefix", "prefix_chunk"} <= set(summary["by_entry"]), summary
    assert summary["all_from_scheduler"] and run["main_pid"] not in summary["pids"], summary
    assert summary["fp8"] == [label.startswith("fp8")]
    assert summary["heads"] == [4]
    # every layer of every forward: calls come in multiples of the layer count (2)
    assert all(n % 2 == 0 for n in summary["by_entry"].values()), summary


def test_cached_prefix_and_chunked_prompt_were_what_they_test(engine):
    groups = engine["runs"]["bf16-tp1"]["groups"]
    from mla_plugins.demo import sglang_engine as se

    assert [r["cached_tokens"] for r in groups["plain"]] == [0] * len(se.PLAIN_LENGTHS)
    assert groups["reuse"][0]["cached_tokens"] >= se.PLAIN_LENGTHS[se.REUSE_OF] - 1
    trace = engine["runs"]["bf16-tp1"]["trace"]
    chunks = [t for t in trace if t["entry"] == "prefix_chunk"]
    # the long prompt's last chunk sees a prefix larger than one KV chunk: several chunks
    assert max(t["k_tokens"] for t in chunks) <= se.KV_CHUNK_CAPACITY
    assert len(chunks) > 2 * (se.LONG_LENGTH // se.CHUNKED_PREFILL_SIZE)


def test_sgl_kernel_standin_was_imported_and_never_called(engine):
    log = engine["kernel_log"]
    assert any(e["event"] == "import" for e in log), "the engine never imported sgl_kernel"
    assert [e for e in log if e["event"] == "call"] == []


@pytest.mark.parametrize("label,limit", [("bf16-tp2", BF16_TOP1), ("fp8-tp2", FP8_TOP1)])
def test_tp2_every_rank_runs_our_prefill_on_half_the_heads(engine_tp2, label, limit):
    """tp_size=2 (issue 15): two scheduler processes, each with 4 / 2 heads, each planning once
    per batch; the float32 reference bars as at TP=1 (no built-in SGLang prefill runs
    DeepSeek's MHA path on a CPU to compare tokens with)."""
    run = engine_tp2["runs"][label]
    summary, agreement = run["trace_summary"], run["agreement"]
    assert len(summary["pids"]) == 2 and summary["all_from_scheduler"], summary
    assert summary["heads"] == [2] and summary["fp8"] == [label.startswith("fp8")], summary
    assert {"extend", "extend_with_prefix", "prefix_chunk"} <= set(summary["by_entry"]), summary
    by_pid = {pid: [t for t in run["trace"] if t["pid"] == pid] for pid in summary["pids"]}
    assert len({len(calls) for calls in by_pid.values()}) == 1, {p: len(c) for p, c in by_pid.items()}
    for pid, calls in by_pid.items():
        plans = [tuple(p["args"][:3]) for p in run["plans"] if p["pid"] == pid]
        assert plans and len(plans) == len(set(plans)) and len(calls) == 2 * len(plans), (pid, plans)
    assert agreement["prompt_top1_agreement"] >= limit, agreement
    if label.startswith("bf16"):
        assert agreement["all_first_tokens_equal"], agreement["first_token_equal"]
    assert [e for e in engine_tp2["kernel_log"] if e["event"] == "call"] == []
