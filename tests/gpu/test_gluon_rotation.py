"""The Gluon rotated per-head cast (`rotation="gluon"`, core/kernels/gluon_rotate.py) on the GPU.

`triton_heads.quantize_heads(..., rotation="gluon")` against core/fp8.py's `head_quantize`
(rotate_=True) and against the dense Triton cast on the same inputs: descales bit for bit
(both take them from the same partials with the same operations), v's bytes bit for bit,
q8/k8 within one e4m3 step where float32 sums in another order round on either side of a
midpoint (the bound the kron tests use, tests/gpu/test_triton.py). Outputs poisoned first;
varlen batches with an empty sequence; H 1, 16, 128; special values; one sequence's
inf/NaN/1e30 leaving the others' bytes unchanged; the tuning knobs leaving every byte; then
the FA3 provider end to end with the rotation switched to "gluon" against float64, its
recorded launches replayed and captured in a CUDA graph.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mla_plugins
from tests.core.helpers import FP8_TOL, poisoned, random_batch
from tests.gpu.conftest import reference_on_device, rel_err, scale_outliers

pytestmark = [pytest.mark.gpu, pytest.mark.triton]  # no GPU: skipped by tests/conftest.py


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from mla_plugins.core.kernels import triton_heads as th

    reasons = th.gluon_reasons(torch.device("cuda"))
    return "; ".join(reasons) if reasons else None


_why = _skip_reason()
if _why:
    pytestmark.append(pytest.mark.skip(reason=_why))

FP8 = torch.float8_e4m3fn
#: a rotated row's float32 sum may be off by 192 ulps of the sum of its magnitudes (at most
#: the fp8 maximum once scaled): tests/gpu/test_triton.py's bound
SUM_ERROR = 192 * 2.0**-24 * 448.0
#: q lengths = k lengths: an empty sequence, one row, starts not 16-aligned, several programs
LENS = [333, 0, 64, 2000, 1]


def assert_fp8_close(got, want):
    """One e4m3 step apart (or the float32 sum's error) at most, and rarely at all."""
    g, w = got.cpu().float(), want.cpu().float()
    assert torch.isfinite(g).all(), "stored fp8 values are finite (NaN -> 0)"
    mag = w.abs().clamp_min(2.0**-6)  # e4m3's smallest normal; subnormal steps are 2^-9
    step = 2.0 ** (torch.floor(torch.log2(mag)) - 3)
    diff = (g - w).abs()
    assert (diff <= torch.maximum(step, torch.full_like(step, SUM_ERROR))).all(), (
        f"{(diff / torch.maximum(step, torch.full_like(step, SUM_ERROR))).max():.2f} x the bound")
    assert (diff > 0).float().mean() < 1e-2, "more than the odd rounding tie moved"


def same_bytes(a, b) -> bool:
    return torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                       b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32))


def quantize(q, k, v, cq, ck, splits=7, *, rotation="gluon", **knobs):
    """quantize_heads into poisoned buffers (rotated); the five outputs."""
    from mla_plugins.core.kernels import triton_heads as th

    lq, lk = cq.diff().tolist(), ck.diff().tolist()
    b, heads = len(lq), q.shape[1]
    out = tuple(poisoned(shape, dtype, q.device) for _, shape, dtype in
                th.head_workspace_layout(q.shape[0], k.shape[0], b, heads, splits, FP8))
    return th.quantize_heads(q, k, v, cq, ck, b, max(lq, default=0), max(lk, default=0), splits,
                             FP8, rotate=True, rotation=rotation, out=out, **knobs)


def batch(heads, dtype=torch.bfloat16, lens=LENS, seed=None):
    q, k, v, cq, ck = random_batch(lens, lens, heads, dtype=dtype, scale=3.0, device="cuda",
                                   seed=seed)
    q = torch.cat((q, q[..., :64]), dim=-1)[..., :192]  # a strided view
    v = torch.cat((torch.randn_like(v), v), dim=-1)[..., 128:]  # vLLM's v view
    return q, k, v, cq, ck


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_matches_head_quantize_and_dense(heads, dtype):
    """q8, k8 within a step of the rule and of the dense cast, v8 and every descale bit for
    bit the dense cast's (the rule's v8 too), a NaN in one head of k; an empty sequence's
    descales 1."""
    from mla_plugins.core.fp8 import head_quantize

    lens = LENS if heads < 128 else [333, 0, 64, 700, 1]
    q, k, v, cq, ck = batch(heads, dtype, lens)
    k[400, heads // 2, 3] = float("nan")  # sequence 3
    got = quantize(q, k, v, cq, ck)
    dense = quantize(q, k, v, cq, ck, rotation="dense")
    q8, k8, v8, descales, partials = got
    for x, y8, d, cu, rot in ((q, q8, descales[0], cq, True), (k, k8, descales[1], ck, True),
                              (v, v8, descales[2], ck, False)):
        want, want_s = head_quantize(x.cpu(), cu.tolist(), FP8, rotate_=rot)
        if rot:
            assert_fp8_close(y8, want)
        else:
            assert same_bytes(y8.cpu(), want)
        ok = torch.isfinite(want_s)
        assert torch.equal(d.cpu().isnan(), want_s.isnan())
        torch.testing.assert_close(d.cpu()[ok], want_s[ok], rtol=1e-6, atol=0)
    assert_fp8_close(q8, dense[0])
    assert_fp8_close(k8, dense[1])
    assert same_bytes(v8, dense[2])
    assert same_bytes(descales, dense[3]) and same_bytes(partials, dense[4])
    assert (descales[:, 1] == 1).all(), "an empty sequence's descales are 1"


def test_knobs_leave_every_byte():
    """Blocks per program, warps, rows per warp, heads per program, the loads issued a step
    ahead, the paired stores, PDL (pass 2 started while pass 1 runs) and the programs' order
    change which program, warp or lane casts a row and when, never its arithmetic: every
    output byte the default's."""
    q, k, v, cq, ck = batch(6)
    k[700, 4, 3] = float("nan")
    want = quantize(q, k, v, cq, ck)
    for knobs in (dict(blocks=1), dict(blocks=8), dict(num_warps=8), dict(rows_per_warp=16),
                  dict(num_warps=8, rows_per_warp=16, blocks=2), dict(heads_per_program=2),
                  dict(sms=132), dict(prefetch=True), dict(paired_stores=True),
                  dict(prefetch=False, paired_stores=False),
                  dict(prefetch=True, paired_stores=True), dict(prefetch=True, blocks=1),
                  dict(prefetch=True, paired_stores=True, blocks=8),
                  dict(prefetch=True, paired_stores=True, rows_per_warp=16, blocks=2),
                  dict(prefetch=True, heads_per_program=2, sms=132), dict(pdl=False),
                  dict(pdl=False, prefetch=False), dict(pdl=True, prefetch=False),
                  dict(qk_first=False), dict(qk_first=False, heads_per_program=2, blocks=1)):
        got = quantize(q, k, v, cq, ck, **knobs)
        for a, b in zip(want, got, strict=True):
            assert same_bytes(a, b), knobs


def test_special_values():
    """Heads holding inf, NaN, 1e30 and all zeros against the rule and the dense cast, and
    one whose values are so small the scale's reciprocal overflows (the rule's slow path:
    every value 0 or +-448, its sign the rotated sum's)."""
    from mla_plugins.core.fp8 import head_quantize

    q, k, v, cq, ck = batch(8)
    s = slice(int(cq[3]), int(cq[4]))  # the 2000-row sequence
    q[s, 0, 5] = float("inf")
    k[s, 1, 9] = float("nan")
    q[s, 2, 7] = 1e30
    k[s, 3] = 0.0
    # normal float32 values near its smallest: the scale is subnormal, 1 / scale inf
    tiny = torch.rand(q[s, 4].shape, device="cuda") + 1
    q[s, 4] = (tiny * torch.randn_like(tiny).sign() * 2e-38).to(q.dtype)
    k[s, 5, 11] = float("-inf")
    v[s, 6, 3] = float("inf")
    q8, k8, v8, descales, _ = got = quantize(q, k, v, cq, ck)
    dense = quantize(q, k, v, cq, ck, rotation="dense")
    heads = torch.arange(8)
    for x, y8, d, cu, rot in ((q, q8, descales[0], cq, True), (k, k8, descales[1], ck, True),
                              (v, v8, descales[2], ck, False)):
        want, want_s = head_quantize(x.cpu(), cu.tolist(), FP8, rotate_=rot)
        if rot:
            # head 4 of q apart: a float32 sum within its rounding of zero may take the
            # other sign than the rule's float64 one, +-448 either way
            keep = heads != 4 if x is q else heads >= 0
            assert_fp8_close(y8.cpu().float()[:, keep], want.float()[:, keep])
        else:
            assert same_bytes(y8.cpu(), want)
        assert torch.equal(d.cpu().isnan(), want_s.isnan())
        assert torch.equal(d.cpu().isinf(), want_s.isinf())
    tiny8, want8 = q8[s, 4].cpu().float(), head_quantize(q.cpu(), cq.tolist(), FP8,
                                                         rotate_=True)[0][s, 4].float()
    assert ((tiny8.abs() == 448) | (tiny8 == 0)).all()
    assert (tiny8 == want8).float().mean() > 0.999
    for a, b in zip(got[2:], dense[2:], strict=True):
        assert same_bytes(a, b)
    assert (k8[s, 3].float() == 0).all() and descales[1, 3, 3] == 1
    # NaN/inf scales: every value of the head 0
    for y8, h in ((q8, 0), (k8, 1), (k8, 5)):
        assert (y8[s, h].float() == 0).all(), h


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("poison", ["inf", "nan", "1e30"])
def test_isolation(where, poison):
    """An inf, a NaN or 1e30 in sequence 1 leaves sequences 0 and 2's bytes (values and
    descales) those of each run alone (the same splits)."""
    lens = [300, 200, 150]
    q, k, v, cq, ck = random_batch(lens, lens, 8, device="cuda")
    x = {"q": q, "k": k, "v": v}[where]
    x[int(cq[1]) + 5, 3, 17] = float(poison)
    q8, k8, v8, d, _ = quantize(q, k, v, cq, ck, splits=3)
    cqh = cq.tolist()
    for b in (0, 2):
        rows = slice(cqh[b], cqh[b + 1])
        one = torch.tensor([0, lens[b]], dtype=torch.int32, device="cuda")
        aq8, ak8, av8, ad, _ = quantize(q[rows].clone(), k[rows].clone(), v[rows].clone(), one,
                                        one, splits=3)
        assert same_bytes(q8[rows], aq8) and same_bytes(k8[rows], ak8)
        assert same_bytes(v8[rows], av8) and same_bytes(d[:, b].contiguous(), ad[:, 0].contiguous())
    assert not torch.isfinite(d[:, 1, 3]).all() or poison == "1e30"


def _fa3_reason() -> str | None:
    if torch.cuda.get_device_capability() != (9, 0):
        return "FlashAttention-3 needs sm_90"
    if importlib.util.find_spec("fa3_fwd_interface") is None:
        return "fa3_fwd_interface (pip install fa3-fwd) not installed"
    return None


_fa3_why = _fa3_reason() if _why is None else None
fa3 = pytest.mark.skipif(_fa3_why is not None, reason=str(_fa3_why))


@pytest.fixture
def gluon_rotation(monkeypatch):
    """The FA3 provider with triton_quant.ROTATION = "gluon" (it passes none: the default)."""
    from mla_plugins.core.kernels import flash_attn
    from mla_plugins.core.kernels import triton_quant as tq

    flash_attn.reset()
    monkeypatch.setattr(tq, "ROTATION", "gluon")
    yield
    flash_attn.reset()


CASES = {
    "varlen-prefix": ([1, 200, 257, 70], [129, 700, 513, 70]),
    "empty-and-no-key": ([0, 100, 40, 130, 7], [60, 0, 80, 30, 7]),
    "long": ([1000], [1000]),
}


def _offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _run(q, k, v, cq, ck, plan=None, rotate=True):
    heads = q.shape[1]
    if plan is None:
        plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, device=q.device, fp8=True,
                                        kernel="flash_attn")
    out = poisoned((q.shape[0], heads, v.shape[2]), q.dtype, q.device)
    _, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=True,
                                     fp8_rotate=rotate, out=out, return_lse=True)
    return out, lse


@fa3
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_fa3_provider_matches_float64(case, heads, gluon_rotation):
    lens_q, lens_k = CASES[case]
    if heads == 128 and case == "long":
        lens_q, lens_k = [600], [600]  # keep the float64 reference small
    q, k, v, _, _ = random_batch(lens_q, lens_k, heads, device="cuda")
    cq, ck = _offsets(lens_q), _offsets(lens_k)
    out, lse = _run(q, k, v, cq, ck)
    ref_out, ref_lse = reference_on_device(q, k, v, torch.tensor(cq, device="cuda"),
                                           torch.tensor(ck, device="cuda"))
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, ref_out) <= FP8_TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (out[~finite] == 0).all()
    if finite.any():
        assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 0.25


@fa3
def test_fa3_provider_runs_the_gluon_cast_by_default():
    """With nothing switched (triton_heads.HEAD_ROTATION's default), the FA3 provider's
    rotated quantization records the Gluon cast on this GPU (`head_rotation`)."""
    from mla_plugins.core.kernels import flash_attn
    from mla_plugins.core.kernels import triton_heads as th

    flash_attn.reset()
    assert th.head_rotation(torch.device("cuda")) == "gluon"
    q, k, v, cq, ck = random_batch([300, 700], [300, 900], 4, device="cuda", seed=93)
    plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=4, device=q.device,
                                    fp8=True, kernel="flash_attn")
    for _ in range(2):
        _run(q, k, v, cq.tolist(), ck.tolist(), plan=plan)
    key, replay = plan.memo["quant_replay"]
    assert "gluon" in key and replay is not None


@fa3
def test_fa3_provider_outliers_replay_and_graph(gluon_rotation, monkeypatch):
    """Outlier features (q and k features 7 and 128-131 scaled by 10): the Gluon rotation
    closer to float64 than no rotation and close to the dense rotation's output; the second
    call of a plan replays the recorded launches (the key names "gluon", the replay exists,
    so the Gluon cast was recorded with the bound pass), on new values, and a CUDA graph
    of the call replays too."""
    from mla_plugins.core.kernels import triton_heads as th
    from mla_plugins.core.kernels import triton_quant as tq

    lens_q, lens_k = [300, 700], [300, 900]
    heads = 4
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, device="cuda", seed=91)
    scale_outliers(q, k)
    ref, _ = reference_on_device(q, k, v, cq, ck)
    plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=heads, device=q.device,
                                    fp8=True, kernel="flash_attn")
    errs = {}
    for rotate in (False, True):
        out, _ = _run(q, k, v, cq.tolist(), ck.tolist(), plan=plan, rotate=rotate)
        errs[rotate] = rel_err(out, ref)
    assert errs[True] < errs[False], errs
    key, replay = plan.memo["quant_replay"]
    assert "gluon" in key and replay is not None, "the Gluon cast's launches were not recorded"
    monkeypatch.setattr(th, "HEAD_ROTATION", None)  # triton_quant.ROTATION names the cast
    monkeypatch.setattr(tq, "ROTATION", "dense")
    dense, _ = _run(q, k, v, cq.tolist(), ck.tolist(), plan=plan)
    monkeypatch.setattr(tq, "ROTATION", "gluon")
    monkeypatch.setattr(th, "HEAD_ROTATION", "gluon")
    assert rel_err(out, dense) < 0.02
    # replay on new values (a missing cast would leave the first call's q8/k8)
    q2, k2, v2, _, _ = random_batch(lens_q, lens_k, heads, device="cuda", seed=92)
    for _ in range(2):
        out2, _ = _run(q2, k2, v2, cq.tolist(), ck.tolist(), plan=plan)
    ref2, _ = reference_on_device(q2, k2, v2, cq, ck)
    assert rel_err(out2, ref2) <= FP8_TOL
    # a CUDA graph of the planned call, replayed on values copied into its inputs
    gout = torch.empty_like(out2)
    kw = dict(plan=plan, kernel="flash_attn", fp8=True, fp8_rotate=True, out=gout)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_plugins.mla_prefill(q2, k2, v2, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_plugins.mla_prefill(q2, k2, v2, **kw)
    q2.copy_(q)
    k2.copy_(k)
    v2.copy_(v)
    gout.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(gout, ref) <= errs[True] + 1e-3
