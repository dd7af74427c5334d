"""The FA3 provider (kernel "flash_attn") with the REAL FlashAttention-3 on a Hopper GPU.

Needs `fa3_fwd_interface` (the PyPI wheel fa3-fwd 0.0.3, FA3's forward alone) and an sm_90
device; skipped otherwise (the CPU tests against fakes are tests/core/test_flash_attn.py).
What this sees that they cannot: FA3's own tiles, fp32 accumulation and fp8 P rounding, its
real edge values, the GPU quantization, CUDA-graph capture, and that a planned call does not
synchronize with the host. Every output is poisoned with NaN before the call; inputs are
fresh random draws; references are float64 on the device.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mla_plugins
from tests.core.helpers import BF16_TOL, FP8_TOL, poisoned, random_batch
from tests.gpu.conftest import reference_on_device, rel_err, scale_outliers

pytestmark = [pytest.mark.gpu]  # no GPU: skipped by tests/conftest.py


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if torch.version.hip:
        return "FlashAttention-3 is CUDA only"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"FlashAttention-3 needs Hopper (sm_90); found sm_{major}{minor}"
    if importlib.util.find_spec("fa3_fwd_interface") is None:
        return "fa3_fwd_interface (pip install fa3-fwd) not installed"
    return None


_why = _skip_reason()
if _why:
    pytestmark.append(pytest.mark.skip(reason=_why))

#: (q lengths, k lengths): varlen with a cached prefix and unaligned starts; a chunked
#: prefill (k > q); empty sequences (q_len 0, k_len 0 with q_len > 0) and rows that see no key
#: (k < q, bottom-right causal); one sequence across several FA3 tiles
CASES = {
    "varlen-prefix": ([1, 200, 257, 70], [129, 700, 513, 70]),
    "chunked": ([512], [2048]),
    "empty-and-no-key": ([0, 100, 40, 130, 7], [60, 0, 80, 30, 7]),
    "long": ([1000], [1000]),
}


@pytest.fixture(autouse=True)
def fresh_binding():
    from mla_plugins.core.kernels import flash_attn

    flash_attn.reset()
    b = flash_attn.binding()
    looked = "; ".join(x.describe() for x in flash_attn.bindings())
    assert b is not None, f"fa3_fwd_interface is installed but no FA3 binding is usable: {looked}"
    yield b
    flash_attn.reset()


def offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def run(q, k, v, cq, ck, *, fp8, rotate=None, plan=None, causal=True):
    heads = q.shape[1]
    if plan is None:
        plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, causal=causal, device=q.device,
                                        fp8=fp8, kernel="flash_attn")
    assert plan.kernel == "flash_attn"
    out = poisoned((q.shape[0], heads, v.shape[2]), q.dtype, q.device)
    result, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=fp8,
                                          fp8_rotate=rotate, causal=causal, out=out,
                                          return_lse=True)
    assert result is out
    return out, lse


def check(out, lse, ref_out, ref_lse, tol, lse_atol, what):
    assert not torch.isnan(out).any(), f"{what}: output has NaN"
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN"
    err = rel_err(out, ref_out)
    assert err <= tol, f"{what}: output relative L2 error {err:.3e} > {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), (
        f"{what}: lse must be finite exactly where a row sees a key "
        f"({int((~torch.isfinite(lse)).sum())} non-finite, expected {int((~finite).sum())})")
    assert (lse[~finite] == float("-inf")).all(), f"{what}: rows that see no key need lse -inf"
    assert (out[~finite] == 0).all(), f"{what}: rows that see no key need output 0"
    if finite.any():
        gap = (lse[finite].double() - ref_lse[finite]).abs().max().item()
        assert gap <= lse_atol, f"{what}: lse off by {gap:.3e} > {lse_atol} (natural log)"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("mode", ["bf16", "e4m3-rotated", "e4m3-plain"])
def test_matches_float64(case, heads, mode, device):
    lens_q, lens_k = CASES[case]
    if heads == 128 and case == "long":
        lens_q, lens_k = [600], [600]  # keep the float64 reference small
    fp8, rotate = mode != "bf16", mode == "e4m3-rotated"
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    cq, ck = offsets(lens_q), offsets(lens_k)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=rotate if fp8 else None)
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device=device),
                                           torch.tensor(ck, device=device))
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3,
          f"{case} H={heads} {mode}")


@pytest.mark.parametrize("mode", ["bf16", "e4m3-rotated"])
def test_not_causal(mode, device):
    lens_q, lens_k = CASES["varlen-prefix"]
    fp8 = mode != "bf16"
    q, k, v, _, _ = random_batch(lens_q, lens_k, 16, device=device)
    cq, ck = offsets(lens_q), offsets(lens_k)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=True if fp8 else None, causal=False)
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device=device),
                                           torch.tensor(ck, device=device), causal=False)
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3, mode)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("poison", ["inf", "nan", "1e30"])
@pytest.mark.parametrize("mode", ["bf16", "e4m3-rotated", "e4m3-plain"])
def test_isolation(poison, where, mode, device):
    """An inf, a NaN or 1e30 in one sequence leaves every other sequence's out and lse
    bit-identical to that sequence run alone. The poison sits in sequence 1's first rows,
    which sequence 0's last key block (keys 256-383 of its 300) covers."""
    lens_q, lens_k = [300, 200, 150], [300, 450, 150]
    fp8, rotate = mode != "bf16", mode == "e4m3-rotated"
    q, k, v, _, _ = random_batch(lens_q, lens_k, 8, device=device)
    cq, ck = offsets(lens_q), offsets(lens_k)
    x, start = {"q": (q, cq[1]), "k": (k, ck[1]), "v": (v, ck[1])}[where]
    x[start + 5, 3, 17] = float(poison)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=rotate if fp8 else None)
    # FA3's documented bf16 limit (README): its last, partial key tile of sequence 0 multiplies
    # zero weights by sequence 1's first value rows; a non-finite one there turns rows of that
    # tile NaN in the poisoned head (lse intact). fp8 stores it as 0 (own descale carries it).
    leaks = not fp8 and where == "v" and poison in ("inf", "nan")
    for b in (0, 2):
        alone_out, alone_lse = run(q[cq[b]:cq[b + 1]].clone(), k[ck[b]:ck[b + 1]].clone(),
                                   v[ck[b]:ck[b + 1]].clone(), [0, lens_q[b]], [0, lens_k[b]],
                                   fp8=fp8, rotate=rotate if fp8 else None)
        if leaks and b == 0:
            got = out[cq[b]:cq[b + 1]]
            same = (got == alone_out) | (got.isnan() & ~alone_out.isnan())
            others = [h for h in range(got.shape[1]) if h != 3]
            assert same.all() and not got[:, others].isnan().any(), "the bf16 leak went further"
            assert torch.equal(lse[cq[b]:cq[b + 1]], alone_lse)
            continue
        assert torch.equal(out[cq[b]:cq[b + 1]], alone_out), (
            f"{mode}: sequence {b}'s output changed by {poison} in sequence 1's {where} "
            f"({int(out[cq[b]:cq[b + 1]].isnan().sum())} NaN)")
        assert torch.equal(lse[cq[b]:cq[b + 1]], alone_lse), (
            f"{mode}: sequence {b}'s lse changed by {poison} in sequence 1's {where}")


#: a varlen batch with every edge, and one FA3 takes in its batched layout
GRAPH_CASES = {"empty-and-no-key": CASES["empty-and-no-key"], "equal-lengths": ([256] * 3, [256] * 3)}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
@pytest.mark.parametrize("mode", ["bf16", "e4m3-rotated", "e4m3-plain"])
def test_cuda_graph_replay_on_new_values(case, mode, device):
    """A planned call captured once, replayed on new q/k/v copied into the captured inputs:
    a varlen batch, and an equal-length one in FA3's batched layout (its lse copied into
    [H, total_q] inside the graph, handed back as the [total_q, H] view, as a varlen call's)."""
    lens_q, lens_k = GRAPH_CASES[case]
    heads, fp8, rotate = 16, mode != "bf16", mode == "e4m3-rotated"
    cq, ck = offsets(lens_q), offsets(lens_k)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=fp8,
                                    kernel="flash_attn")
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    kw = dict(plan=plan, kernel="flash_attn", fp8=fp8, fp8_rotate=rotate if fp8 else None, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm: the fp8 probe, compiles, recorded launches
            mla_plugins.mla_prefill(q, k, v, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, glse = mla_plugins.mla_prefill(q, k, v, return_lse=True, **kw)
    assert _batched_call(plan) == (case == "equal-lengths")
    assert glse.t().is_contiguous(), "vLLM's [H, total_q] must need no copy"
    cu_q, cu_k = torch.tensor(cq, device=device), torch.tensor(ck, device=device)
    for seed in (11, 12):
        q2, k2, v2, _, _ = random_batch(lens_q, lens_k, heads, device=device, seed=seed)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        out.fill_(float("nan"))
        glse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference_on_device(q2, k2, v2, cu_q, cu_k)
        check(out, glse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3,
              f"graph replay {mode} seed {seed}")


@pytest.mark.parametrize("mode", ["bf16", "e4m3-rotated"])
def test_planned_call_does_not_sync(mode, device):
    lens_q, lens_k = CASES["varlen-prefix"]
    heads, fp8 = 16, mode != "bf16"
    cq, ck = offsets(lens_q), offsets(lens_k)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=fp8,
                                    kernel="flash_attn")
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    kw = dict(plan=plan, kernel="flash_attn", fp8=fp8, fp8_rotate=True if fp8 else None, out=out)
    for _ in range(2):  # warm
        mla_plugins.mla_prefill(q, k, v, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _, lse = mla_plugins.mla_prefill(q, k, v, return_lse=True, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device=device),
                                           torch.tensor(ck, device=device))
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3,
          f"no-sync {mode}")


def test_binds_fa3_fwd(fresh_binding):
    """In a process without vLLM or SGLang, fa3-fwd is the FA3 bound (its schema read)."""
    assert fresh_binding.name in ("fa3_fwd", "flash_attn_3"), fresh_binding.describe()
    assert fresh_binding.supports_fp8
    assert fresh_binding.positions["q_descale"] == 20, fresh_binding.positions


@pytest.mark.parametrize("kernel", ["flash_attn", "triton"])
def test_planned_calls_follow_the_rotation_implementation(kernel, monkeypatch):
    """One plan, rotated fp8, `triton_quant.ROTATION` switched between calls (what
    benchmarks/rotation_cost.py does): each call runs the implementation named at its time
    (the replay key holds it; a stale recording would replay the other one's launches), both
    close to float64 on outlier features and to each other."""
    from mla_plugins.core.kernels import triton_heads as th
    from mla_plugins.core.kernels import triton_quant as tq

    monkeypatch.setattr(th, "HEAD_ROTATION", None)  # triton_quant.ROTATION names the cast
    q, k, v, cq, ck = random_batch([300, 700], [300, 900], 4, device="cuda", seed=91)
    scale_outliers(q, k)
    ref, _ = reference_on_device(q, k, v, cq, ck, causal=True)
    plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=4, device=q.device, fp8=True,
                                    kernel=kernel)
    outs = {}
    for rotation in ("dense", "kron", "dense"):
        monkeypatch.setattr(tq, "ROTATION", rotation)
        for _ in range(2):  # the first call records, the second replays
            out = torch.full((q.shape[0], 4, 128), float("nan"), dtype=q.dtype, device=q.device)
            mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=True, fp8_rotate=True, out=out,
                                    kernel=kernel)
            key = plan.memo["quant_replay" if kernel == "flash_attn" else "replay"][0]
            assert rotation in key, (rotation, key)
            err = rel_err(out, ref)
            assert err < 0.07, (rotation, err)
            outs.setdefault(rotation, out)
    assert rel_err(outs["kron"], outs["dense"]) < 0.02


# -- FA3's scheduler metadata (made once per plan and mode, passed on every call) -------------

#: the cases above with a sequence that FA3 splits over its keys (one 128-row query over 8192
#: keys: 7 splits at H=16 and 55 at H=1 on 132 SMs), so the combine path is seen too
METADATA_CASES = {
    "empty-and-no-key": CASES["empty-and-no-key"],
    "chunked": CASES["chunked"],
    "varlen-prefix": CASES["varlen-prefix"],
    "split": ([128], [8192]),
}


def _metadata_used(plan) -> torch.Tensor:
    """The scheduler metadata the plan's calls pass (asserting there is exactly one)."""
    from mla_plugins.core.kernels import flash_attn

    made = [m for m in plan.memo.get("fa3_metadata", {}).values() if m is not None]
    assert len(made) == 1, f"expected one scheduler metadata for the plan, found {len(made)}"
    (call,) = plan.memo["fa3_calls"].values()
    b = call[0]
    assert call[1][b.names.index("scheduler_metadata")] is made[0], "the call does not pass it"
    assert isinstance(b, flash_attn.Binding)
    return made[0]


@pytest.mark.parametrize("case", list(METADATA_CASES))
@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("mode", ["bf16", "e4m3-plain"])
def test_scheduler_metadata_changes_no_bit(case, heads, mode, device, fresh_binding, monkeypatch):
    """The provider's out and lse with the scheduler metadata it makes once per plan are
    bit-identical to the same op's without it (FA3's prepare kernel at every call), and
    close to float64; the metadata is made on the plan's first call and reused after."""
    assert fresh_binding.metadata_op is not None, (
        f"fa3-fwd 0.0.3 registers get_scheduler_metadata; the binding says: {fresh_binding.describe()}")
    lens_q, lens_k = METADATA_CASES[case]
    fp8 = mode != "bf16"
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    cq, ck = offsets(lens_q), offsets(lens_k)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=fp8,
                                    kernel="flash_attn")
    with_meta = [run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None, plan=plan)
                 for _ in range(2)]
    metadata = _metadata_used(plan)
    assert metadata.dtype == torch.int32 and metadata.is_cuda
    monkeypatch.setattr(fresh_binding, "metadata_op", None)  # FA3 schedules itself again
    plain = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=fp8,
                                     kernel="flash_attn")
    out_b, lse_b = run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None, plan=plain)
    assert not any(m is not None for m in plain.memo.get("fa3_metadata", {}).values())
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device=device),
                                           torch.tensor(ck, device=device))
    check(out_b, lse_b, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3,
          f"{case} H={heads} {mode} without metadata")
    for i, (out_a, lse_a) in enumerate(with_meta):
        check(out_a, lse_a, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL,
              0.25 if fp8 else 2e-3, f"{case} H={heads} {mode} with metadata, call {i}")
        assert torch.equal(out_a, out_b), (
            f"{case} H={heads} {mode} call {i}: output differs with the scheduler metadata "
            f"(max {(out_a.float() - out_b.float()).abs().max().item():.3e})")
        assert torch.equal(lse_a, lse_b), f"{case} H={heads} {mode} call {i}: lse differs with the metadata"


@pytest.mark.parametrize("mode", ["bf16", "e4m3-plain"])
def test_scheduler_metadata_made_without_sync(mode, device, fresh_binding):
    """A plan's first call makes the metadata (a subtraction and FA3's metadata op on the
    stream): nothing read back from the device."""
    lens_q, lens_k = CASES["varlen-prefix"]
    heads, fp8 = 16, mode != "bf16"
    cq, ck = offsets(lens_q), offsets(lens_k)
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    kw = dict(kernel="flash_attn", fp8=fp8, fp8_rotate=False if fp8 else None)
    warm = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=fp8, kernel="flash_attn")
    mla_plugins.mla_prefill(q, k, v, plan=warm, **kw)  # the fp8 probe and compiles
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=fp8, kernel="flash_attn")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, return_lse=True, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _metadata_used(plan)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device=device),
                                           torch.tensor(ck, device=device))
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3,
          f"first call {mode}")


@pytest.mark.parametrize("case", ["empty-and-no-key", "split"])
@pytest.mark.parametrize("mode", ["bf16", "e4m3-plain"])
def test_scheduler_metadata_replays_in_a_cuda_graph(case, mode, device, fresh_binding):
    """A planned call made eagerly once (the metadata made then), captured, replayed on new
    values: close to float64, bit-identical to the eager call on the same values, and the
    capture made no metadata of its own."""
    lens_q, lens_k = METADATA_CASES[case]
    heads, fp8 = 16, mode != "bf16"
    cq, ck = offsets(lens_q), offsets(lens_k)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=fp8,
                                    kernel="flash_attn")
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    kw = dict(plan=plan, kernel="flash_attn", fp8=fp8, fp8_rotate=False if fp8 else None, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            mla_plugins.mla_prefill(q, k, v, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    metadata = _metadata_used(plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, glse = mla_plugins.mla_prefill(q, k, v, return_lse=True, **kw)
    assert _metadata_used(plan) is metadata, "a metadata made during the capture"
    cu_q, cu_k = torch.tensor(cq, device=device), torch.tensor(ck, device=device)
    for seed in (21, 22):
        q2, k2, v2, _, _ = random_batch(lens_q, lens_k, heads, device=device, seed=seed)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        out.fill_(float("nan"))
        glse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference_on_device(q2, k2, v2, cu_q, cu_k)
        check(out, glse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3,
              f"graph replay {case} {mode} seed {seed}")
        replayed, replayed_lse = out.clone(), glse.clone()
        eager_out, eager_lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None, plan=plan)
        assert torch.equal(replayed, eager_out) and torch.equal(replayed_lse, eager_lse), (
            f"graph replay {case} {mode} seed {seed}: differs from the eager call")


def test_first_call_inside_a_capture_makes_no_metadata(device, fresh_binding):
    """A plan whose first call is captured: FA3 schedules itself inside the graph (no
    metadata made while capturing); the next eager call makes it; both agree bitwise."""
    lens_q, lens_k = CASES["varlen-prefix"]
    heads = 16
    cq, ck = offsets(lens_q), offsets(lens_k)
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device=device)
    warm = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=False, kernel="flash_attn")
    mla_plugins.mla_prefill(q, k, v, plan=warm, kernel="flash_attn", fp8=False)  # FA3 loaded
    torch.cuda.synchronize()
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=device, fp8=False, kernel="flash_attn")
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, glse = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=False,
                                          out=out, return_lse=True)
    assert not any(m is not None for m in plan.memo.get("fa3_metadata", {}).values()), (
        "scheduler metadata made while capturing")
    assert "fa3_seqused_k" not in plan.memo
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed, replayed_lse = out.clone(), glse.clone()
    eager_out, eager_lse = run(q, k, v, cq, ck, fp8=False, plan=plan)
    _metadata_used(plan)  # made by the eager call
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device=device),
                                           torch.tensor(ck, device=device))
    check(replayed, replayed_lse, ref_out, ref_lse, BF16_TOL, 2e-3, "captured first call")
    assert torch.equal(replayed, eager_out) and torch.equal(replayed_lse, eager_lse)


# -- equal-length batches: FA3's batched layout ----------------------------------------------

#: sequences of one length (queries = keys): several across FA3's tiles with S not a multiple
#: of 128, two long sequences, whole tiles (one sequence keeps varlen: the provider's doc)
EQUAL = {"B4-S300": [300] * 4, "B2-S1000": [1000] * 2, "B3-S128": [128] * 3}


def _batched_call(plan) -> bool:
    """Whether the plan's one prepared FA3 call is the batched layout (no offsets)."""
    (call,) = plan.memo["fa3_calls"].values()
    b, args = call[0], call[1]
    return args[b.positions["cu_seqlens_q"]] is None and args[b.positions["cu_seqlens_k"]] is None


@pytest.mark.parametrize("case", list(EQUAL))
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("mode", ["bf16", "e4m3-rotated", "e4m3-plain"])
def test_equal_lengths_run_batched(case, heads, mode, device, monkeypatch):
    """An equal-length batch reaches FA3 in its batched layout and matches float64; the same
    batch through the varlen call (UNIFORM_BATCHED off) matches it too."""
    from mla_plugins.core.kernels import flash_attn

    lens = EQUAL[case] if heads < 128 else [min(n, 600) for n in EQUAL[case][:2]]
    fp8, rotate = mode != "bf16", mode == "e4m3-rotated"
    q, k, v, _, _ = random_batch(lens, lens, heads, device=device, seed=700 + heads)
    cq = offsets(lens)
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device=device),
                                           torch.tensor(cq, device=device))
    for batched in (True, False):
        monkeypatch.setattr(flash_attn, "UNIFORM_BATCHED", batched)
        plan = mla_plugins.plan_prefill(cq, cq, num_heads=heads, device=device, fp8=fp8,
                                        kernel="flash_attn")
        out, lse = run(q, k, v, cq, cq, fp8=fp8, rotate=rotate if fp8 else None, plan=plan)
        assert _batched_call(plan) == batched
        torch.cuda.synchronize()
        check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL, 0.25 if fp8 else 2e-3,
              f"{case} H={heads} {mode} {'batched' if batched else 'varlen'}")


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("poison", ["inf", "nan", "1e30"])
@pytest.mark.parametrize("mode", ["bf16", "e4m3-plain"])
def test_equal_lengths_isolation(poison, where, mode, device):
    """The batched layout reads no row of another sequence (TMA's bounds are each sequence's
    own): a poison in sequence 1 leaves sequences 0 and 2 bit-identical to each run alone, in
    bf16 too (where the varlen call's last partial key tile reads the next sequence's rows)."""
    lens = [300] * 3
    fp8 = mode != "bf16"
    q, k, v, _, _ = random_batch(lens, lens, 8, device=device, seed=710)
    cq = offsets(lens)
    x = {"k": k, "v": v}[where]
    x[cq[1] + 5, 3, 17] = float(poison)
    out, lse = run(q, k, v, cq, cq, fp8=fp8, rotate=False if fp8 else None)
    for b in (0, 2):
        s = slice(cq[b], cq[b + 1])
        alone_out, alone_lse = run(q[s].clone(), k[s].clone(), v[s].clone(), [0, 300], [0, 300],
                                   fp8=fp8, rotate=False if fp8 else None)
        assert torch.equal(out[s], alone_out), (
            f"{mode}: sequence {b}'s output changed by {poison} in sequence 1's {where} "
            f"({int(out[s].isnan().sum())} NaN)")
        assert torch.equal(lse[s], alone_lse), f"{mode}: sequence {b}'s lse changed"
