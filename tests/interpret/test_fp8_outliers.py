"""fp8_outliers (core/fp8.py, issue 22): the fp8 rounding of each (sequence, head)'s outlier
features of q and k corrected by fp8 hi/lo side tiles and one more fp8 product.

The rule, the torch kernel and the float64 reference run anywhere; the Triton ones
(the quantization's maxima, the selection and side tiles' launch, the portable attention
kernel's side product) through the interpreter (TRITON_INTERPRET=1), which stores the fp8
path's scaled values in fp16 (see test_fp8_blocks.py): there the selection and the side
tiles are checked bit for bit against the rule, the fp8 rounding on the GPU (tests/gpu).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import mla_plugins
from mla_plugins.core import fp8
from mla_plugins.core.kernels.base import Kernel
from mla_plugins.core.reference import reference_attention, relative_error
from tests.core.helpers import cu_seqlens, poisoned, random_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from accuracy import recipe  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="runs the Triton interpreter: set TRITON_INTERPRET=1")
FP8 = torch.float8_e4m3fn
LENS_Q, LENS_K = [70, 0, 130, 90], [150, 40, 200, 90]


def _outlier_batch(dtype, *, scale=20.0, seed=0):
    """A batch whose sequences carry different outlier features (per sequence and head)."""
    heads = 3
    q, k, v, cq, ck = random_batch(LENS_Q, LENS_K, heads, dtype=dtype, seed=seed)
    cqh, ckh = cq.tolist(), ck.tolist()
    for b in range(len(LENS_Q)):
        for h in range(heads):
            for f in (7 + 11 * b + h, 130 + 5 * b, 190 - h):
                q[cqh[b]:cqh[b + 1], h, f] *= scale
                k[ckh[b]:ckh[b + 1], h, f] *= scale
    return q, k, v, cq, ck


def test_selection_takes_the_outlier_features():
    q, k, _, cq, ck = _outlier_batch(torch.bfloat16)
    sel = fp8.outlier_features(q, k, cq.tolist(), ck.tolist())
    assert sel.shape == (len(LENS_Q), 3, fp8.OUTLIER_FEATURES)
    for b in (0, 2, 3):
        for h in range(3):
            got = set(sel[b, h].tolist())
            assert {7 + 11 * b + h, 130 + 5 * b, 190 - h} <= got, (b, h, got)
            assert sel[b, h].tolist() == sorted(got)
    # sequence 1 has keys but no query rows: every score is 0, ties go to the lower features
    assert sel[1].tolist() == [list(range(8))] * 3


def test_selection_edge_values():
    """NaN scores count as +inf (taken first), inf * 0 too; ties to the lower feature."""
    q = torch.ones(4, 1, 192, dtype=torch.bfloat16)
    k = torch.ones(4, 1, 192, dtype=torch.bfloat16)
    q[1, 0, 50] = float("nan")
    q[2, 0, 60] = float("inf")
    k[:, 0, 60] = 0.0  # inf * 0 = NaN -> +inf
    k[3, 0, 170] = 2.0
    sel = fp8.outlier_features(q, k, [0, 4], [0, 4])
    assert sel[0, 0].tolist() == [0, 1, 2, 3, 4, 50, 60, 170]


def test_split_rule_isolates_sequences():
    """A sequence's selection, fp8 values, scales and side tiles are those of it run alone,
    next to a sequence holding inf, NaN and 1e30 (in an outlier feature and elsewhere)."""
    q, k, v, cq, ck = _outlier_batch(torch.bfloat16)
    cqh, ckh = cq.tolist(), ck.tolist()
    q[cqh[2] + 5, 0, 3] = float("inf")
    k[ckh[2] + 9, 1, 130 + 10] = float("nan")
    k[ckh[2] + 20, 2, 33] = 1e30
    feats = fp8.outlier_features(q, k, cqh, ckh)
    for x, cu, block, op in ((q, cqh, fp8.Q_BLOCK, "q"), (k, ckh, fp8.KV_BLOCK, "k")):
        x8, scale, side = fp8.split_quantize(x, cu, feats, FP8, block=block, operand=op)
        assert torch.isfinite(side.float()).all() and torch.isfinite(x8.float()).all()
        for b in (0, 3):
            rows = slice(cu[b], cu[b + 1])
            one = [0, cu[b + 1] - cu[b]]
            f1 = fp8.outlier_features(q[cqh[b]:cqh[b + 1]], k[ckh[b]:ckh[b + 1]],
                                      [0, cqh[b + 1] - cqh[b]], [0, ckh[b + 1] - ckh[b]])
            assert torch.equal(f1[0], feats[b])
            a8, a_s, a_side = fp8.split_quantize(x[rows], one, f1, FP8, block=block, operand=op)
            assert torch.equal(x8[rows].view(torch.uint8), a8.view(torch.uint8))
            assert torch.equal(scale[rows], a_s)
            assert torch.equal(side[rows].view(torch.uint8), a_side.view(torch.uint8))


def test_side_tiles_hold_hi_and_lo():
    """side_cast: h = fp8(u) (the fp8 byte itself), l = fp8(u - h), q [h, l, l, 0], k [l, h,
    l, 0], so that the fp8 product's qh kh plus the side product is (qh + ql)(kh + kl)
    exactly, each factor within ~2^-8 of u instead of e4m3's 2^-4."""
    u = torch.tensor([[[1.0 + 2**-6, -(3.0 + 2**-5), 448.0, 300.0, 0.0, -17.3, 0.37, 100.0]]])
    qs, ks = fp8.side_cast(u, "q", FP8), fp8.side_cast(u, "k", FP8)
    assert qs.dtype == ks.dtype == FP8 and qs.shape == (1, 1, 32)
    h, lo = u.to(FP8), (u - u.to(FP8).float()).to(FP8)
    for side, groups in ((qs, (h, lo, lo)), (ks, (lo, h, lo))):
        for g, want in enumerate(groups):
            assert torch.equal(side[..., 8 * g:8 * g + 8].view(torch.uint8), want.view(torch.uint8))
        assert (side[..., 24:].float() == 0).all()
    assert torch.equal(qs[..., :8].view(torch.uint8), u.to(FP8).view(torch.uint8))
    y = torch.randn(1, 1, 8) * 100
    yq, yk = fp8.side_cast(y, "q", FP8).double(), fp8.side_cast(y, "k", FP8).double()
    hq = y.to(FP8).double()
    got = (yq * yk).sum(-1) + (hq * hq).sum(-1)
    two = yq[..., :8] + yq[..., 8:16]  # h + l
    assert torch.allclose(got, (two * two).sum(-1), rtol=1e-12, atol=0)
    assert ((two - y.double()).abs() <= 2**-7 * y.double().abs() + 2**-9).all()
    assert ((hq - y.double()).abs() > 2**-7 * y.double().abs()).any()  # what l corrects


@pytest.mark.parametrize("value,bound", [(1, 0.05), (10, 0.06), (30, 0.10)])
def test_torch_kernel_meets_issue_22_on_the_cpu(value, bound):
    """Issue 22's CPU goals (torch kernel, 384 tokens, 4 heads, features 7 and 128-131 of q
    and k scaled): within the bound with fp8_outliers, and well under the rotation at x30
    (measured 0.027-0.028 against 0.104-0.106; benchmarks/NOTES.md)."""
    q, k, v, cu = recipe("outliers", value, "cpu", seed=7, shape=(384, 4))
    ref, ref_lse = reference_attention(q, k, v, cu, cu)
    out, lse = mla_plugins.mla_prefill(q, k, v, cu, cu, fp8=True, kernel="torch",
                                       fp8_outliers=True, return_lse=True)
    err = relative_error(out, ref)
    assert err < bound, err
    # the lse as close as the block rule's own (1.3e-3 at x1, smaller with outliers)
    plain, plain_lse = mla_plugins.mla_prefill(q, k, v, cu, cu, fp8=True, kernel="torch",
                                               return_lse=True)
    assert relative_error(lse, ref_lse) < max(1.5 * relative_error(plain_lse, ref_lse), 1e-3)
    if value == 30:
        rotated = mla_plugins.mla_prefill(q, k, v, cu, cu, fp8=True, kernel="torch", fp8_rotate=True)
        assert err < 0.5 * relative_error(rotated, ref)


def test_torch_kernel_matches_the_reference():
    q, k, v, cq, ck = _outlier_batch(torch.bfloat16)
    out = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch", fp8_outliers=True)
    ref8, _ = reference_attention(q, k, v, cq, ck, fp8_dtype=FP8, fp8_outliers=True)
    plain8, _ = reference_attention(q, k, v, cq, ck, fp8_dtype=FP8)
    ref, _ = reference_attention(q, k, v, cq, ck)
    assert relative_error(out, ref8) < 1e-2
    assert relative_error(out, ref) < 0.5 * relative_error(plain8, ref)


def test_not_with_the_rotation(monkeypatch):
    """The corrections are per feature, which the rotation mixes: both asked raises, naming
    the argument; MLA_PLUGINS_FP8_ROTATE (fp8_rotate=None) gives way to fp8_outliers."""
    q, k, v, cq, ck = _outlier_batch(torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_rotate: found True with fp8_outliers"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch", fp8_outliers=True,
                                fp8_rotate=True)
    monkeypatch.setenv("MLA_PLUGINS_FP8_ROTATE", "1")
    got = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch", fp8_outliers=True)
    monkeypatch.delenv("MLA_PLUGINS_FP8_ROTATE")
    assert torch.equal(got, mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch",
                                                    fp8_outliers=True))
    with pytest.raises(ValueError, match="rotate_: found True with outliers"):
        fp8.block_fake_quantize_qkv(q, k, v, cq.tolist(), ck.tolist(), FP8, rotate_=True,
                                    outliers=True)


def test_arguments_are_checked(monkeypatch):
    q, k, v, cq, ck = random_batch([5], [5], 1)
    with pytest.raises(TypeError, match="fp8_outliers: found int"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, kernel="torch", fp8_outliers=1)
    q8, k8, _, _, _ = random_batch([5], [5], 1, dqk=8)
    with pytest.raises(ValueError, match="fp8_outliers: found True with query/key head dim 8"):
        mla_plugins.mla_prefill(q8, k8, v, cq, ck, kernel="torch", fp8_outliers=True)
    # fp8=False: nothing to keep out, no error
    mla_plugins.mla_prefill(q, k, v, cq, ck, kernel="torch", fp8=False, fp8_outliers=True)
    # MLA_PLUGINS_FP8_OUTLIERS turns it on for calls that leave it None
    monkeypatch.setenv("MLA_PLUGINS_FP8_OUTLIERS", "1")
    q, k, v, cq, ck = _outlier_batch(torch.bfloat16)
    on = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch")
    monkeypatch.delenv("MLA_PLUGINS_FP8_OUTLIERS")
    assert torch.equal(on, mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch",
                                                   fp8_outliers=True))


def test_a_kernel_without_it_says_so():
    class Plain(Kernel):
        name = "plain"
        devices = frozenset({"cpu"})

    q, k, v, cq, ck = random_batch([5], [5], 1)
    from mla_plugins.core.api import _prefill_inputs

    inputs = _prefill_inputs(q, k, v, cq, ck, None, True, True, None, fp8_outliers=True)
    assert inputs.fp8_outliers
    assert any("fp8_outliers=True not supported" in r for r in Plain().not_supported_reasons(inputs))
    plain = _prefill_inputs(q, k, v, cq, ck, None, True, True, None)
    assert not Plain().not_supported_reasons(plain)


def test_a_plan_of_another_kernel_is_refused(monkeypatch):
    """A plan whose kernel cannot keep the outliers out refuses the call by name rather than
    run without them (kernel="auto" takes the plan's kernel without a new selection)."""
    from mla_plugins.core.kernels.torch_kernel import TorchKernel

    q, k, v, cq, ck = random_batch([64], [64], 1)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=1, kernel="torch")
    monkeypatch.setattr(TorchKernel, "supports_fp8_outliers", False)
    with pytest.raises(ValueError, match="fp8_outliers: found True, but the plan's kernel 'torch'"):
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=True, fp8_outliers=True)
    # and a pinned kernel without it lists the reason among its rejections
    with pytest.raises(ValueError, match="fp8_outliers=True not supported"):
        mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch", fp8_outliers=True)


def test_plans_follow_the_setting(monkeypatch):
    """plan_prefill selects for calls with fp8_outliers (argument or MLA_PLUGINS_FP8_OUTLIERS):
    a framework that sets the variable gets plans of a kernel that runs its calls (on
    Hopper kernel="auto" would otherwise plan for FA3, which refuses them)."""
    from mla_plugins.core.kernels.torch_kernel import TorchKernel

    q, k, v, cq, ck = random_batch([64], [64], 1)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=1, fp8=True, fp8_outliers=True)
    mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=True, fp8_outliers=True)
    monkeypatch.setattr(TorchKernel, "supports_fp8_outliers", False)
    for env in (None, "1"):
        if env:
            monkeypatch.setenv("MLA_PLUGINS_FP8_OUTLIERS", env)
        with pytest.raises(ValueError, match="fp8_outliers=True not supported"):
            mla_plugins.plan_prefill(cq, ck, num_heads=1, fp8=True,
                                     fp8_outliers=None if env else True)
    # bf16 plans are not concerned
    mla_plugins.plan_prefill(cq, ck, num_heads=1, fp8=False)
    with pytest.raises(TypeError, match="fp8_outliers: found str"):
        mla_plugins.plan_prefill(cq, ck, num_heads=1, fp8_outliers="yes")


# -- the Triton kernels, through the interpreter ---------------------------------------------


def _triton_quantize(q, k, v, cq, ck, rows=None, maxima=None):
    """triton_quant.quantize_qkv_outliers (fp16 storage, the interpreter's stand-in for fp8),
    its side tiles poisoned first: (q8, q scales, k8, scales, sel, q_side, k_side)."""
    from mla_plugins.core.kernels import triton_quant as tq

    batch, mq, mk = len(cq) - 1, max(cq.diff().tolist()), max(ck.diff().tolist())
    bufs = tq.outlier_buffers(q, k, batch, torch.float16, (int(cq[-1]), int(ck[-1])))
    for side in bufs[2:]:
        side.fill_(7.0)  # poison: write_outlier_sides writes every row of every sequence
    (q8, qs, k8, _, scales), sel, (q_side, k_side) = tq.quantize_qkv_outliers(
        q, k, v, cq, ck, batch, mq, mk, torch.float16, 448.0, buffers=bufs, maxima=maxima,
        rows=rows)
    return q8, qs, k8, scales, sel, q_side, k_side


@needs_interp
@pytest.mark.parametrize("rows,maxima", [(None, None), (64, "held"), (None, "reload")],
                         ids=["default", "rows64-held", "reload"])
def test_triton_selection_follows_the_rule(rows, maxima):
    """The maxima quantize_qkv publishes (either way) and the selection of
    write_outlier_sides give the rule's features, whatever rows a side program covers
    (triton_quant's knobs); NaN, inf and inf * 0 as the rule counts them."""
    q, k, v, cq, ck = _outlier_batch(torch.float16)
    cqh, ckh = cq.tolist(), ck.tolist()
    q[cqh[2] + 3, 1, 40] = float("nan")
    k[ckh[3] + 1, 0, 41] = float("inf")
    k[ckh[0]:ckh[1], 2, 99] = 0.0
    q[cqh[0] + 2, 2, 99] = float("inf")  # inf * 0: NaN, +inf
    want = fp8.outlier_features(q, k, cqh, ckh)
    sel = _triton_quantize(q, k, v, cq, ck, rows, maxima)[4]
    assert torch.equal(sel.long(), want)
    from mla_plugins.core.kernels import triton_quant as tq

    with pytest.raises(ValueError, match="maxima: found 'both'"):
        tq.quantize_qkv(q, k, v, cq, ck, 4, 1, 1, torch.float16, 448.0,
                        outliers=torch.zeros(4, 3, 2, 192, dtype=torch.int32), maxima="both")

    with pytest.raises(ValueError, match="rows: found 96"):
        tq.write_outlier_sides(q, k, None, None, (None,) * 4, cq, ck, 4, 1, 1, 448.0, rows=96)


@needs_interp
def test_triton_quantization_follows_the_rule():
    """q8 and k8 (fp16 storage: the values before the fp8 rounding) and their scales as
    without the outliers, and the side tiles bit for bit (side_cast of the same values)."""
    q, k, v, cq, ck = _outlier_batch(torch.float16)
    cqh, ckh = cq.tolist(), ck.tolist()
    k[ckh[2] + 7, 0, 130 + 10] = float("nan")
    q8, qs, k8, _, _, q_side, k_side = _triton_quantize(q, k, v, cq, ck)
    from tests.interpret.test_quant_rotation import assert_scales, assert_within_a_step

    feats = fp8.outlier_features(q, k, cqh, ckh)
    for x, x8, cu, block, side, op in ((q, q8, cqh, fp8.Q_BLOCK, q_side, "q"),
                                       (k, k8, ckh, fp8.KV_BLOCK, k_side, "k")):
        scale = fp8.block_scales(x, cu, FP8, block=block)
        u = fp8.block_cast(x, scale, 448.0)
        want_side = fp8.side_cast(torch.gather(u, 2, fp8._row_selection(feats, cu, x.shape[0])),
                                  op, torch.float16)
        assert side.dtype == torch.float16  # the interpreter's stand-in for fp8
        assert torch.equal(side, want_side)
        assert_within_a_step(x8, u.half(), False)
        if x is q:
            assert_scales(qs, scale, False)
    assert torch.isfinite(q_side).all() and torch.isfinite(k_side).all()


def _triton_run(q, k, v, cq, ck, kernel, outliers=True):
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=q.shape[1], tile_q=64, kv_granularity=128,
                                    num_workers=3)
    out = poisoned((q.shape[0], q.shape[1], 128), q.dtype)
    _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, out=out, return_lse=True,
                                     plan=plan, kernel=kernel, fp8_outliers=outliers)
    return out, lse


@needs_interp
def test_triton_kernel_adds_the_side_product(monkeypatch):
    """The portable kernel adds q_side k_side^T into the scores, in the fp8 product's units,
    over several workers (partial rows and the reduce): side tiles of random values (in
    place of write_outlier_sides'), fp16 storage in place of fp8; against float64 over
    [q | q_side * scale] and [k | k_side * scale] (0.5-1.5 units of logit each: without the
    side product the error is ~0.3)."""
    from mla_plugins.core.kernels import triton_kernel
    from mla_plugins.core.kernels import triton_quant as tq

    monkeypatch.setattr(triton_kernel, "_FP8_STORAGE", torch.float16)
    q, k, v, cq, ck = _outlier_batch(torch.float16, scale=4.0)
    gen = torch.Generator().manual_seed(3)
    sides = [torch.randn(x.shape[0], x.shape[1], fp8.OUTLIER_WIDTH, generator=gen).mul_(40).half()
             for x in (q, k)]
    monkeypatch.setattr(tq, "write_outlier_sides", lambda *a, **kw: tuple(sides))
    wide = []
    for x, side, cu, block in ((q, sides[0], cq, fp8.Q_BLOCK), (k, sides[1], ck, fp8.KV_BLOCK)):
        scale = fp8.block_scales(x, cu.tolist(), FP8, block=block)
        wide.append(torch.cat([x.double(), side.double() * scale[..., None].double()], -1))
    ref, ref_lse = reference_attention(*wide, v, cq, ck, softmax_scale=192 ** -0.5)
    plain, _ = reference_attention(q, k, v, cq, ck)
    out, lse = _triton_run(q, k, v, cq, ck, "triton")
    err = relative_error(out, ref)
    assert torch.isfinite(out).all()
    assert err < 1.5e-2, err
    assert relative_error(plain, ref) > 10 * err
    seen = torch.isfinite(ref_lse)
    assert relative_error(lse[seen], ref_lse[seen]) < 1e-3


@needs_interp
def test_triton_kernel_isolates_sequences(monkeypatch):
    from mla_plugins.core.kernels import triton_kernel

    monkeypatch.setattr(triton_kernel, "_FP8_STORAGE", torch.float16)
    q, k, v, cq, ck = _outlier_batch(torch.float16)
    cqh, ckh = cq.tolist(), ck.tolist()
    q[cqh[2] + 5, 0, 3] = float("inf")
    k[ckh[2] + 9, 1, 130 + 10] = float("nan")
    v[ckh[2] + 130, 2, 7] = 1e30
    out, lse = _triton_run(q, k, v, cq, ck, "triton")
    for b in (0, 3):
        qs, ks = slice(cqh[b], cqh[b + 1]), slice(ckh[b], ckh[b + 1])
        alone, alone_lse = _triton_run(q[qs], k[ks], v[ks], cu_seqlens([LENS_Q[b]]),
                                       cu_seqlens([LENS_K[b]]), "triton")
        assert torch.equal(out[qs], alone), b
        assert torch.equal(lse[qs], alone_lse), b
