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
from tests.gpu.conftest import reference_on_device, rel_err

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


@pytest.mark.parametrize("mode", ["bf16", "e4m3-rotated", "e4m3-plain"])
def test_cuda_graph_replay_on_new_values(mode, device):
    """A planned call captured once, replayed on new q/k/v copied into the captured inputs."""
    lens_q, lens_k = CASES["empty-and-no-key"]
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
    from mla_plugins.core.kernels import triton_quant as tq

    q, k, v, cq, ck = random_batch([300, 700], [300, 900], 4, device="cuda", seed=91)
    for x in (q, k):
        x[..., 7] *= 10
        x[..., 128:132] *= 10
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
