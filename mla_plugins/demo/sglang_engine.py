"""Run SGLang's real `Engine` on the tiny DeepSeek-V2 with our prefill; compare with transformers.

Used by the SGLang demo (`python -m mla_plugins.demo.sglang_demo`) and the end-to-end test
(tests/sglang/test_engine.py). Everything SGLang-side is stock: `sglang.Engine(device="cpu")`
(SGLANG_USE_CPU_ENGINE=1) spawns its scheduler process, which loads our plugin through the
entry point; prefill is `mla_plugins`, decode SGLang's `torch_native`, no kernel pinned.

One engine serves three groups of requests (greedy, `ignore_eos`):
  plain   several prompts in one `generate` call (one batch of plain extends), with prompt
          logprobs (`return_logprob`, `logprob_start_len=0`, top-1 at every position);
  reuse   plain prompt REUSE_OF plus REUSE_EXTRA new tokens, sent after it: SGLang's radix
          cache serves the old prompt's tokens (`cached_tokens > 0`), so this extend has a
          cached prefix (MHA_ONE_SHOT). No prompt logprobs here: asking for them makes SGLang
          recompute the prefix instead of reusing it;
  long    LONG_LENGTH tokens cut into CHUNKED_PREFILL_SIZE chunks; with the KV chunk
          capacity lowered to KV_CHUNK_CAPACITY (SGLANG_MAX_KV_CHUNK_CAPACITY), each later
          chunk takes SGLang's chunked-prefix path (MHA_CHUNKED_KV: the new tokens, then the
          cached prefix chunk by chunk, merged by lse). With prompt logprobs.

Needs: an `sgl_kernel` importable (SGLang's CPU engine imports some names from it; the
tests' import-only stand-in is tests/sglang/env/sgl_kernel_standin), `setproctitle`,
`xgrammar`, and TRITON_INTERPRET=1 (SGLang's own kv-index helpers are Triton kernels; set
here before the scheduler starts). Call from under `if __name__ == "__main__":` (SGLang
spawns its scheduler).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("mla_plugins.demo.sglang_engine")

#: yarn with factor 1.0 is plain RoPE; SGLang's CPU DeepSeek rope path needs a rope_scaling.
YARN_FACTOR_1 = {
    "type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}
PLAIN_LENGTHS = (9, 33, 70)
REUSE_OF, REUSE_EXTRA = 1, 24
LONG_LENGTH = 300
CHUNKED_PREFILL_SIZE = 128
KV_CHUNK_CAPACITY = 96
MAX_NEW_TOKENS = 4
VOCAB = 1024


def build_model(path: str | Path, *, num_heads: int = 4) -> Path:
    from .tiny_model import build_tiny_deepseek_v2

    return build_tiny_deepseek_v2(path, rope_scaling=YARN_FACTOR_1, num_heads=num_heads, vocab=VOCAB)


#: float32 logit gap between the reference's top two tokens, at least, after each full prompt:
#: the first generated token is compared exactly, and a near tie (a gap of 0.03 was seen)
#: flips under bf16 rounding in any correct implementation
MIN_FIRST_TOKEN_MARGIN = 0.25


def make_requests(model: str | Path | None = None, seed: int = 4321) -> dict[str, list[list[int]]]:
    """The three groups' prompts (random tokens, seeded). Given the model, a prompt whose
    float32 reference has a near tie for the next token is drawn again (same seeded stream)."""
    rng = random.Random(seed)
    margin = _reference_margin(model) if model is not None else (lambda p: float("inf"))

    def draw(n, head=()):
        for _ in range(50):
            p = list(head) + [rng.randrange(2, VOCAB) for _ in range(n)]
            if margin(p) >= MIN_FIRST_TOKEN_MARGIN:
                return p
        raise RuntimeError(f"no prompt of {n} tokens without a near tie in 50 draws")

    plain = [draw(n) for n in PLAIN_LENGTHS]
    # the reuse prompt extends a plain one, whose own margin matters for its own first token only
    return {"plain": plain, "reuse": [draw(REUSE_EXTRA, plain[REUSE_OF])], "long": [draw(LONG_LENGTH)]}


def _reference_margin(model):
    import torch

    ref = _reference_model(model)

    def margin(prompt):
        with torch.no_grad():
            top = ref(torch.tensor([prompt])).logits[0, -1].topk(2).values
        return float(top[0] - top[1])

    return margin


_models: dict[str, object] = {}


def _reference_model(model):
    import torch
    from transformers import AutoModelForCausalLM

    key = str(model)
    if key not in _models:
        _models[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _models[key]


def engine_env(*, fp8: bool, trace_file: str | Path | None) -> dict[str, str]:
    """What the scheduler process must see (it inherits the environment at spawn)."""
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        # SGLang's create_flashinfer_kv_indices_triton / create_chunked_prefix_cache_kv_indices
        # and merge_state_triton run on this CPU only through Triton's interpreter.
        "TRITON_INTERPRET": "1",
        "SGLANG_MAX_KV_CHUNK_CAPACITY": str(KV_CHUNK_CAPACITY),
        "MLA_PLUGINS_FP8": "1" if fp8 else "0",
        "MLA_PLUGINS_TRACE": str(trace_file) if trace_file else "",
    }


@dataclass
class EngineResult:
    label: str
    fp8: bool
    tp_size: int
    main_pid: int
    start_seconds: float
    total_seconds: float
    #: per group: list of {"prompt_len", "tokens", "prompt_top1" (None without logprobs), "cached_tokens"}
    groups: dict[str, list[dict]]
    trace: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return self.__dict__.copy()


def _top1(meta: dict) -> list[int]:
    """Top-1 token predicted at each prompt position 1..L-1 (position 0 has no logprob)."""
    tops = meta["input_top_logprobs"]
    return [max(pos, key=lambda t: t[0])[1] for pos in tops[1:]]


def _collect(outs: list[dict], prompts: list[list[int]], with_logprobs: bool) -> list[dict]:
    rows = []
    for out, prompt in zip(outs, prompts, strict=True):
        meta = out["meta_info"]
        rows.append({
            "prompt_len": len(prompt),
            "tokens": list(out["output_ids"]),
            "prompt_top1": _top1(meta) if with_logprobs else None,
            "cached_tokens": int(meta.get("cached_tokens", 0)),
        })
    return rows


def run_engine(
    model: str | Path,
    requests: dict[str, list[list[int]]],
    *,
    label: str,
    fp8: bool = False,
    tp_size: int = 1,
    trace_file: str | Path | None = None,
    **engine_kw,
) -> EngineResult:
    """Start one Engine, send the three request groups in order, shut it down."""
    os.environ.update(engine_env(fp8=fp8, trace_file=trace_file))
    if trace_file:
        Path(trace_file).unlink(missing_ok=True)
    import sglang

    begin = time.perf_counter()
    engine = sglang.Engine(
        model_path=str(model), device="cpu", skip_tokenizer_init=True, dtype="bfloat16",
        disable_cuda_graph=True, prefill_attention_backend="mla_plugins",
        decode_attention_backend="torch_native", chunked_prefill_size=CHUNKED_PREFILL_SIZE,
        page_size=1, tp_size=tp_size, random_seed=0, max_running_requests=4,
        max_total_tokens=4096, log_level="error", **engine_kw,
    )
    started = time.perf_counter()
    sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    logprobs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1}
    groups = {}
    try:
        for name, with_logprobs in (("plain", True), ("reuse", False), ("long", True)):
            prompts = requests[name]
            outs = engine.generate(input_ids=prompts, sampling_params=sampling,
                                   **(logprobs if with_logprobs else {}))
            groups[name] = _collect(outs if isinstance(outs, list) else [outs], prompts, with_logprobs)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    trace = []
    if trace_file and Path(trace_file).exists():
        trace = [json.loads(line) for line in Path(trace_file).read_text().splitlines() if line]
    return EngineResult(label, fp8, tp_size, os.getpid(), round(started - begin, 1),
                        round(time.perf_counter() - begin, 1), groups, trace)


def reference_top1(model: str | Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers float32: the argmax token after each prefix of each prompt (len L each:
    positions 1..L-1 of the prompt, then the first generated token)."""
    import torch

    ref = _reference_model(model)
    with torch.no_grad():
        return [ref(torch.tensor([p])).logits[0].argmax(-1).tolist() for p in prompts]


def agreement(result: EngineResult, requests: dict[str, list[list[int]]], model: str | Path,
              reference: dict[str, list[list[int]]] | None = None) -> dict:
    """Compare with the float32 reference: first generated token of every prompt, and top-1
    over prompt positions on the groups that carry prompt logprobs."""
    if reference is None:
        reference = {name: reference_top1(model, prompts) for name, prompts in requests.items()}
    first_equal, pairs = {}, []
    for name, rows in result.groups.items():
        for i, row in enumerate(rows):
            ref = reference[name][i]
            first_equal[f"{name}[{i}]"] = row["tokens"][0] == ref[-1]
            if row["prompt_top1"] is not None:
                pairs += list(zip(row["prompt_top1"], ref[:-1], strict=True))
    return {
        "first_token_equal": first_equal,
        "all_first_tokens_equal": all(first_equal.values()),
        "prompt_top1_agreement": sum(a == b for a, b in pairs) / max(len(pairs), 1),
        "prompt_positions": len(pairs),
    }


def trace_summary(trace: list[dict], main_pid: int) -> dict:
    """Counts by entry and pid, and whether every call came from another process than main."""
    by_entry: dict[str, int] = {}
    for t in trace:
        by_entry[t["entry"]] = by_entry.get(t["entry"], 0) + 1
    return {
        "calls": len(trace),
        "by_entry": by_entry,
        "pids": sorted({t["pid"] for t in trace}),
        "all_from_scheduler": bool(trace) and all(t["pid"] != main_pid for t in trace),
        "kernels": sorted({t["kernel"] for t in trace}),
        "fp8": sorted({t["fp8"] for t in trace}),
        "heads": sorted({t["heads"] for t in trace}),
        "max_q_tokens": max((t["q_tokens"] for t in trace), default=0),
        "max_k_tokens": max((t["k_tokens"] for t in trace), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m mla_plugins.demo.sglang_engine OUT.json [--fp8 0|1 ...] [--tp N ...]`: one
    engine per (tp, fp8) pair, in order, plus the reference comparison, as JSON (the test runs
    this in a fresh process: one SGLang import, one checkpoint and one float32 reference for
    every engine). A tp above 1 binds one core per rank (SGLANG_CPU_OMP_THREADS_BIND "0|1|...",
    unless set: without a bind list SGLang wants a NUMA node per rank) for its engines only."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mla_plugins.demo.sglang_engine")
    parser.add_argument("out")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--fp8", action="append", choices=["0", "1"], default=None,
                        help="one engine per value, in order (default: 0)")
    parser.add_argument("--tp", type=int, action="append", default=None,
                        help="engines at each of these tp sizes, in order (default: 1)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    model = workdir / "tiny-deepseek-v2"
    if not (model / "config.json").exists():
        build_model(model)
    requests = make_requests(model)
    _models.clear()  # the reference model is loaded again after the engines, not held during them
    runs = []
    reference = None
    bind = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND")
    for tp, fp8 in [(tp, v == "1") for tp in (args.tp or [1]) for v in (args.fp8 or ["0"])]:
        label = f"{'fp8' if fp8 else 'bf16'}-tp{tp}"
        if bind is None and tp > 1:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(tp))
        elif bind is None:
            os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
        result = run_engine(model, requests, label=label, fp8=fp8, tp_size=tp,
                            trace_file=workdir / f"trace-{label}.jsonl")
        if reference is None:
            reference = {name: reference_top1(model, prompts) for name, prompts in requests.items()}
        runs.append({**result.to_json(), "agreement": agreement(result, requests, model, reference),
                     "trace_summary": trace_summary(result.trace, result.main_pid)})
    Path(args.out).write_text(json.dumps({"requests": {k: [len(p) for p in v] for k, v in requests.items()},
                                          "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
