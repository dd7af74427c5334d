"""The Triton kernels on the GPU against float64, through the public API and directly.

Every output buffer is poisoned with NaN before the call; inputs are fresh random draws.
"""

from __future__ import annotations

import pytest
import torch

import mla_plugins
from mla_plugins.core.reduce import torch_reduce
from tests.core.helpers import (
    BF16_TOL,
    FP8_TOL,
    LENGTH_CASES,
    check_attention,
    cu_seqlens,
    poisoned,
    random_batch,
)
from tests.gpu.conftest import make_inputs, reference_on_device, rel_err, scale_outliers

pytestmark = [pytest.mark.gpu, pytest.mark.triton]  # skips come from tests/conftest.py

CASES = LENGTH_CASES


@pytest.fixture(autouse=True, params=[
    "portable", "gluon", "gluon-longest-first", "gluon-persistent", "gluon-q-loads",
    "gluon-rescale-off", "gluon-sum-vector", "gluon-split-kv", "gluon-bf16-n64",
    "gluon-lean-sync",
])
def phase1(request, monkeypatch, device):
    """Every test through each phase-1 kernel: the portable Triton kernel, and (Hopper) the
    Gluon kernel, fp8 and 16-bit, for every batch (its length thresholds at 0, so short test
    batches reach it too), one CTA per unit in plan order (its default for several sequences
    too) and with each head's slices taken last to first, persistent for batches of several
    sequences (in both forms with the persistent form's numerics: fp8's vector row sums, stop
    42, 16-bit's 64-key steps and early rescale, stop 44; a sequence alone takes one CTA, and
    the isolation tests compare bytes), with the q blocks loaded by the
    consumers (q_tma off; the producer's TMA by default), with the accumulator rescaled before
    the next block's q k^T is issued (rescale_late off; both defaults rescale after that
    issue, 16-bit's since stop 44), with fp8's row sums by the vector units (sum_mma off; the
    tensor cores by default, 16-bit ignores it), with k and v on barriers of their own the
    other way from each default (split_kv: 16-bit's default since stop 43, not fp8's), and
    16-bit in stop 28's 64-key steps over four stages, pingpong, one barrier a stage (the
    default since: 128-key steps over two, P carried packed, `gluon_attention._carry`), and
    with the PTX's warpgroup barriers before mbarrier arrives and waits removed the other way
    from each default (lean_sync, `gluon_sync`: 16-bit's default since stop 44, not fp8's)."""
    from collections import OrderedDict
    from dataclasses import replace

    from mla_plugins.core import api
    from mla_plugins.core.kernels import triton_kernel as tk

    # a plan remembers the phase-1 configuration it first ran with (triton_kernel._plan_config):
    # each test starts from no remembered plan, so one made under another param's settings
    # (the same lengths in an earlier test) cannot run in place of this param's kernel
    monkeypatch.setattr(api, "_cache", OrderedDict())
    if request.param.startswith("gluon"):
        reasons = tk.gluon_reasons(torch.device(device))
        if reasons:
            pytest.skip("; ".join(reasons))
        persistent = 0 if request.param == "gluon-persistent" else float("inf")
        for prefix in ("GLUON_", "GLUON_BF16_"):
            monkeypatch.setattr(tk, prefix + "MIN_MEAN_KEYS", 0)
            monkeypatch.setattr(tk, prefix + "PERSISTENT_MIN_MEAN_KEYS", persistent)
        knob = {"gluon-longest-first": {"longest_first": True},
                "gluon-persistent": {"sum_mma": tk.GLUON_FP8_PERSISTENT_CONFIG.sum_mma},
                "gluon-q-loads": {"q_tma": False},
                "gluon-rescale-off": {"rescale_late": False},
                "gluon-sum-vector": {"sum_mma": False}}.get(request.param)
        for name in ("GLUON_FP8_CONFIG", "GLUON_BF16_CONFIG"):
            config = getattr(tk, name)
            if request.param == "gluon-split-kv":  # each mode the other way from its default
                knob = {"split_kv": not config.split_kv}
            if request.param == "gluon-lean-sync":  # likewise
                knob = {"lean_sync": not config.lean_sync}
            if knob:
                monkeypatch.setattr(tk, name, replace(config, **knob))
        if request.param == "gluon-persistent":
            # a sequence alone runs one CTA per unit, so the 16-bit default takes the persistent
            # form's steps and rescale (the isolation tests compare bytes; stop 44's default,
            # 128-key steps with the late rescale, rounds differently from its 64-key steps)
            monkeypatch.setattr(tk, "GLUON_BF16_CONFIG", replace(
                tk.GLUON_BF16_PERSISTENT_CONFIG, persistent=False))
        if request.param == "gluon-bf16-n64":
            monkeypatch.setattr(tk, "GLUON_BF16_CONFIG", replace(
                tk.GLUON_BF16_CONFIG, block_n=64, num_stages=4, pingpong=True, split_kv=False,
                rescale_late=False, lean_sync=False))
    else:
        for prefix in ("GLUON_", "GLUON_BF16_"):
            for name in ("MIN_MEAN_KEYS", "PERSISTENT_MIN_MEAN_KEYS"):
                monkeypatch.setattr(tk, prefix + name, float("inf"))
    return request.param


def check(out, lse, ref_out, ref_lse, tol):
    return check_attention(out, lse, ref_out, ref_lse, tol, error=rel_err)


def run_triton(q, k, v, cq, ck, *, causal, fp8, plan=None, scale=None):
    out = poisoned((q.shape[0], q.shape[1], v.shape[2]), q.dtype, q.device)
    result, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=causal, fp8=fp8, out=out,
                                          return_lse=True, plan=plan, kernel="triton",
                                          softmax_scale=scale)
    assert result is out
    return out, lse


@pytest.mark.parametrize("split", [False, True], ids=["own-plan", "split-plan"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matches_float64(case, heads, causal, fp8, split, device):
    lens_q, lens_k = CASES[case]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, device=device)
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, causal=causal)
    plan = None
    if split:
        # tile_q 256 (two programs per tile), many workers: tiles cut into pieces, then reduced
        plan = mla_plugins.plan_prefill(cq, ck, kernel="triton", num_heads=heads, causal=causal, tile_q=256,
                                        kv_granularity=128, num_workers=heads * 7)
    out, lse = run_triton(q, k, v, cq, ck, causal=causal, fp8=fp8, plan=plan)
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "lens_q,lens_k,heads",
    [([8192], [8192], 128), ([1000, 8300], [3000, 8300], 16), ([16384], [16384], 16)],
    ids=["8k-h128", "varlen-8k-h16", "16k-h16"],
)
def test_long_sequences(lens_q, lens_k, heads, fp8, device):
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, device=device)
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, causal=True, heads_per_step=2)
    out, lse = run_triton(q, k, v, cq, ck, causal=True, fp8=fp8)
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_split_long_prefix(fp8, device):
    """A short query over a long cached prefix: the kernel's own plan splits it (few programs)."""
    q, k, v, cq, ck = random_batch([300], [20000], 2, device=device)
    kernel = mla_plugins.core.registry.get_registry().get("triton")
    inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=fp8)
    params = kernel.plan_params(inputs)
    assert params["num_workers"] > 1, params
    plan = mla_plugins.plan_prefill(cq, ck, kernel="triton", num_heads=2, causal=True, **params)
    assert plan.num_partial_tiles > 0
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, causal=True)
    out, lse = run_triton(q, k, v, cq, ck, causal=True, fp8=fp8)
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("layout", ["kv-320", "vllm"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_strided_views(fp8, layout, device):
    """k and v as views, heads further apart than their width: `kv-320`, both halves of one
    [T, H, 320] output; `vllm`, vLLM's prefill (k a packed cat, v the [..., 128:] half of
    kv_b_proj's [T, H, 256]). Both are read through TMA on sm_90 in bf16 too."""
    from mla_plugins.core.kernels import triton_kernel as tk

    heads = 8
    gen = torch.Generator().manual_seed(11)
    qbig = torch.randn(500, heads, 256, generator=gen).to(device, torch.bfloat16)
    q = qbig[..., :192]
    if layout == "kv-320":
        kv = torch.randn(700, heads, 320, generator=gen).to(device, torch.bfloat16)
        k, v = kv[..., :192], kv[..., 192:]
    else:
        kv = torch.randn(700, heads, 256, generator=gen).to(device, torch.bfloat16)
        k = torch.cat((kv[..., :128], torch.randn(700, heads, 64, generator=gen).to(device, torch.bfloat16)), -1)
        v = kv[..., 128:]
    assert tk._tma_ok(k, 192) and tk._tma_ok(v, 128)
    cq, ck = cu_seqlens([200, 300], device), cu_seqlens([300, 400], device)
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, causal=True)
    out, lse = run_triton(q, k, v, cq, ck, causal=True, fp8=fp8)
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_large_magnitude_no_nan(fp8, device):
    q, k, v, cq, ck = random_batch([300, 40], [300, 90], 4, scale=1e3, device=device)
    scale = 192**-0.5 / 1e6
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, softmax_scale=scale)
    out, lse = run_triton(q, k, v, cq, ck, causal=True, fp8=fp8, scale=scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantization_matches_core_rule(dtype, parts, device):
    """The one-pass block quantization gives exactly core/fp8.py's fp8 values and scales,
    v transposed into its 16-aligned per-sequence columns."""
    from mla_plugins.core.fp8 import KV_BLOCK, block_quantize
    from mla_plugins.core.kernels import triton_quant as tq

    lens = [333, 0, 64, 517]
    _, k, v, _, ck = random_batch(lens, lens, 5, dtype=dtype, scale=3.0, device=device)
    k[400, 2, 7] = float("nan")
    fp8 = torch.float8_e4m3fn
    cu = ck.tolist()
    v[70, 1, 3] = float("inf")
    k8, vt8, scales = tq.quantize_kv(k, v, ck, len(lens), max(lens), fp8, parts=parts)
    rk, sk = block_quantize(k.cpu(), cu, fp8, block=KV_BLOCK)
    rv, sv = block_quantize(v.cpu(), cu, fp8, block=KV_BLOCK)
    assert torch.equal(k8.cpu().view(torch.uint8), rk.view(torch.uint8))
    vt, scales = vt8.cpu(), scales.cpu()
    for b in range(len(lens)):
        # token order within vt8's 16-groups: triton_quant.column_of_key on CUDA
        cols = tq.vt_column(cu[b], b, torch.arange(cu[b + 1] - cu[b]), tq.permuted_v(vt8.device))
        got = vt[:, cols].reshape(5, 128, -1).permute(2, 0, 1)
        assert torch.equal(got.contiguous().view(torch.uint8), rv[cu[b]:cu[b + 1]].view(torch.uint8))
        for t in range(cu[b], cu[b + 1], KV_BLOCK):
            c = tq.vt_column(cu[b], b, t - cu[b], False) // 16  # a block's first column
            assert torch.equal(scales[1, :, c], sv[t]) and torch.equal(scales[0, :, c].isnan(), sk[t].isnan())


def test_quantization_all_zero_scale_one(device):
    from mla_plugins.core.kernels import triton_quant as tq

    k = torch.zeros(40, 2, 192, dtype=torch.bfloat16, device=device)
    v = torch.zeros(40, 2, 128, dtype=torch.bfloat16, device=device)
    ck = cu_seqlens([40], device)
    k8, vt8, scales = tq.quantize_kv(k, v, ck, 1, 40, torch.float8_e4m3fn)
    assert (scales[:, :, 0] == 1).all()
    assert (k8.float() == 0).all() and (vt8[:, :40].float() == 0).all()


#: a rotated row's float32 sum of 192 products may be off by 192 ulps of the sum of their
#: magnitudes (at most the fp8 maximum once scaled)
SUM_ERROR = 192 * 2.0**-24 * 448.0


def assert_fp8_close(got, want, rotated):
    """fp8 values: bit for bit (unrotated), or one e4m3 step apart (or the float32 sum's
    error) where the tensor cores' float32 sums and the rule's float64 ones round on either
    side of a midpoint (rotated), rarely."""
    if not rotated:
        assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8))
        return
    g, w = got.cpu().float(), want.cpu().float()
    mag = w.abs().clamp_min(2.0**-6)  # e4m3's smallest normal; subnormal steps are 2^-9
    step = 2.0 ** (torch.floor(torch.log2(mag)) - 3)
    diff = (g - w).abs()
    assert (diff <= torch.maximum(step, torch.full_like(step, SUM_ERROR))).all()
    assert (diff > 0).float().mean() < 1e-2


def assert_scales_close(got, want, rotated):
    got, want = got.cpu(), want.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    ok = torch.isfinite(want)
    if rotated:  # float32 row sums in another order
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-6, atol=0)
    else:
        assert torch.equal(got[ok], want[ok])


#: each quantization as (rotate, rotation): the amax rule, the rotation's two implementations
QUANT_MODES = {"amax": (False, "dense"), "rotated": (True, "dense"), "kron": (True, "kron")}


@pytest.mark.parametrize("mode", list(QUANT_MODES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qkv_quantization_matches_core_rule(dtype, mode, phase1, device):
    """quantize_qkv: q8 and the q scales at every row, k8 and k's scales (rotated or not),
    v's transposed copy, against core/fp8.py's block_quantize; q a strided view, v vLLM's."""
    from mla_plugins.core.fp8 import KV_BLOCK, Q_BLOCK, block_quantize
    from mla_plugins.core.kernels import triton_quant as tq

    if phase1 != "portable":
        pytest.skip("no attention: one run")
    rotate, rotation = QUANT_MODES[mode]
    lens_q, lens_k = [333, 0, 64, 517, 1], [400, 0, 64, 517, 129]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 5, dtype=dtype, scale=3.0, device=device)
    q = torch.cat((q, q[..., :64]), dim=-1)[..., :192]
    v = torch.cat((torch.randn_like(v), v), dim=-1)[..., 128:]
    q[10, 2, 7] = float("nan")
    k[500, 1, 3] = float("inf")
    fp8 = torch.float8_e4m3fn
    q8, qs, k8, vt8, scales = tq.quantize_qkv(q, k, v, cq, ck, 5, 517, 517, fp8, rotate=rotate,
                                              rotation=rotation)
    cuq, cuk = cq.tolist(), ck.tolist()
    rq, sq = block_quantize(q.cpu(), cuq, fp8, block=Q_BLOCK, rotate_=rotate)
    rk, sk = block_quantize(k.cpu(), cuk, fp8, block=KV_BLOCK, rotate_=rotate)
    rv, sv = block_quantize(v.cpu(), cuk, fp8, block=KV_BLOCK)
    assert_fp8_close(q8, rq, rotate)
    assert_scales_close(qs, sq, rotate)
    assert_fp8_close(k8, rk, rotate)
    vt, scales = vt8.cpu(), scales.cpu()
    for b in range(len(lens_k)):
        cols = tq.vt_column(cuk[b], b, torch.arange(cuk[b + 1] - cuk[b]), tq.permuted_v(vt8.device))
        got = vt[:, cols].reshape(5, 128, -1).permute(2, 0, 1).contiguous()
        assert torch.equal(got.view(torch.uint8), rv[cuk[b]:cuk[b + 1]].view(torch.uint8))
        for t in range(cuk[b], cuk[b + 1], KV_BLOCK):
            c = tq.vt_column(cuk[b], b, t - cuk[b], False) // 16
            assert_scales_close(scales[0, :, c], sk[t], rotate)
            assert torch.equal(scales[1, :, c], sv[t])


@pytest.mark.parametrize("mode", list(QUANT_MODES))
@pytest.mark.parametrize("splits", [1, 7, 32])
def test_head_quantization_matches_head_quantize(splits, mode, phase1, device):
    """triton_heads.quantize_heads (the FA3 provider's rule) against fp8.head_quantize on
    CUDA: fp8 values in FA3's natural layouts, descales [3, B, H]; v a strided view."""
    from mla_plugins.core.fp8 import head_quantize
    from mla_plugins.core.kernels import triton_heads as th

    if phase1 != "portable":
        pytest.skip("no attention: one run")
    rotate, rotation = QUANT_MODES[mode]
    lens_q, lens_k = [333, 0, 64, 2000, 1], [400, 0, 64, 2000, 129]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 6, scale=3.0, device=device)
    v = torch.cat((torch.randn_like(v), v), dim=-1)[..., 128:]
    k[700, 4, 3] = float("nan")
    fp8 = torch.float8_e4m3fn
    q8, k8, v8, descales, _ = th.quantize_heads(q, k, v, cq, ck, 5, 2000, 2000, splits, fp8,
                                                rotate=rotate, rotation=rotation)
    for x, got, d, cu, rot in ((q, q8, descales[0], cq, rotate), (k, k8, descales[1], ck, rotate),
                               (v, v8, descales[2], ck, False)):
        want, want_s = head_quantize(x.cpu(), cu.tolist(), fp8, rotate_=rot)
        assert_fp8_close(got, want, rot)
        assert_scales_close(d, want_s, rot)
    assert (descales[:, 1] == 1).all()


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_head_cast_writes_the_same_bytes(stages, rotate, phase1, device):
    """quantize_heads' `stages` (the pipelined q and k blocks loop, compiled for this GPU)
    against the blocks one after another: every byte of every output the same, outputs
    poisoned first, blocks past a sequence's end (8 blocks a program) all masked."""
    from mla_plugins.core.kernels import triton_heads as th

    if phase1 != "portable":
        pytest.skip("no attention: one run")
    lens = [333, 0, 64, 2000, 1]
    q, k, v, cq, ck = random_batch(lens, lens, 6, scale=3.0, device=device)
    k[700, 4, 3] = float("nan")
    fp8 = torch.float8_e4m3fn
    got = []
    for n in (1, stages):
        out = tuple(poisoned(shape, dtype, device) for _, shape, dtype in
                    th.head_workspace_layout(q.shape[0], k.shape[0], 5, 6, 7, fp8))
        got.append(th.quantize_heads(q, k, v, cq, ck, 5, 2000, 2000, 7, fp8, rotate=rotate,
                                     rotation="dense", blocks=8, stages=n, out=out))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("mode", list(QUANT_MODES))
def test_head_quantization_with_pdl_writes_the_same_bytes(mode, phase1, device, monkeypatch):
    """quantize_heads with pass 2 launched as pass 1's programmatic dependent (the default on
    Hopper, `triton_heads.head_pdl`), with pass 1's trigger early and left out
    (`PDL_EARLY`), against two ordinary launches: every byte of every output the same,
    outputs poisoned first, a NaN in one head; many rounds back to back, each on fresh
    inputs, so a pass 2 reading partials before pass 1 stored them would show."""
    from mla_plugins.core.kernels import triton_heads as th

    if phase1 != "portable":
        pytest.skip("no attention: one run")
    if not th.head_pdl(torch.device(device)):
        pytest.skip("PDL needs compute capability 9.0 or later")
    rotate, rotation = QUANT_MODES[mode]
    lens = [333, 0, 64, 2000, 1]
    fp8 = torch.float8_e4m3fn
    for round_ in range(4):
        q, k, v, cq, ck = random_batch(lens, lens, 6, scale=3.0, device=device)
        k[700, 4, 3] = float("nan")
        got = []
        for pdl, early in ((False, True), (True, True), (True, False)):
            monkeypatch.setattr(th, "PDL_EARLY", early)
            out = tuple(poisoned(shape, dtype, device) for _, shape, dtype in
                        th.head_workspace_layout(q.shape[0], k.shape[0], 5, 6, 7, fp8))
            got.append(th.quantize_heads(q, k, v, cq, ck, 5, 2000, 2000, 7, fp8, rotate=rotate,
                                         rotation=rotation, pdl=pdl, out=out))
        for other in got[1:]:
            for a, b in zip(got[0], other, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (mode, round_)


@pytest.mark.parametrize("rotate", [True, False])
def test_kv_blocks_quantization_writes_the_same_bytes(rotate, phase1, device):
    """quantize_qkv's `kv_blocks` (several key blocks per k/v program, the rotation's
    operands loaded once, compiled for this GPU) against one block per program: every byte
    of every output the same, outputs poisoned first, the last program's blocks past the
    sequence's end."""
    from mla_plugins.core.kernels import triton_quant as tq

    if phase1 != "portable":
        pytest.skip("no attention: one run")
    lens_q, lens_k = [333, 0, 64, 2000, 1], [400, 0, 64, 2000, 129]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 6, scale=3.0, device=device)
    k[700, 4, 3] = float("nan")
    fp8 = torch.float8_e4m3fn
    got = []
    for n in (1, 3):
        out = tuple(poisoned(shape, dtype, device) for _, shape, dtype in
                    tq.qkv_workspace_layout(q.shape[0], k.shape[0], 5, 6, fp8))
        got.append(tq.quantize_qkv(q, k, v, cq, ck, 5, 2000, 2000, fp8, out=out, rotate=rotate,
                                   rotation="dense", kv_blocks=n))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("case", list(CASES))
def test_rotated_fp8_matches_float64(case, device):
    """fp8 with the rotation (the default) against float64, and on inputs with outlier
    features closer to it than without the rotation (what the rotation is for)."""
    lens_q, lens_k = CASES[case]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 8, device=device)
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, causal=True)
    out = poisoned((q.shape[0], 8, 128), q.dtype, device)
    _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, fp8_rotate=True, out=out,
                                     return_lse=True, kernel="triton")
    check(out, lse, ref_out, ref_lse, FP8_TOL)
    scale_outliers(q, k)
    ref_out, _ = reference_on_device(q, k, v, cq, ck, causal=True)
    errs = {}
    for rotate in (False, True):
        out = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, fp8_rotate=rotate, kernel="triton")
        errs[rotate] = rel_err(out, ref_out)
    assert errs[True] < errs[False], errs


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_bf16_bad_values_stay_in_their_sequence(bad, device):
    """bf16 through TMA (sm_90): a key block of sequence 0's last rows reaches into sequence
    1's first keys; a non-finite v there must not make sequence 0 NaN (p = 0 times inf)."""
    lens_q, lens_k, heads = [300, 520, 200], [700, 520, 333], 4
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, device=device)
    bq, bk = cq.tolist(), ck.tolist()
    v[bk[1], :, 3] = bad
    k[bk[1] + 1, 1, 5] = bad
    v[bk[2] + 2, 2, 0] = bad
    out, lse = run_triton(q, k, v, cq, ck, causal=True, fp8=False)
    for b in (0, 1):
        qs, ks = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        alone, alone_lse = run_triton(q[qs], k[ks], v[ks], cu_seqlens([lens_q[b]], device),
                                      cu_seqlens([lens_k[b]], device), causal=True, fp8=False)
        assert torch.equal(out[qs].isnan(), alone.isnan()), b
        assert torch.equal(out[qs].nan_to_num(), alone.nan_to_num()), b
        assert torch.equal(lse[qs].nan_to_num(), alone_lse.nan_to_num()), b
    assert torch.isfinite(out[bq[0]:bq[1]].float()).all()


@pytest.mark.parametrize("mode", ["amax", "rotated", "outliers"])
@pytest.mark.parametrize("split", [False, True])
def test_fp8_bad_values_stay_in_their_sequence(split, mode, phase1, device):
    """inf, NaN and 1e30 in one sequence: every other sequence equals its result alone; under
    the block rule (`amax`), rotated, and with the outlier features corrected (fp8_outliers:
    the selection reads one sequence's maxima; under the portable and the default Gluon
    configuration)."""
    from mla_plugins.core.kernels import triton_kernel as tk

    if mode == "outliers" and phase1 not in ("portable", "gluon"):
        pytest.skip("fp8_outliers: checked under the portable and the default Gluon configuration")

    # the split batch's lse against the sequence alone: the vector row sums add P in float32
    # (1.4e-6 apart, stop 42); the tensor cores' (sum_mma) add P as e4m3 rounded against each
    # piece's running max, 7.7e-3 apart on an H100 (stop 42, benchmarks/diag_sum_mma.py split),
    # within the fp8 lse's own error against float64 there (2.4e-2): a leaked inf, NaN or 1e30
    # would be non-finite or off by far more
    sums_by_mma = phase1.startswith("gluon") and tk.GLUON_FP8_CONFIG.sum_mma
    lse_atol = 2e-2 if sums_by_mma else 1e-3
    lens_q, lens_k, heads = [300, 520, 200], [700, 520, 333], 4
    q, k, v, cq, ck = random_batch(lens_q, lens_k, heads, device=device)
    q0, k0 = lens_q[0], lens_k[0]
    q[q0 + 100, 1, 3] = float("inf")
    k[k0 + 10, 0, 100] = float("nan")
    v[k0 + 300, 2, 7] = 1e30
    workers = heads * 7 if split else None

    def run(q, k, v, cq, ck):
        plan = None
        if workers:
            plan = mla_plugins.plan_prefill(cq, ck, kernel="triton", num_heads=heads, tile_q=128, kv_granularity=128,
                                            num_workers=workers)
        out = poisoned((q.shape[0], q.shape[1], v.shape[2]), q.dtype, q.device)
        _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=True, fp8=True, out=out,
                                         return_lse=True, plan=plan, kernel="triton",
                                         fp8_rotate=mode == "rotated",
                                         fp8_outliers=mode == "outliers")
        return out, lse

    out, lse = run(q, k, v, cq, ck)
    cqh, ckh = cq.tolist(), ck.tolist()
    for b in (0, 2):
        qs, ks = slice(cqh[b], cqh[b + 1]), slice(ckh[b], ckh[b + 1])
        alone, alone_lse = run(q[qs], k[ks], v[ks], cu_seqlens([lens_q[b]], device),
                               cu_seqlens([lens_k[b]], device))
        assert torch.isfinite(out[qs].float()).all()
        if split:  # the batch splits its tiles differently from the sequence alone, and P's fp8
            # rounding follows each piece's running max: close, not equal
            assert rel_err(out[qs], alone.double()) < 3e-2, b
            assert torch.allclose(lse[qs], alone_lse, rtol=0, atol=lse_atol), b
        else:
            assert torch.equal(out[qs], alone), b
            assert torch.equal(lse[qs], alone_lse), b
    s1 = slice(cqh[1], cqh[2])
    assert torch.isfinite(out[s1, 3].float()).all(), "head 3 of sequence 1 holds no bad value"


def _random_partials(device, heads=8, dv=128, tile_q=64, seed=0):
    """Three split tiles (2, 3 and 4 pieces) in shuffled slots, padding after them in
    reduce_indptr, some pieces with lse -inf (and NaN outputs that must not be read), and
    row 5 of tile 0 where every piece has lse -inf."""
    gen = torch.Generator().manual_seed(seed)
    pieces = [2, 3, 4]
    rows = [64, 50, 64]
    n = sum(pieces)
    po = torch.randn(n * tile_q, heads, dv, generator=gen)
    pl = torch.randn(n * tile_q, heads, generator=gen) * 3
    pmap = [p * tile_q for p in torch.randperm(n, generator=gen).tolist()]
    pl[pmap[0] : pmap[0] + 10, 0] = float("-inf")
    pl[pmap[0] + 5, :] = float("-inf")
    pl[pmap[1] + 5, :] = float("-inf")
    po[pmap[1] + 5] = float("nan")
    indptr = [0]
    for c in pieces:
        indptr.append(indptr[-1] + c)
    indptr += [indptr[-1]] * 3  # trailing padding
    starts = [0, 64, 200]
    fmap = [[s, s + r] for s, r in zip(starts, rows, strict=False)] + [[0, 0]] * 3
    to = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return po.to(device), pl.to(device), to(indptr), to(fmap), to(pmap), tile_q


def test_reduce_matches_torch(device):
    po, pl, indptr, fmap, pmap, tile_q = _random_partials(device)
    total_q, heads, dv = 300, po.shape[1], po.shape[2]
    ref_out = poisoned((total_q, heads, dv), torch.bfloat16, device)
    ref_lse = poisoned((total_q, heads), torch.float32, device)
    torch_reduce(torch.nan_to_num(po, nan=0.0), pl, indptr, fmap, pmap, tile_q, ref_out, ref_lse)
    out = poisoned((total_q, heads, dv), torch.bfloat16, device)
    lse = poisoned((total_q, heads), torch.float32, device)
    mla_plugins.mla_reduce(po, pl, indptr, fmap, pmap, tile_q, 0, out, lse, kernel="triton")
    written = ~torch.isnan(ref_lse)
    assert torch.equal(~torch.isnan(lse), written), "wrote rows outside the split tiles, or missed some"
    assert not torch.isnan(out[written]).any()
    assert (lse[5] == float("-inf")).all() and (out[5] == 0).all()
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    assert rel_err(out[written], ref_out[written].double()) < 1e-2


def test_reduce_without_final_map(device):
    """AITER's rule without a final map: tile t covers rows [t * n, (t + 1) * n), n the gap
    between its first two pieces (here tile_q: pieces of a tile in consecutive slots)."""
    gen = torch.Generator().manual_seed(3)
    tile_q, heads, dv, pieces = 32, 4, 128, [2, 3, 2]
    n = sum(pieces)
    po = torch.randn(n * tile_q, heads, dv, generator=gen).to(device)
    pl = (torch.randn(n * tile_q, heads, generator=gen) * 3).to(device)
    pl[tile_q + 3, 1] = float("-inf")
    indptr = torch.tensor([0, 2, 5, 7, 7], dtype=torch.int32, device=device)  # one padding entry
    pmap = torch.arange(n, dtype=torch.int32, device=device) * tile_q
    total_q = 3 * tile_q + 5
    ref_out = poisoned((total_q, heads, dv), torch.bfloat16, device)
    ref_lse = poisoned((total_q, heads), torch.float32, device)
    torch_reduce(po, pl, indptr, None, pmap, tile_q, ref_out, ref_lse)
    out = poisoned((total_q, heads, dv), torch.bfloat16, device)
    lse = poisoned((total_q, heads), torch.float32, device)
    mla_plugins.mla_reduce(po, pl, indptr, None, pmap, tile_q, 0, out, lse, kernel="triton")
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.isnan(lse[3 * tile_q:]).all(), "rows past the last tile must stay untouched"
    ok = ~torch.isnan(ref_lse)
    assert torch.allclose(lse[ok], ref_lse[ok], rtol=1e-5, atol=1e-5)
    assert rel_err(out[ok], ref_out[ok].double()) < 1e-2


def test_auto_picks_triton_on_cuda(device):
    """auto takes the Triton provider on a GPU, unless a FlashAttention-3 is present (then
    the FA3 provider comes first, and the measured table may still pick either)."""
    q, k, v, cq, ck = random_batch([64], [64], 2, device=device)
    inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=True)
    chosen = mla_plugins.core.registry.get_registry().select(inputs, "auto")
    info = {i.name: i for i in mla_plugins.available_kernels(device)}
    assert info["triton"].available, info["triton"].reasons
    if not torch.version.hip:
        expected = {"triton", "flash_attn"} if info["flash_attn"].available else {"triton"}
        assert chosen.name in expected, (chosen.name, info["flash_attn"].reasons)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_torch_kernel_on_cuda(fp8, device):
    """The reference torch kernel also runs on the GPU through the public API."""
    q, k, v, cq, ck = random_batch([257, 100], [300, 400], 4, device=device)
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck)
    out = poisoned((q.shape[0], 4, 128), q.dtype, device)
    _, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=fp8, out=out, return_lse=True, kernel="torch")
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_gluon_persistent_grouped_order(group, fp8, phase1, monkeypatch, device):
    """The persistent Gluon kernel over heads in L2 groups of `group` (the last one partial
    at 3 of 8 heads): every unit exactly once, against float64."""

    from mla_plugins.core.kernels import triton_kernel as tk

    if phase1 != "gluon":
        pytest.skip("one run: the persistent configuration is set here")
    # the persistent forms as batch_config launches them (GLUON_*_PERSISTENT_CONFIG)
    monkeypatch.setattr(tk, "GLUON_FP8_CONFIG", tk.GLUON_FP8_PERSISTENT_CONFIG)
    monkeypatch.setattr(tk, "GLUON_BF16_CONFIG", tk.GLUON_BF16_PERSISTENT_CONFIG)
    monkeypatch.setattr(tk, "_gluon_order", lambda config, plan, heads_pc, device, kv_bytes=1: group)
    lens_q, lens_k = [300, 1, 700], [300, 129, 900]
    q, k, v, cq, ck = random_batch(lens_q, lens_k, 8, device=device)
    ref_out, ref_lse = reference_on_device(q, k, v, cq, ck, causal=True)
    out, lse = run_triton(q, k, v, cq, ck, causal=True, fp8=fp8)
    check(out, lse, ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)
