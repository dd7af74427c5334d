"""SGLang part of `make demo`: `python -m mla_plugins.demo.sglang_demo` (run by `nox -s sglang -- demo`).

1. SGLang's own `load_plugins()` discovers the `mla_plugins` entry point (fresh process).
2. SGLang's CLI accepts `--prefill-attention-backend mla_plugins` once the plugin loaded.
3. One prefill of a DeepSeek-shaped layer (4 heads, q/k 192, v 128, cached prefixes)
   through the registered factory, built from SGLang's attention test-kit model runner
   (real MLATokenToKVPool, ForwardBatch, RadixAttention), checked against float64.
4. Generation by a real `sglang.Engine(device="cpu")` (spawned scheduler) on a tiny random
   DeepSeek-V2, prefill `mla_plugins`, decode `torch_native`, bf16 then fp8: plain prompts in
   one batch, a cached-prefix reuse, a long prompt through SGLang's chunked-prefix path
   (mla_plugins/demo/sglang_engine.py); greedy tokens, top-1 agreement with transformers in
   float32, and the MLA_PLUGINS_TRACE summary of each run.

SGLang's CPU engine imports names from `sgl_kernel` (PyPI has CUDA builds only): the nox
session puts the tests' import-only stand-in (tests/sglang/env/sgl_kernel_standin) on
PYTHONPATH; a CPU build of sgl-kernel works too. `--no-engine` skips step 4.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch
from rich.console import Console

console = Console()

_DISCOVER = """
import json
from importlib.metadata import entry_points
from sglang.srt import server_args as sa
from sglang.srt.plugins import load_plugins
eps = [f"{e.name} = {e.value}" for e in entry_points(group="sglang.srt.plugins")]
before = "mla_plugins" in sa.ATTENTION_BACKEND_CHOICES
load_plugins()
import argparse
p = argparse.ArgumentParser(); sa.ServerArgs.add_cli_args(p)
ns = p.parse_args(["--model-path", "m", "--prefill-attention-backend", "mla_plugins",
                   "--decode-attention-backend", "triton"])
print(json.dumps({"entry_points": eps, "before": before,
                  "after": "mla_plugins" in sa.ATTENTION_BACKEND_CHOICES,
                  "prefill": ns.prefill_attention_backend, "decode": ns.decode_attention_backend}))
"""


def _discover() -> bool:
    proc = subprocess.run([sys.executable, "-c", _DISCOVER], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        console.print(f"[red]plugin discovery failed[/red]\n{proc.stderr[-3000:]}")
        return False
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    console.print(f"entry points in group sglang.srt.plugins: {r['entry_points']}")
    console.print(f"'mla_plugins' in SGLang's attention choices: before load_plugins() {r['before']}, "
                  f"after {r['after']}")
    console.print(f"CLI parsed --prefill-attention-backend {r['prefill']} "
                  f"--decode-attention-backend {r['decode']}")
    return r["after"] and not r["before"] and r["prefill"] == "mla_plugins"


def _prefill() -> bool:
    import mla_plugins.sglang as adapter

    adapter.register()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    heads, lora, rope, nope, dv, ctx = 4, 512, 64, 128, 128, 64
    dqk = nope + rope
    prefix, extend = (9, 0, 20), (4, 11, 1)
    case = kit.MLAAttentionCase(name="demo", backend="mla_plugins", forward_mode=ForwardMode.EXTEND,
                                num_heads=heads, page_size=1, prefix_lens=prefix, extend_lens=extend)
    config = kit.TinyMLAModelConfig(num_heads=heads, kv_lora_rank=lora, qk_rope_head_dim=rope,
                                    hidden_size=256, context_len=ctx)
    runner = kit.MockMLAModelRunner(case=case, model_config=config, dtype=torch.bfloat16, device="cpu",
                                    max_context_len=ctx, kv_lora_rank=lora, qk_rope_head_dim=rope)
    runner.decode_attention_backend_str = "triton"  # split prefill/decode, as the flags say
    batch = kit._make_forward_batch(case, runner, max_context_len=ctx, device="cpu")
    backend = ATTENTION_BACKENDS["mla_plugins"](runner)

    gen = torch.Generator().manual_seed(0)
    n_all = sum(case.seq_lens)
    latent = (torch.randn(n_all, 1, lora + rope, generator=gen) * 0.5).to(torch.bfloat16)
    locs = torch.cat([runner.req_to_token_pool.req_to_token[b, :s].long() for b, s in enumerate(case.seq_lens)])
    layer_id = type("L", (), {"layer_id": 0})
    runner.token_to_kv_pool.set_kv_buffer(layer_id, locs, latent, None)
    stored = runner.token_to_kv_pool.get_key_buffer(0)[locs].to(torch.bfloat16)
    kv_b = (torch.randn(heads * (nope + dv), lora, generator=gen) * lora**-0.5).to(torch.bfloat16)
    kv = (stored[:, 0, :lora] @ kv_b.T).view(n_all, heads, nope + dv)
    k = torch.cat([kv[..., :nope], stored[:, :, lora:].expand(-1, heads, -1)], dim=-1)
    v = kv[..., nope:]
    q = torch.randn(sum(extend), heads, dqk, generator=gen).to(torch.bfloat16)
    layer = RadixAttention(num_heads=heads, head_dim=dqk, scaling=dqk**-0.5, num_kv_heads=heads, layer_id=0,
                           v_head_dim=dv)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(batch)
        out = layer(q.reshape(q.shape[0], -1), k, v, batch, save_kv_cache=False).view(-1, heads, dv)

    refs, qs, ks = [], 0, 0
    for ql, kl in zip(extend, case.seq_lens, strict=True):
        s = torch.einsum("qhd,khd->hqk", q[qs:qs + ql].double(), k[ks:ks + kl].double()) * dqk**-0.5
        mask = torch.arange(kl)[None, :] <= torch.arange(ql)[:, None] + (kl - ql)
        s = s.masked_fill(~mask, -math.inf)
        refs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[ks:ks + kl].double()))
        qs, ks = qs + ql, ks + kl
    ref = torch.cat(refs)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ok = bool(torch.isfinite(out).all()) and err <= 1e-2
    console.print(f"{type(backend).__name__}.forward_extend: prefixes {prefix}, new tokens {extend}, "
                  f"{heads} heads, q/k 192, v 128, bf16: rel-L2 vs float64 = {err:.2e} "
                  f"({'[green]ok[/green]' if ok else '[red]FAIL[/red]'}, limit 1e-2)")
    return ok


def _engine() -> bool:
    import tempfile
    from pathlib import Path

    from . import sglang_engine as se

    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        console.print("[red]Engine end to end: no sgl_kernel importable[/red] (SGLang's CPU engine imports "
                      "it); run through `nox -s sglang -- demo`, or put tests/sglang/env/sgl_kernel_standin "
                      "on PYTHONPATH")
        return False
    ok = True
    with tempfile.TemporaryDirectory(prefix="mla-plugins-sglang-demo-") as tmp:
        work = Path(tmp)
        model = se.build_model(work / "tiny-deepseek-v2")
        requests = se.make_requests(model)
        se._models.clear()  # not held while the engines run
        console.print(f"requests: plain {[len(p) for p in requests['plain']]} tokens in one batch; reuse "
                      f"{len(requests['reuse'][0])} tokens (plain prompt {se.REUSE_OF} + {se.REUSE_EXTRA} new); "
                      f"long {len(requests['long'][0])} tokens, chunked prefill {se.CHUNKED_PREFILL_SIZE}, "
                      f"KV chunk capacity {se.KV_CHUNK_CAPACITY}; {se.MAX_NEW_TOKENS} greedy tokens each")
        reference = None
        for fp8 in (False, True):
            label = "fp8" if fp8 else "bf16"
            result = se.run_engine(model, requests, label=label, fp8=fp8, trace_file=work / f"trace-{label}.jsonl")
            if reference is None:
                reference = {name: se.reference_top1(model, p) for name, p in requests.items()}
            agree = se.agreement(result, requests, model, reference)
            t = se.trace_summary(result.trace, result.main_pid)
            console.rule(f"Engine, prefill mla_plugins ({label}), decode torch_native")
            console.print(f"engine start {result.start_seconds} s, total {result.total_seconds} s, "
                          f"main pid {result.main_pid}")
            for name, rows in result.groups.items():
                for i, row in enumerate(rows):
                    ref_first = reference[name][i][-1]
                    console.print(f"  {name}[{i}]: {row['prompt_len']} prompt tokens, {row['cached_tokens']} "
                                  f"cached -> greedy {row['tokens']} (float32 reference first token {ref_first})")
            console.print(f"  top-1 agreement with transformers float32 over {agree['prompt_positions']} prompt "
                          f"positions: {agree['prompt_top1_agreement']:.1%}; first tokens equal: "
                          f"{agree['all_first_tokens_equal']}")
            console.print(f"  trace: {t['calls']} calls {t['by_entry']} from pids {t['pids']} (all in the "
                          f"scheduler: {t['all_from_scheduler']}), kernel {t['kernels']}, fp8 {t['fp8']}, "
                          f"heads {t['heads']}, max q {t['max_q_tokens']} / k {t['max_k_tokens']} tokens")
            limit = 0.90 if fp8 else 0.95
            ok = ok and agree["prompt_top1_agreement"] >= limit and t["all_from_scheduler"]
            ok = ok and (fp8 or agree["all_first_tokens_equal"])
    return ok


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    console.rule("SGLang adapter (sglang " + __import__("importlib.metadata").metadata.version("sglang") + ")")
    ok = _discover()
    ok = _prefill() and ok
    if "--no-engine" not in args:
        ok = _engine() and ok
    console.print("[green]SGLang demo passed[/green]" if ok else "[red]SGLang demo failed[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
