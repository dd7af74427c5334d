"""Hardening suite (issue 14): hypothesis generates bad inputs for every public entry point
and expects a TypeError/ValueError naming the argument, quickly; valid but odd inputs
(strided views, k and v in one buffer, fp16, 1/3/128 heads, q_len > k_len, empty sequences
and batches) must match the float64 reference.

Bad inputs are built as "a valid call with one argument spoiled", so the error must come
from that argument, not from an earlier one. Kept fast (< 60 s): small shapes, bounded
examples, every call under a wall-clock alarm.
"""

from __future__ import annotations

import contextlib
import io
import re
import signal

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_plugins
from mla_plugins.core.reference import reference_attention
from tests.core.helpers import BF16_TOL, FP8_TOL, check_attention, cu_seqlens, random_batch

SETTINGS = settings(
    max_examples=40, deadline=5000, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
#: no single bad call may take longer than this (plan_prefill(num_workers=10**8) hung)
BOUND_S = 5


@contextlib.contextmanager
def within(seconds: float = BOUND_S):
    def expired(*_):
        raise TimeoutError(f"call did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_names(call, arg: str):
    with within():
        with pytest.raises((TypeError, ValueError)) as err:
            call()
    text = str(err.value)
    assert re.search(rf"(?<![\w.]){re.escape(arg)}(?!\w)", text), f"{arg!r} not named in: {text}"
    return text


# -- mla_prefill ---------------------------------------------------------------------------

def _expanded(t):
    return t[:1].expand_as(t) if t.shape[0] > 1 else t[:, :1].expand(t.shape[0], 2, t.shape[2])


PREFILL_SPOILERS = {
    "q": [
        lambda a: a["q"][..., 0], lambda a: a["q"].float(), lambda a: a["q"].to(torch.int32),
        lambda a: a["q"].tolist(), lambda a: None, lambda a: a["q"].to("meta"),
        lambda a: a["q"][..., :0], lambda a: a["q"][:, :0],
    ],
    "k": [lambda a: a["k"].half(), lambda a: a["k"][..., :64], lambda a: a["k"][:, :1], lambda a: 3],
    "v": [lambda a: torch.cat([a["v"], a["v"][:1]]), lambda a: a["v"].double(), lambda a: "v"],
    "cu_seqlens_q": [
        lambda a: a["cu_seqlens_q"].float(), lambda a: a["cu_seqlens_q"][None],
        lambda a: torch.tensor([1, 5, 12], dtype=torch.int32), lambda a: [0, 12.5],
        lambda a: "0,12", lambda a: a["cu_seqlens_q"].to("meta"),
        lambda a: torch.tensor([0, a["q"].shape[0] + 3], dtype=torch.int32),
        lambda a: np.array([0.0, 1.0]),
    ],
    "cu_seqlens_k": [
        lambda a: torch.tensor([0, 9, 8][: a["cu_seqlens_q"].numel()], dtype=torch.int32),
        lambda a: a["cu_seqlens_k"][:1], lambda a: {"offsets": 1},
    ],
    "softmax_scale": [lambda a: -1.0, lambda a: float("nan"), lambda a: float("inf"), lambda a: 0.0,
                      lambda a: "0.1", lambda a: True, lambda a: 10**400, lambda a: -(10**400)],
    "causal": [lambda a: 1, lambda a: "yes", lambda a: 0.5],
    "fp8": [lambda a: 1, lambda a: "yes"],
    "out": [
        lambda a: torch.empty(a["q"].shape[0], a["q"].shape[1], 64, dtype=a["q"].dtype),
        lambda a: torch.empty(a["q"].shape[0], a["q"].shape[1], 128, dtype=torch.float32),
        lambda a: torch.empty(1, 1, 128, dtype=a["q"].dtype).expand(a["q"].shape[0], a["q"].shape[1], 128),
        lambda a: torch.empty(a["q"].shape[0], a["q"].shape[1], 128, dtype=a["q"].dtype, device="meta"),
        lambda a: [0.0],
    ],
    "return_lse": [lambda a: 1, lambda a: "no"],
    "kernel": [lambda a: 3, lambda a: None, lambda a: "nope"],
    "plan": [lambda a: "fast", lambda a: 3],
}


def prefill_args(lens, heads):
    q, k, v, cq, ck = random_batch(lens, lens, heads, seed=1)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck)


@pytest.mark.parametrize("spoiler", [(n, i) for n, fs in PREFILL_SPOILERS.items() for i in range(len(fs))],
                         ids=lambda s: f"{s[0]}-{s[1]}")
@settings(SETTINGS, max_examples=3)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=3), heads=st.sampled_from([2, 3]))
def test_prefill_bad_inputs_name_the_argument(spoiler, lens, heads):
    arg, index = spoiler
    args = prefill_args(lens, heads)
    kwargs = dict(fp8=False)
    value = PREFILL_SPOILERS[arg][index](args)
    if arg in args:
        args[arg] = value
    else:
        kwargs[arg] = value
    positional = [args[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    assert_names(lambda: mla_plugins.mla_prefill(*positional, **kwargs), arg)


@pytest.mark.parametrize("scale", [10**400, -(10**400), 10**5000, 2**1024],
                         ids=["1e400", "-1e400", "1e5000", "2**1024"])
@pytest.mark.parametrize("planned", [False, True], ids=["offsets", "plan"])
def test_softmax_scale_past_the_float_range_is_a_value_error(scale, planned):
    """An int too large for a float (math.isfinite(10**400) raises OverflowError) is refused
    like any other bad scale: a ValueError naming softmax_scale, without printing the int
    (10**5000 has more digits than Python converts to text by default)."""
    args = prefill_args([5, 7], 2)
    if planned:
        plan = mla_plugins.plan_prefill(args["cu_seqlens_q"], args["cu_seqlens_k"], num_heads=2, fp8=False)
        mla_plugins.mla_prefill(args["q"], args["k"], args["v"], plan=plan)  # memoizes the call
        call = lambda: mla_plugins.mla_prefill(args["q"], args["k"], args["v"], plan=plan, softmax_scale=scale)
    else:
        call = lambda: mla_plugins.mla_prefill(*(args[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")),
                                               fp8=False, softmax_scale=scale)
    with within(), pytest.raises(ValueError) as err:
        call()
    assert not isinstance(err.value, OverflowError)
    text = str(err.value)
    assert text.startswith("softmax_scale: found an int of ") and "expected a finite float > 0" in text, text
    assert f"{scale.bit_length()} bits" in text and len(text) < 200, text


# -- mla_reduce ----------------------------------------------------------------------------

def reduce_args(tiles=2, pieces=2, tile_q=8, heads=2, dv=16):
    """A valid reduce: `tiles` tiles of tile_q rows, each cut into `pieces` pieces."""
    n = tiles * pieces
    return dict(
        partial_out=torch.randn(n * tile_q, heads, dv),
        partial_lse=torch.randn(n * tile_q, heads),
        reduce_indptr=torch.arange(0, n + 1, pieces, dtype=torch.int32),
        reduce_final_map=torch.tensor([[t * tile_q, (t + 1) * tile_q] for t in range(tiles)], dtype=torch.int32),
        reduce_partial_map=torch.arange(0, n * tile_q, tile_q, dtype=torch.int32),
        tile_q=tile_q,
        num_kv_splits=0,
        out=torch.empty(tiles * tile_q, heads, dv, dtype=torch.bfloat16),
        final_lse=torch.empty(tiles * tile_q, heads),
    )


def _set(t, index, value):
    t = t.clone()
    t.view(-1)[index] = value
    return t


REDUCE_SPOILERS = {
    "reduce_indptr": [
        lambda a: _set(a["reduce_indptr"], 1, -1),                        # negative
        lambda a: _set(a["reduce_indptr"], 1, 100),                       # past the partial map
        lambda a: torch.cat([a["reduce_indptr"], a["reduce_indptr"][-1:] - 1]),  # decreasing
        lambda a: a["reduce_indptr"][:0],
        lambda a: a["reduce_indptr"].long(),
    ],
    "reduce_final_map": [
        lambda a: _set(a["reduce_final_map"], 1, 10_000),                 # rows past out
        lambda a: _set(a["reduce_final_map"], 0, -3),                     # negative start
        lambda a: _set(_set(a["reduce_final_map"], 0, 0), 1, a["tile_q"] + 1),  # longer than tile_q
        lambda a: _set(a["reduce_final_map"], 1, -1),                     # q_end < q_start
        lambda a: a["reduce_final_map"][:, :1],
    ],
    "reduce_partial_map": [
        lambda a: _set(a["reduce_partial_map"], 1, a["partial_out"].shape[0]),   # past the buffers
        lambda a: _set(a["reduce_partial_map"], 0, -5),
        lambda a: a["reduce_partial_map"].float(),
    ],
    "tile_q": [lambda a: 0, lambda a: 2**40, lambda a: 1.5, lambda a: True],
    "num_kv_splits": [lambda a: -1, lambda a: 2.0],
    "out": [
        lambda a: a["out"].float(), lambda a: a["out"][..., :0], lambda a: a["out"].to("meta"),
        lambda a: a["out"][:1].expand_as(a["out"]), lambda a: a["out"][:, :0],
    ],
    "final_lse": [lambda a: a["final_lse"][:1], lambda a: a["final_lse"][:1].expand_as(a["final_lse"])],
    "partial_out": [lambda a: a["partial_out"].half(), lambda a: a["partial_out"][:, :1]],
    "partial_lse": [lambda a: a["partial_lse"][:1], lambda a: a["partial_lse"].to("meta")],
    "validate": [lambda a: 1, lambda a: "yes"],
    "kernel": [lambda a: 3, lambda a: "nope"],
}


@pytest.mark.parametrize("spoiler", [(n, i) for n, fs in REDUCE_SPOILERS.items() for i in range(len(fs))],
                         ids=lambda s: f"{s[0]}-{s[1]}")
@settings(SETTINGS, max_examples=4)
@given(tiles=st.integers(1, 4), pieces=st.integers(2, 4), tile_q=st.sampled_from([4, 8, 16]))
def test_reduce_bad_inputs_name_the_argument(spoiler, tiles, pieces, tile_q):
    arg, index = spoiler
    args = reduce_args(tiles, pieces, tile_q)
    args[arg] = REDUCE_SPOILERS[arg][index](args)
    assert_names(lambda: mla_plugins.mla_reduce(**args), arg)


def test_reduce_without_final_map_checks_the_partial_map():
    args = reduce_args(2, 2, 8)
    args["reduce_final_map"] = None
    args["reduce_partial_map"] = torch.tensor([0, 8, 16, 40], dtype=torch.int32)  # 24 rows > tile_q
    assert_names(lambda: mla_plugins.mla_reduce(**args), "reduce_partial_map")


def test_reduce_padding_of_the_indptr_is_accepted():
    """AITER pads reduce_indptr with its last value (empty tiles), and maps with garbage."""
    args = reduce_args(2, 2, 8)
    args["reduce_indptr"] = torch.tensor([0, 2, 4, 4, 4], dtype=torch.int32)
    args["reduce_final_map"] = torch.tensor([[0, 8], [8, 16], [-7, 99], [0, 0]], dtype=torch.int32)
    mla_plugins.mla_reduce(**args)


def test_reduce_device_maps_are_checked_with_validate(monkeypatch):
    """Maps on a GPU are checked only with validate=True (a device read); emulated here by
    reporting the CPU as the maps' device type."""
    args = reduce_args(2, 2, 8)
    args["reduce_partial_map"] = _set(args["reduce_partial_map"], 1, 10_000)
    assert_names(lambda: mla_plugins.mla_reduce(**args, validate=True), "reduce_partial_map")
    with pytest.raises((IndexError, RuntimeError)):  # validate=False: torch itself fails
        mla_plugins.mla_reduce(**args, validate=False)


# -- plan_prefill --------------------------------------------------------------------------

PLAN_SPOILERS = {
    "num_heads": [lambda: 0, lambda: -4, lambda: 2**15, lambda: "4", lambda: 4.0],
    "causal": [lambda: 1, lambda: "yes"],
    "tile_q": [lambda: 0, lambda: 2**40, lambda: -1, lambda: 1.5],
    "kv_granularity": [lambda: 0, lambda: 2**40, lambda: True],
    "num_workers": [lambda: 10**8, lambda: 0, lambda: -3],
    "device": [lambda: "garbage", lambda: "cuda:x", lambda: 3.5, lambda: object()],
    "head_dim_qk": [lambda: 0], "head_dim_v": [lambda: 0, lambda: -1],
    "kernel": [lambda: 3, lambda: "nope"],
    "cu_seqlens_q": [lambda: [0, 5, 3], lambda: [1, 5], lambda: ["0", "5"], lambda: torch.tensor([0, 5.0])],
    "cu_seqlens_k": [lambda: [0], lambda: (0, -1), lambda: np.array([[0, 5]])],
}


@pytest.mark.parametrize("spoiler", [(n, i) for n, fs in PLAN_SPOILERS.items() for i in range(len(fs))],
                         ids=lambda s: f"{s[0]}-{s[1]}")
@settings(SETTINGS, max_examples=3)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=4))
def test_plan_bad_inputs_name_the_argument(spoiler, lens):
    arg, index = spoiler
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    args = dict(cu_seqlens_q=offsets, cu_seqlens_k=list(offsets))
    kwargs = dict(num_heads=4, causal=True)
    value = PLAN_SPOILERS[arg][index]()
    if arg in args:
        args[arg] = value
    else:
        kwargs[arg] = value
    assert_names(lambda: mla_plugins.plan_prefill(args["cu_seqlens_q"], args["cu_seqlens_k"], **kwargs), arg)


@pytest.mark.parametrize("offsets", [[0, 5, 12], (0, 5, 12), np.array([0, 5, 12], dtype=np.int64),
                                     np.array([0, 5, 12], dtype=np.int32), torch.tensor([0, 5, 12], dtype=torch.int32)],
                         ids=["list", "tuple", "numpy64", "numpy32", "tensor"])
def test_plan_accepts_host_offsets(offsets):
    plan = mla_plugins.plan_prefill(offsets, offsets, num_heads=2)
    assert plan.cu_seqlens_host == ((0, 5, 12), (0, 5, 12))


def test_plan_partial_rows_stay_in_int32():
    """tile_q 2**20 is allowed, but pieces * tile_q past int32 must be refused, not wrap."""
    offsets = [0, 2**21, 2**22]
    assert_names(lambda: mla_plugins.plan_prefill(offsets, offsets, num_heads=1, tile_q=2**20,
                                                  num_workers=4096, kernel="torch"), "tile_q")


def test_plan_of_int32_max_tokens_is_refused_at_once():
    """2**31 - 1 query tokens (valid int32 offsets) are 8.4M tiles of 256 rows: the planner
    walked them in Python for minutes. Refused before the walk, naming the tile bound."""
    from mla_plugins.core.validation import MAX_PLAN_TILES

    n = 2**31 - 1
    with within(1.0):
        text = assert_names(lambda: mla_plugins.plan_prefill([0, n], [0, n], num_heads=16), "cu_seqlens_q")
    assert f"found {n} query tokens in 1 sequences, {-(-n // 256)} tiles of tile_q=256 rows" in text, text
    assert f"expected at most {MAX_PLAN_TILES} tiles per plan" in text, text


def test_plan_tile_bound_counts_tiles_not_tokens():
    """The same 2**31 - 1 tokens in tiles of 2**20 rows are 2048 tiles: planned, quickly."""
    n = 2**31 - 1
    with within():
        plan = mla_plugins.plan_prefill([0, n], [0, n], num_heads=16, tile_q=2**20, kernel="torch")
    assert plan.num_tiles == 2048 and plan.total_q == n


def test_plan_tile_bound_is_exact(monkeypatch):
    """MAX_PLAN_TILES tiles are planned, one more is refused (the bound lowered to 5 here)."""
    from mla_plugins.core import validation

    monkeypatch.setattr(validation, "MAX_PLAN_TILES", 5)
    ok = [0, 256, 256 + 2 * 256, 256 + 2 * 256 + 1, 256 + 2 * 256 + 1 + 255]  # 1 + 2 + 1 + 1 tiles
    assert mla_plugins.plan_prefill(ok, ok, num_heads=2, kernel="torch").num_tiles == 5
    over = ok + [ok[-1] + 1]
    text = assert_names(lambda: mla_plugins.plan_prefill(over, over, num_heads=2, kernel="torch"),
                        "cu_seqlens_q")
    assert "6 tiles of tile_q=256 rows, expected at most 5 tiles per plan" in text, text


# -- available_kernels / unsupported_reasons -----------------------------------------------

@settings(SETTINGS, max_examples=15)
@given(device=st.one_of(
    st.text(min_size=1, max_size=12).filter(lambda s: s.strip() not in ("cpu", "cuda", "meta", "mps", "xpu")),
    st.floats(), st.lists(st.integers(), max_size=2), st.none().map(lambda _: object()),
))
def test_available_kernels_bad_device_names_it(device):
    try:
        torch.device(device)
        valid = True
    except Exception:
        valid = False
    if valid:
        return  # a real device string ('hpu', 'cuda:1', ...): answered with reasons, not an error
    assert_names(lambda: mla_plugins.available_kernels(device), "device")


CONFIG = dict(num_heads=16, qk_head_dim=192, v_head_dim=128, dtype=torch.bfloat16, device="cpu", fp8=True)
CONFIG_SPOILERS = {
    "num_heads": [0, -4, 2**15, 1.5, "16", True, None],
    "qk_head_dim": [0, -192, 192.0],
    "v_head_dim": [0, "128"],
    "dtype": ["bfloat16", None, 3],
    "device": ["garbage", "cuda:x", 2.5, None],
    "fp8": ["yes", 1, None],
    "kernel": [3, "nope"],
}


@pytest.mark.parametrize("spoiler", [(n, v) for n, vs in CONFIG_SPOILERS.items() for v in vs],
                         ids=lambda s: f"{s[0]}-{s[1]!r}")
def test_unsupported_reasons_bad_inputs_name_the_argument(spoiler):
    arg, value = spoiler
    assert_names(lambda: mla_plugins.unsupported_reasons(**{**CONFIG, arg: value}), arg)


def test_unsupported_reasons_follows_the_env_pin(monkeypatch):
    assert mla_plugins.unsupported_reasons(**CONFIG) == []
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "aiter")
    reasons = mla_plugins.unsupported_reasons(**CONFIG)
    assert reasons and all(r.startswith("aiter: ") for r in reasons)
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "nope")
    assert_names(lambda: mla_plugins.unsupported_reasons(**CONFIG), "MLA_PLUGINS_KERNEL")


def test_kernel_info_shows_the_device_reason_first():
    """On a CPU the answer is "needs a GPU", not (only) a missing library."""
    infos = {i.name: i for i in mla_plugins.available_kernels("cpu")}
    assert infos["triton"].reasons[0].startswith("device cpu not supported"), infos["triton"].reasons
    assert infos["aiter"].reasons[0].startswith("device cpu not supported"), infos["aiter"].reasons


# -- the CLI -------------------------------------------------------------------------------

@settings(max_examples=15, deadline=5000, derandomize=True, database=None)
@given(argv=st.one_of(
    st.integers(max_value=0).map(lambda h: ["check", "--heads", str(h)]),
    st.integers(min_value=2**15).map(lambda h: ["check", "--heads", str(h)]),
    st.sampled_from(["meta", "garbage", "cuda:x", "::", "cpu:-1x"]).map(lambda d: ["check", "--device", d]),
))
def test_cli_bad_arguments_are_one_line(argv):
    from mla_plugins import cli

    err = io.StringIO()
    with within(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(argv)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err.getvalue()
    assert argv[1] in lines[0] and "pass " in lines[0]


# -- valid odd inputs against float64 ------------------------------------------------------

def _run_and_check(q, k, v, cq, ck, fp8=False, **kw):
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=fp8, return_lse=True, **kw)
    ref_out, ref_lse = reference_attention(q, k, v, cq, ck)
    check_attention(out.double(), lse.double(), ref_out, ref_lse, FP8_TOL if fp8 else BF16_TOL)
    return out


@pytest.mark.parametrize("heads", [1, 3, 128])
def test_head_counts(heads):
    lens = [17, 40] if heads < 128 else [5, 9]
    _run_and_check(*random_batch(lens, lens, heads))


def test_fp16_and_fp8():
    args = random_batch([33, 7], [50, 7], 2, dtype=torch.float16)
    _run_and_check(*args)
    _run_and_check(*args, fp8=True)


def test_strided_views():
    """q a slice of a wider buffer, k transposed in memory, v non-contiguous in tokens."""
    q0, k0, v0, cq, ck = random_batch([20, 11], [25, 11], 4)
    q = torch.cat([q0, torch.randn_like(q0)], dim=2)[..., :192]
    k = k0.transpose(0, 1).contiguous().transpose(0, 1)
    v = torch.stack([v0, v0], dim=1).flatten(0, 1)[::2]  # every other row of a doubled buffer
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    _run_and_check(q, k, v, cq, ck)


def test_k_and_v_sharing_one_buffer():
    """A fused kv projection: k = kv[..., :192], v = kv[..., 192:] of the same storage."""
    lens_q, lens_k, heads = [9, 30], [40, 30], 2
    kv = torch.randn(sum(lens_k), heads, 320).bfloat16()
    q = torch.randn(sum(lens_q), heads, 192).bfloat16()
    k, v = kv[..., :192], kv[..., 192:]
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    _run_and_check(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k))


def test_more_queries_than_keys():
    """q_len > k_len, bottom-right causal: early rows see no key (0, -inf)."""
    _run_and_check(*random_batch([30, 12], [10, 0], 2))


def test_empty_sequences_and_empty_batches():
    _run_and_check(*random_batch([0, 5, 0], [0, 5, 3], 2))
    _run_and_check(*random_batch([], [], 2))
    _run_and_check(*random_batch([0], [0], 2))


def test_host_offsets_as_lists_in_prefill():
    q, k, v, cq, ck = random_batch([5, 7], [9, 7], 2)
    ref = _run_and_check(q, k, v, cq, ck)
    out = mla_plugins.mla_prefill(q, k, v, cq.tolist(), tuple(ck.tolist()), fp8=False)
    torch.testing.assert_close(out, ref)


def test_head_dim_zero_everywhere_names_the_head_dim():
    """q and k both with head dim 0 (no mismatch to catch): was a ZeroDivisionError."""
    q, k, v, cq, ck = random_batch([5], [5], 2)
    assert_names(lambda: mla_plugins.mla_prefill(q[..., :0], k[..., :0], v, cq, ck), "q")
    assert_names(lambda: mla_plugins.mla_prefill(q, k, v[..., :0], cq, ck), "v")


def test_everything_on_the_meta_device_names_q():
    """All inputs on meta (no mismatch to catch): was NotImplementedError from torch."""
    q, k, v, cq, ck = (t.to("meta") for t in random_batch([5], [5], 2))
    assert_names(lambda: mla_plugins.mla_prefill(q, k, v, cq, ck), "q")
