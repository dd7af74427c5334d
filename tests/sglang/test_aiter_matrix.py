"""The SGLang x AITER matrix: the installed SGLang release's real FP8 MLA prefill, per AITER
convention, without and with mla-plugins, each cell in a fresh process (forked from one that
has imported torch only: tests/forkserver.py).

Release under test: whatever this environment has (`sglang` session: 0.5.23; `sglang_older`:
0.5.14, then 0.5.15; MLA_PLUGINS_EXPECT_SGLANG names it, so a session that installed the
wrong one fails). What each release calls, read from its wheel:
- 0.5.14: `AiterAttnBackend.mla_fp8_prefill_attn(q, k, v, layer)` over `forward_metadata`
  built by `make_mla_prefill_ps_meta_data_buffer` / `make_mla_prefill_ps_meta_data`
  (`get_ps_metadata_v1` without need_lse); `mla_reduce_v1` with 8 arguments; lse discarded.
- 0.5.15: the same, `mla_reduce_v1` with 9 (a 0 for num_kv_splits).
- 0.5.22+ (0.5.23): `_build_prefill_ps_metadata(..., need_lse=...)` (passes need_lse to
  `get_ps_metadata_v1` always, False for the one-shot prefill, True for each prefix chunk)
  and `_mla_fp8_prefill_attn_ps(q, k, v, layer, ps) -> (out, lse)`; 9-argument reduce.

The cell builds the release's real `AiterAttnBackend` object without its `__init__` (which
needs a ModelRunner, its pools and the GPU) and sets the attributes these functions read, to
the values `__init__` computes (0.5.23: `fp8_prefill_num_head` from the release's own
`check_fp8_prefill_num_head`), then calls the release's functions with the arguments the
release's `init_forward_metadata` / `forward_extend` pass for an MLA extend batch. The
release's own `from aiter import (...)` binds the fake's functions (the fake is completed
with stand-ins for the unrelated kernels that import names, see `_complete_for_sglang`),
so the shim meets the module as it is on a ROCm machine.

"with": SGLang's own `load_plugins()` loads the mla_plugins entry point (register(), shim
deferred to the module's import). "without": the plugin is never loaded.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests import forkserver
from tests.fakes import fake_aiter

REPO = Path(__file__).resolve().parents[2]

# Names SGLang's aiter backend imports from aiter besides the FP8 prefill trio and the reduce
# (0.5.14: aiter_backend.py:44-57; 0.5.23: :47-61). The fake does not model those kernels;
# without them the module's `from aiter import (...)` would fail as a whole and bind nothing.
_STANDINS = """

# --- added by tests/sglang/test_aiter_matrix.py: stand-ins for kernels the fake does not
# model, so SGLang's `from aiter import (...)` binds the fake's real ones as on ROCm.
def _not_modelled(name):
    def f(*args, **kwargs):
        raise NotImplementedError(f"fake aiter: {name} is not modelled")
    f.__name__ = name
    return f


for _n in ("flash_attn_varlen_func", "flash_attn_varlen_fp8_pertensor_func",
           "get_mla_metadata_info_v1", "get_mla_metadata_v1", "mha_batch_prefill_func",
           "paged_attention_ragged"):
    globals().setdefault(_n, _not_modelled(_n))
"""


def _complete_for_sglang(dest: Path) -> None:
    pkg = dest / "aiter"
    with open(pkg / "__init__.py", "a") as f:
        f.write(_STANDINS)
    if not (pkg / "mla.py").exists():
        (pkg / "mla.py").write_text(
            "from . import _not_modelled\n"
            "mla_decode_fwd = _not_modelled('mla_decode_fwd')\n"
            "mla_prefill_fwd = _not_modelled('mla_prefill_fwd')\n")
    ua = pkg / "ops" / "triton" / "attention"
    if not (ua / "unified_attention.py").exists():
        ua.mkdir(parents=True, exist_ok=True)
        for d in (pkg / "ops" / "triton", ua):
            (d / "__init__.py").touch()
        (ua / "unified_attention.py").write_text(
            "from aiter import _not_modelled\n"
            "unified_attention = _not_modelled('unified_attention')\n")


CELL = r"""
import json, logging, os, sys, types, torch
_h = logging.StreamHandler(sys.stderr)
_h.setFormatter(logging.Formatter("LOG %(name)s %(levelname)s: %(message)s"))
logging.getLogger("mla_plugins").addHandler(_h)
logging.getLogger("mla_plugins").setLevel(logging.INFO)
result = {}
if sys.argv[2] == "with":
    from sglang.srt.plugins import load_plugins
    load_plugins()                          # SGLang's own loader: mla_plugins' register()
    from mla_plugins.core import aiter as core_aiter
    # register() must not probe AITER (it runs in every SGLang process); SGLang's own model
    # imports may import aiter (0.5.14's quark/utils.py does), which is not ours to prevent.
    result["probed_at_register"] = core_aiter._status is not None
    result["aiter_imported_by_register"] = "aiter" in sys.modules
import sglang.srt.layers.attention.aiter_backend as ab
import aiter
from importlib.metadata import version
result["sglang"] = version("sglang")
held = {n: getattr(ab, n, None) for n in ("mla_reduce_v1", "get_ps_metadata_v1")}
result["bound"] = {n: getattr(f, "__module__", "") .startswith("mla_plugins") for n, f in held.items()}

FP8 = ab.fp8_dtype
H = 16
case = json.loads(sys.argv[3])
q_lens, k_lens, causal, need_lse = case["q"], case["k"], case["causal"], case["need_lse"]
gen = torch.Generator().manual_seed(case["seed"])
Tq, Tk = sum(q_lens), sum(k_lens)
q = torch.randn(Tq, H, 192, generator=gen).to(torch.bfloat16)
k = torch.randn(Tk, H, 192, generator=gen).to(torch.bfloat16)
v = torch.randn(Tk, H, 128, generator=gen).to(torch.bfloat16)
cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
qo_indptr, kv_indptr = cu(q_lens), cu(k_lens)
seq_lens = torch.tensor(k_lens, dtype=torch.int32)
layer = types.SimpleNamespace(tp_q_head_num=H, v_head_dim=128, scaling=192 ** -0.5, layer_id=0)

# The release's backend object; the attributes its __init__ sets that these functions read.
be = object.__new__(ab.AiterAttnBackend)
be.device, be.input_dtype, be.num_head, be.num_kv_head, be.v_head_dim = "cpu", torch.bfloat16, H, H, 128
be._arange_buf = None
if hasattr(ab.AiterAttnBackend, "check_fp8_prefill_num_head"):
    be.fp8_prefill_num_head = be.check_fp8_prefill_num_head(num_head=H, num_kv_head=H, v_head_dim=128)
    be.fp8_prefill_num_kv_head = be.num_kv_head + (be.fp8_prefill_num_head - H)

# What reached the kernels, and the final_lse the release hands to the reduce.
reduce_seen = []
inner = ab.mla_reduce_v1
def recording_reduce(*args, **kwargs):
    reduce_seen.append(int(args[2][-1]))  # reduce_indptr[-1]: the partial pieces it merges
    return inner(*args, **kwargs)
ab.mla_reduce_v1 = recording_reduce
try:
    if hasattr(ab, "MlaPrefillPsMetadata"):           # 0.5.22+
        ps = be._build_prefill_ps_metadata(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_lens_cpu=seq_lens, num_kv_tokens=Tk,
            max_q_len=max(q_lens), is_causal=causal, need_lse=need_lse,
            qo_indptr_cpu=qo_indptr, kv_indptr_cpu=kv_indptr,
            # as each caller passes it: the one-shot prefill keeps the static bound
            exact_partial_count=need_lse)
        out, lse = be._mla_fp8_prefill_attn_ps(q, k, v, layer, ps)
    else:                                             # 0.5.14 / 0.5.15
        assert causal and not need_lse, "these releases plan causal extend batches only"
        bs, max_q_len = len(q_lens), max(q_lens)
        qlen_granularity = 256 // (be.num_head // be.num_kv_head)   # init_forward_metadata
        bufs = be.make_mla_prefill_ps_meta_data_buffer(bs, max_q_len, qlen_granularity)
        be.make_mla_prefill_ps_meta_data(qo_indptr, kv_indptr, seq_lens, *bufs, is_causal=True)
        wm, wi, wis, ri, rf, rp = bufs
        be.forward_metadata = ab.ForwardMetadata(
            kv_indptr, torch.arange(Tk, dtype=torch.int32), qo_indptr, torch.ones(bs, dtype=torch.int32),
            max_q_len, max(k_lens), work_metadata=wm, work_info_set=wis, work_indptr=wi,
            reduce_indptr=ri, reduce_final_map=rf, reduce_partial_map=rp,
            fp8_prefill_kv_indices=torch.arange(Tk, device="cpu", dtype=torch.int32))
        out = be.mla_fp8_prefill_attn(q, k, v, layer)
        lse = None
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]  # not torch's value dump
    print(json.dumps(result)); sys.exit(0)

# float64 reference on the FP8-rounded inputs the kernel sees (scales 1), bottom-right causal;
# a row that sees no key: out 0, lse -inf.
qd, kd, vd = (x.to(FP8).double() for x in (q, k, v))
ref_o = torch.zeros(Tq, H, 128, dtype=torch.float64)
ref_l = torch.full((Tq, H), float("-inf"), dtype=torch.float64)
for b in range(len(q_lens)):
    qs, qe, ks, ke = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_indptr[b]), int(kv_indptr[b + 1])
    if qe == qs or ke == ks:
        continue
    s = torch.einsum("qhd,khd->hqk", qd[qs:qe], kd[ks:ke]) * layer.scaling
    if causal:
        i = torch.arange(qe - qs)[:, None]; j = torch.arange(ke - ks)[None, :]
        s = s.masked_fill(j > i + (ke - ks) - (qe - qs), float("-inf"))
    l = torch.logsumexp(s, -1)
    p = torch.where(torch.isinf(l)[..., None], 0.0, torch.exp(s - l[..., None]))
    ref_o[qs:qe] = torch.einsum("hqk,khd->qhd", p, vd[ks:ke])
    ref_l[qs:qe] = l.transpose(0, 1)
seen = torch.isfinite(ref_l)
o = out.double()
result["out_err"] = (o - ref_o).abs().max().item() if Tq else 0.0
result["out_nonfinite"] = int((~torch.isfinite(o)).sum())
result["empty_rows"] = int((~seen).any(-1).sum())
result["empty_out_max"] = o[~seen].abs().max().item() if (~seen).any() else 0.0
if lse is not None:
    l = lse.double()
    result["lse_err"] = (l[seen] - ref_l[seen]).abs().max().item()
    result["lse_empty"] = sorted({str(x) for x in l[~seen].tolist()})
result["reduce_calls"] = len(reduce_seen)
result["n_partial"] = reduce_seen
result["kernel_calls"] = [{k: c[k] for k in ("op", "nargs", "num_kv_splits") if k in c} for c in aiter.calls]
print(json.dumps(result))
"""

#: Batches as each release plans them (q = extend tokens, k = keys of the attention call).
#: 300-row sequences: two 256-row tiles; with 6 fake CUs the KV is split across workers.
ONE_SHOT = {"q": [300, 40, 257], "k": [300, 40, 257], "causal": True, "need_lse": False, "seed": 1}
# 0.5.22+ chunked prefix: each prefix chunk is attended without a mask, with need_lse=True.
PREFIX_CHUNK = {"q": [300, 40], "k": [129, 520], "causal": False, "need_lse": True, "seed": 2}
# Rows that see no key (keys fewer than queries, bottom-right causal; SGLang never plans one,
# its keys always include the extend tokens): out 0 and lse -inf expected.
EMPTY_ROWS = {"q": [300, 64], "k": [200, 64], "causal": True, "need_lse": False, "seed": 3}


def _release() -> str:
    from importlib.metadata import version

    return version("sglang")


def _version() -> tuple[int, ...]:
    return tuple(int(x) for x in _release().split(".")[:3] if x.isdigit())


def _new_api() -> bool:
    return _version() >= (0, 5, 22)


def run_cell(tmp_path, variant, mode, case, **env):
    dest = tmp_path / f"aiter-{variant}"
    fake_aiter.write_package(dest, variant)
    _complete_for_sglang(dest)
    pythonpath = os.pathsep.join([str(dest), str(REPO), os.environ.get("PYTHONPATH", "")])
    # a fresh process per cell, forked from one that has imported torch only; PYTHONPATH's
    # new leading entries go first on its sys.path, as at an interpreter's start
    proc = forkserver.run(
        CELL, argv=[str(dest), mode, json.dumps(case)], cwd=REPO, path=[str(dest), str(REPO)],
        env={**os.environ, "PYTHONPATH": pythonpath, "SGLANG_PLUGINS": "mla_plugins", **env}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["stderr"] = proc.stderr
    return r


def test_installed_release_is_the_one_the_session_names():
    expected = os.environ.get("MLA_PLUGINS_EXPECT_SGLANG")
    if expected is None:
        pytest.skip("MLA_PLUGINS_EXPECT_SGLANG not set (run through nox)")
    assert _release() == expected


# Exact "without" outcomes: None = runs correctly; otherwise the error text the call raises.
REDUCE_WANTS_INT = ("RuntimeError: aiter::mla_reduce_v1() Expected a value of type 'int' for "
                    "argument 'num_kv_splits' but instead found type 'Tensor'.")
REDUCE_GOT_NINE = ("RuntimeError: aiter::mla_reduce_v1() expected at most 8 argument(s) but "
                   "received 9 argument(s).")
NEED_LSE_REJECTED = ("RuntimeError: aiter::get_ps_metadata_v1() expected at most 16 argument(s) but "
                     "received 17 argument(s).")


def expected_without(variant: str) -> str | None:
    if _new_api():  # 0.5.22+: need_lse= on every plan, then a 9-argument reduce
        return None if variant == "need_lse" else NEED_LSE_REJECTED
    if _version() < (0, 5, 15):  # 8-argument reduce
        return None if variant == "legacy" else REDUCE_WANTS_INT
    return REDUCE_GOT_NINE if variant == "legacy" else None  # 9 arguments


def _cases():
    return [ONE_SHOT, PREFIX_CHUNK] if _new_api() else [ONE_SHOT]


def _assert_correct(r, split=True):
    assert "error" not in r, r["error"]
    assert r["reduce_calls"] == 1 and r["out_nonfinite"] == 0, r
    if split:  # the plan split KV, so the reduce really merged pieces
        assert r["n_partial"][0] > 0, r
    assert r["out_err"] <= 3e-2, r
    if "lse_err" in r:
        assert r["lse_err"] <= 1e-3, r


@pytest.mark.parametrize("variant", ["legacy", "num_kv_splits", "need_lse"])
def test_without_mla_plugins(tmp_path, variant):
    """The release's own calls against the fake AITER: fail exactly as on ROCm, or work."""
    want = expected_without(variant)
    for case in _cases():
        r = run_cell(tmp_path, variant, "without", case)
        assert not any(r["bound"].values())
        if want is None:
            _assert_correct(r)
        else:
            assert r.get("error", "").startswith(want), (want, r.get("error"))


@pytest.mark.parametrize("variant", ["legacy", "num_kv_splits", "need_lse"])
def test_with_mla_plugins(tmp_path, variant):
    """Every cell runs and matches float64; register() imported no aiter."""
    for case in _cases():
        r = run_cell(tmp_path, variant, "with", case)
        assert r["probed_at_register"] is False, "register() must not probe AITER"
        assert r["bound"]["mla_reduce_v1"], r
        _assert_correct(r)
        if case["need_lse"]:
            assert r["bound"]["get_ps_metadata_v1"], r


def test_rows_that_see_no_key(tmp_path):
    """Keys fewer than queries: rows that see no key get out 0 (and lse -inf where returned)."""
    case = dict(EMPTY_ROWS, need_lse=_new_api())  # 0.5.22+: with lse, as a prefix chunk asks
    r = run_cell(tmp_path, "num_kv_splits" if _new_api() else "legacy", "with", case)
    _assert_correct(r, split=False)
    assert r["empty_rows"] > 0 and r["empty_out_max"] == 0.0, r
    if "lse_empty" in r:
        assert r["lse_empty"] == ["-inf"], r


def test_unknown_schema_left_untouched(tmp_path):
    """An mla_reduce_v1 schema we do not know: SGLang's calls stay as they are (same outcome
    with and without mla-plugins), and one log line says why."""
    without = run_cell(tmp_path, "unknown", "without", ONE_SHOT)
    with_ = run_cell(tmp_path, "unknown", "with", ONE_SHOT)
    assert not any(with_["bound"].values()), with_
    assert with_.get("error") == without.get("error"), (with_.get("error"), without.get("error"))
    lines = [ln for ln in with_["stderr"].splitlines() if ln.startswith("LOG mla_plugins.sglang.shim")]
    assert len(lines) == 1 and "does not know" in lines[0], with_["stderr"][-3000:]


if __name__ == "__main__":  # one cell by hand: python tests/sglang/test_aiter_matrix.py VARIANT MODE [CASE]
    import tempfile

    case = {"one_shot": ONE_SHOT, "prefix_chunk": PREFIX_CHUNK, "empty_rows": EMPTY_ROWS,
            "empty_rows_lse": dict(EMPTY_ROWS, need_lse=True)}
    r = run_cell(Path(tempfile.mkdtemp()), sys.argv[1], sys.argv[2], case[sys.argv[3] if len(sys.argv) > 3 else "one_shot"])
    r.pop("stderr")
    print(textwrap.indent(json.dumps(r, indent=1), "  "))
