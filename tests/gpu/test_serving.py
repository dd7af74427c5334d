"""Serving path on the GPU (issue 11): a plan per batch, calls that read nothing back, allocate
nothing outside the workspace, replay their launches, and run inside a CUDA graph.

Every output is poisoned before the call and checked against float64 on fresh inputs.
"""

from __future__ import annotations

import pytest
import torch

import mla_plugins
from mla_plugins.core.kernels import triton_launch
from tests.core.helpers import BF16_TOL, FP8_TOL, check_attention, poisoned, random_batch
from tests.gpu.conftest import reference_on_device, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

CASES = {
    "equal": ([512, 512], [512, 512], 16),
    "varlen-prefix": ([1, 200, 257, 70], [129, 700, 513, 70], 16),  # unaligned starts
    "split": ([300], [6000], 2),  # few tiles over a long prefix: the kernel's plan splits
}


def offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def check(out, lse, q, k, v, plan, fp8):
    cq = torch.tensor(plan.cu_seqlens_host[0], dtype=torch.int32, device=q.device)
    ck = torch.tensor(plan.cu_seqlens_host[1], dtype=torch.int32, device=q.device)
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, causal=True)
    check_attention(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, error=rel_err)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_replayed_calls_match_float64(case, fp8, device):
    """The first call records its launches, the next ones replay them on new tensors."""
    lens_q, lens_k, heads = CASES[case]
    plan = mla_plugins.plan_prefill(offsets(lens_q), offsets(lens_k), kernel="triton", num_heads=heads,
                                    device=device, fp8=fp8)
    assert plan.kernel == "triton"
    for _ in range(3):
        q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
        out = poisoned((q.shape[0], heads, 128), q.dtype, device)
        mla_plugins.mla_prefill(q, k, v, plan=plan, out=out)  # recorded on the first pass
        out = poisoned((q.shape[0], heads, 128), q.dtype, device)
        _, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, out=out, return_lse=True)
        check(out, lse, q, k, v, plan, fp8)
    replay = plan.memo.get("replay")
    assert replay is not None and replay[1] is not None, "the launches of a plan must be replayable"
    if case == "split":
        assert plan.num_partial_tiles > 0


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_call_with_plan_reads_nothing_back_and_allocates_nothing(fp8, device):
    lens_q, lens_k, heads = CASES["varlen-prefix"]
    plan = mla_plugins.plan_prefill(offsets(lens_q), offsets(lens_k), kernel="triton", num_heads=heads,
                                    device=device, fp8=fp8)
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, device=device)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    for _ in range(2):  # warm: compile, record, size the workspace
        mla_plugins.mla_prefill(q, k, v, cq, ck, plan=plan, out=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(device)["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            mla_plugins.mla_prefill(q, k, v, cq, ck, plan=plan, out=out)
            mla_plugins.mla_prefill(q, k, v, plan=plan, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats(device)["allocation.all.allocated"] == before
    out2, lse2 = mla_plugins.mla_prefill(q, k, v, plan=plan, return_lse=True)
    check(out2, lse2, q, k, v, plan, fp8)


def test_call_without_plan_reads_offsets_once(device, monkeypatch):
    lens_q, lens_k, heads = CASES["varlen-prefix"]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, device=device)
    mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda t: (reads.append(t.device) if t.device.type == "cuda" else None) or original(t))
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False, return_lse=True)
    assert len(reads) == 1, f"{len(reads)} device reads in one call without a plan"
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck)
    check_attention(out, lse, ref_out, ref_lse, BF16_TOL, error=rel_err)


@pytest.mark.parametrize("case", ["varlen-prefix", "split"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_replay_on_new_values(case, fp8, device):
    """Captured once, replayed on new q/k/v values: equal to float64 on those values."""
    lens_q, lens_k, heads = CASES[case]
    plan = mla_plugins.plan_prefill(offsets(lens_q), offsets(lens_k), kernel="triton", num_heads=heads,
                                    device=device, fp8=fp8)
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            mla_plugins.mla_prefill(q, k, v, plan=plan, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, glse = mla_plugins.mla_prefill(q, k, v, plan=plan, out=out, return_lse=True)
    for seed in (1, 2):
        q2, k2, v2, _, _ = random_batch(lens_q, lens_k, heads, device=device, seed=seed)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        out.fill_(float("nan"))
        glse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, glse, q2, k2, v2, plan, fp8)


def test_replay_off_gives_the_same_result(device):
    lens_q, lens_k, heads = CASES["split"]
    plan = mla_plugins.plan_prefill(offsets(lens_q), offsets(lens_k), kernel="triton", num_heads=heads, device=device,
                                    fp8=True)
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    for _ in range(2):
        a = mla_plugins.mla_prefill(q, k, v, plan=plan)
    triton_launch.ENABLED = False
    try:
        b = mla_plugins.mla_prefill(q, k, v, plan=plan)
    finally:
        triton_launch.ENABLED = True
    assert torch.equal(a, b)
