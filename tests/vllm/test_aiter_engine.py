"""Issue 10 item 5 in vLLM 0.32's real multi-process engine: only the worker imports aiter.

`register()` runs in every vLLM process (the LLM/API process, the engine core, each
worker). It must neither import aiter nor ask torch about the GPU there: on ROCm
`torch.cuda.get_device_properties` creates a HIP context and vLLM then falls back from
fork to spawn. Here a real `LLM(...)` (engine core and a separate worker process:
`distributed_executor_backend="mp"`) runs the tiny DeepSeek-V2 on the CPU with a fake AMD
AITER importable in every process; the fake appends its pid to a file when imported.
Our prefill takes vLLM's CPU slot (MLA_PLUGINS_VLLM_OVERRIDE=CPU), and its kernel choice
probes AITER, in the worker, at the first prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import REPO

SCRIPT = r'''
import json, os, sys
from pathlib import Path

if __name__ == "__main__":
    work, REPO = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, REPO)
    from tests.fakes import fake_aiter

    dest = fake_aiter.write_package(work / "fake", "num_kv_splits")
    init = dest / "aiter" / "__init__.py"
    pids = work / "aiter-imports.txt"
    init.write_text(
        "import os as _os\n"
        f"with open({str(pids)!r}, 'a') as _f:\n"
        "    _f.write(f'{_os.getpid()}\\n')\n" + init.read_text())
    os.environ["PYTHONPATH"] = os.pathsep.join([str(dest), REPO, os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(dest))
    os.environ.update({
        "MLA_PLUGINS_VLLM_OVERRIDE": "CPU", "MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL": "1",
        "MLA_PLUGINS_TRACE": str(work / "trace.jsonl"),
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    })
    import psutil
    from mla_plugins.demo.tiny_model import build_tiny_deepseek_v2
    from mla_plugins.demo.vllm_engine import make_prompts, worker_facts
    from vllm import LLM, SamplingParams

    model = build_tiny_deepseek_v2(work / "model")
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=2,
              enable_prefix_caching=False, seed=0, distributed_executor_backend="mp")
    try:
        children = sorted(p.pid for p in psutil.Process().children(recursive=True))
        after_start = sorted(set(int(x) for x in pids.read_text().split())) if pids.exists() else []
        worker = llm.collective_rpc(worker_facts)[0]
        out = llm.generate([{"prompt_token_ids": make_prompts((300,))[0]}],
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                           use_tqdm=False)
        tokens = list(out[0].outputs[0].token_ids)
    finally:
        llm.llm_engine.engine_core.shutdown()
    imports = sorted(int(x) for x in pids.read_text().split()) if pids.exists() else []
    trace = [json.loads(x) for x in (work / "trace.jsonl").read_text().splitlines() if x]
    print(json.dumps({"main": os.getpid(), "children": children, "worker": worker["pid"],
                      "layer_prefill_backends": worker["layer_prefill_backends"],
                      "aiter_imports_after_start": after_start, "aiter_imports": imports,
                      "trace_pids": sorted({t["pid"] for t in trace}), "tokens": tokens,
                      "aiter_in_main": "aiter" in sys.modules}))
'''


def test_only_the_worker_imports_aiter(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLA_PLUGINS_", "VLLM_PLUGINS"))}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), REPO], capture_output=True,
                          text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    worker, main = got["worker"], got["main"]
    assert worker != main and worker in got["children"], got
    # an engine core and a worker: two processes besides this one that ran register()
    assert len([p for p in got["children"] if p != worker]) >= 1, got
    assert got["layer_prefill_backends"] == ["MLAPluginsPrefillBackend"], got
    assert len(got["tokens"]) == 2 and got["trace_pids"] == [worker], got
    # nothing imported aiter while the engine started (register() ran in all three)...
    assert got["aiter_imports_after_start"] in ([], [worker]), got
    # ...and after a prefill, only the worker has: our kernel choice probed it there
    assert got["aiter_imports"] == [worker], got
    assert not got["aiter_in_main"]
