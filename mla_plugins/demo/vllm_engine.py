"""Run vLLM's real multi-process engine on the tiny model, with our prefill or vLLM's own.

Used by the demo (`python -m mla_plugins.demo.vllm_demo`) and the end-to-end tests. Everything
vLLM-side is stock: `LLM(...)` spawns its engine-core and worker processes, and our
`register()` reaches them through the entry point. The only knobs are environment
variables the children inherit (set before each engine starts):
MLA_PLUGINS_VLLM_OVERRIDE=CPU (our backend takes the CPU slot), MLA_PLUGINS_FP8,
MLA_PLUGINS_TRACE and MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL=1 (context chunks on CPU).
With tensor_parallel_size=2 vLLM starts one worker process per rank, each with half the
heads; on this CPU each rank gets one core (VLLM_CPU_OMP_THREADS_BIND="0|1": vLLM's
automatic binding wants one NUMA node per rank and refuses otherwise).
Call from under `if __name__ == "__main__":` (vLLM spawns its processes).
"""

from __future__ import annotations

import gc
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

#: prompt lengths: short ones, and long ones cut into chunks of max_num_batched_tokens
#: (512 rows = two 256-row tiles per call; the later chunks see earlier ones as context).
PROMPT_LENGTHS = (9, 61, 700, 1100)
MAX_NUM_BATCHED_TOKENS = 512
#: decoder layers of the tiny model: each prefill batch calls every layer once
NUM_LAYERS = 2


def make_prompts(lengths=PROMPT_LENGTHS, vocab: int = 1024, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def worker_facts(worker) -> dict:
    """Runs inside the worker (collective_rpc): what its config and layers actually hold."""
    cfg = worker.vllm_config
    selected = cfg.attention_config.mla_prefill_backend
    model = worker.model_runner.get_model()
    backends = sorted({type(m.prefill_backend).__name__ for m in model.modules()
                       if getattr(m, "prefill_backend", None) is not None})
    impls = sorted({type(m.impl).__name__ for m in model.modules()
                    if getattr(m, "prefill_backend", None) is not None and hasattr(m, "impl")})
    parallel = cfg.parallel_config
    return {
        "pid": os.getpid(),
        "tp_rank": getattr(worker, "rank", None),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "heads_per_rank": cfg.model_config.get_num_attention_heads(parallel),
        "selected_mla_prefill_backend": None if selected is None else selected.name,
        "layer_prefill_backends": backends,
        "layer_attention_impls": impls,
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
    }


@dataclass
class EngineResult:
    label: str
    main_pid: int
    tokens: list[list[int]]
    prompt_top1: list[list[int]]
    worker: dict
    trace: list[dict] = field(default_factory=list)
    #: worker_facts of every rank (worker is rank 0's)
    workers: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return self.__dict__.copy()


def run_engine(
    model: str | Path,
    prompts: list[list[int]],
    *,
    label: str,
    ours: bool,
    fp8: bool = False,
    select_by_name: str | None = None,
    trace_file: str | Path | None = None,
    max_tokens: int = 6,
    tensor_parallel_size: int = 1,
) -> EngineResult:
    """One LLM engine: greedy `max_tokens` per prompt plus the top-1 token at every prompt position."""
    from vllm import LLM, SamplingParams

    env = {
        "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL": "1",
        "MLA_PLUGINS_VLLM_OVERRIDE": "CPU" if ours else "",
        "MLA_PLUGINS_FP8": "1" if fp8 else "0",
        "MLA_PLUGINS_TRACE": str(trace_file) if trace_file else "",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # collective_rpc(worker_facts) ships a function to the worker: vLLM wants this opt-in
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    if tensor_parallel_size > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        # one core per rank; vLLM's "auto" binding needs a NUMA node per rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(tensor_parallel_size))
    os.environ.update(env)
    if trace_file:
        Path(trace_file).unlink(missing_ok=True)
    # vLLM's CPU platform prefers its AMX_MLA attention backend where the CPU has AMX; that
    # backend runs its own prefill (forward_mha) and never calls an MLA prefill backend,
    # neither ours nor vLLM's CPU SDPA one. CPU_MLA is the MLA backend that does, for both runs.
    attention_config: dict = {"backend": "CPU_MLA"}
    if select_by_name:
        # LLM() parses attention_config before it loads plugins; a dynamic name needs them first.
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        attention_config["mla_prefill_backend"] = select_by_name
    kwargs = {"attention_config": attention_config}
    llm = LLM(
        model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=2048, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=4,
        enable_chunked_prefill=True, enable_prefix_caching=False, seed=0,
        tensor_parallel_size=tensor_parallel_size, **kwargs,
    )
    try:
        workers = llm.collective_rpc(worker_facts)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=1,
                                ignore_eos=True)
        # One prompt per generate() call: requests reach the engine core one by one, so a
        # batch of several would be cut differently from run to run, and vLLM's CPU path
        # does not give bit-identical logits for different batchings. Alone, each prompt is
        # cut the same way every time (chunks of max_num_batched_tokens).
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        top1 = []
        for o in outs:
            # position 0 has no logprobs; rank-1 entry of each later position is the top-1 token
            top1.append([next(t for t, lp in pos.items() if lp.rank == 1)
                         for pos in o.prompt_logprobs[1:]])
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    trace = []
    if trace_file and Path(trace_file).exists():
        trace = [json.loads(line) for line in Path(trace_file).read_text().splitlines() if line]
    return EngineResult(label, os.getpid(), tokens, top1, workers[0], trace, workers)


def top1_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def trace_summary(trace: list[dict], main_pid: int) -> dict:
    """Prefill calls by entry and pid, the adapter's plan lines (entry "plan", one per
    planned batch) per pid, and whether every call came from another process than main."""
    calls = [t for t in trace if t["entry"] != "plan"]
    plans = [t for t in trace if t["entry"] == "plan"]
    by_entry: dict[str, int] = {}
    for t in calls:
        by_entry[t["entry"]] = by_entry.get(t["entry"], 0) + 1
    per_pid: dict[int, dict] = {}
    for t in trace:
        p = per_pid.setdefault(t["pid"], {"new_tokens": 0, "context_chunk": 0, "batches": 0,
                                          "plans": 0, "planned_chunks": 0, "heads": set()})
        if t["entry"] == "plan":
            p["batches"] += 1
            p["plans"] += t["plans"]
            p["planned_chunks"] += t["chunks"]
        else:
            p[t["entry"]] = p.get(t["entry"], 0) + 1
        p["heads"].add(t["heads"])
    for p in per_pid.values():
        p["heads"] = sorted(p["heads"])
    return {
        "calls": len(calls),
        "by_entry": by_entry,
        "plan_lines": len(plans),
        "per_pid": {str(pid): p for pid, p in sorted(per_pid.items())},
        "pids": sorted({t["pid"] for t in calls}),
        "all_from_workers": all(t["pid"] != main_pid for t in trace),
        "kernels": sorted({t["kernel"] for t in calls}),
        "fp8": sorted({t["fp8"] for t in calls}),
        "heads": sorted({t["heads"] for t in calls}),
        "max_q_tokens": max((t["q_tokens"] for t in calls), default=0),
        "max_k_tokens": max((t["k_tokens"] for t in calls), default=0),
    }


def one_plan_per_batch(summary: dict, num_layers: int = NUM_LAYERS) -> dict[str, bool]:
    """Per pid: every planned batch ran each layer once (new-token calls = layers x batches)
    and each layer ran every planned context chunk (chunk calls = layers x planned chunks)."""
    return {
        pid: p["batches"] > 0 and p["new_tokens"] == num_layers * p["batches"]
        and p["context_chunk"] == num_layers * p["planned_chunks"]
        and p["plans"] == p["batches"] + p["planned_chunks"]
        for pid, p in summary["per_pid"].items()
    }
