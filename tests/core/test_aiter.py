"""AITER binding and shim against faithful fakes (no AMD GPU exists here).

Each case runs in a fresh process, because `aiter::mla_reduce_v1` can be registered with
torch only once per process, and because `import aiter` is what a framework process does.
What the real kernel adds that the fakes do not: the HIP reduce's numerics, its LDS sizing
(`max(cu_num, num_kv_splits)` splits per tile), +inf lse for all -inf rows, and its (H, Dv)
router. The fakes' bodies run mla-plugins' torch reduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fakes import fake_aiter

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, torch, mla_plugins
from mla_plugins.core.reference import relative_error
result = {}
gen = torch.Generator().manual_seed(7)
H, DV, TQ = 16, 128, 32
def reduce_case():
    po = torch.randn(6 * TQ, H, DV, generator=gen)
    pl = torch.randn(6 * TQ, H, generator=gen)
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    fmap = torch.tensor([[0, TQ], [TQ, 2 * TQ - 5]], dtype=torch.int32)
    pmap = torch.tensor([0, 3 * TQ, TQ, 2 * TQ, 5 * TQ], dtype=torch.int32)
    out = torch.full((2 * TQ, H, DV), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2 * TQ, H), float("nan"))
    ref_out, ref_lse = out.clone(), lse.clone()
    mla_plugins.mla_reduce(po, pl, indptr, fmap, pmap, TQ, 0, ref_out, ref_lse, kernel="torch")
    return (po, pl, indptr, fmap, pmap), out, lse, ref_out, ref_lse
def same(out, lse, ref_out, ref_lse):
    rows = ~torch.isnan(ref_lse[:, 0])
    return (relative_error(out[rows], ref_out[rows]) < 1e-6 and relative_error(lse[rows], ref_lse[rows]) < 1e-6
            and bool(rows.sum() == 2 * TQ - 5))
def capture(fn):
    try:
        fn()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
"""


def run_fresh(tmp_path, variant, code):
    """Run `code` in a new interpreter that sees the fake `aiter` of `variant` (or none)."""
    env = dict(os.environ)
    paths = [str(REPO)]
    if variant is not None:
        paths.insert(0, str(fake_aiter.write_package(tmp_path / "site", variant)))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    script = PRELUDE + textwrap.dedent(code) + "\nprint('RESULT' + json.dumps(result))\n"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


STATUS = """
s = mla_plugins.probe_aiter()
result["status"] = {k: getattr(s, k) for k in ("installed", "is_amd_aiter", "distribution", "version",
                    "reduce_convention", "schema", "prefill_op", "import_error", "reason")}
result["action"] = s.action()
q, k, v = (torch.randn(20, 2, d, generator=gen).bfloat16() for d in (192, 192, 128))
cu = torch.tensor([0, 20], dtype=torch.int32)
result["auto_ok"] = capture(lambda: mla_plugins.mla_prefill(q, k, v, cu, cu)) is None
result["pinned_error"] = capture(lambda: mla_plugins.mla_prefill(q, k, v, cu, cu, kernel="aiter"))
"""


def test_legacy_aiter_both_call_forms(tmp_path):
    """Legacy AITER (0.1.15.post3: newer than 0.1.16 by date, yet without num_kv_splits)."""
    r = run_fresh(tmp_path, "legacy", STATUS + """
import aiter
args, out, lse, ref_out, ref_lse = reduce_case()
mla_plugins.aiter_mla_reduce_v1(*args, TQ, out, lse)                     # vLLM 0.24 / SGLang 0.5.12
result["eight"] = same(out, lse, ref_out, ref_lse)
args, out, lse, ref_out, ref_lse = reduce_case()
mla_plugins.aiter_mla_reduce_v1(*args, TQ, 0, out, lse)                  # vLLM 0.25+ / SGLang 0.5.15+
result["nine"] = same(out, lse, ref_out, ref_lse)
args, out, lse, ref_out, ref_lse = reduce_case()
mla_plugins.aiter_mla_reduce_v1(*args[:3], reduce_final_map=args[3], reduce_partial_map=args[4],
                                max_seqlen_q=TQ, num_kv_splits=4, final_output=out, final_lse=lse)
result["keywords"] = same(out, lse, ref_out, ref_lse)
result["calls"] = aiter.calls
result["too_many_splits"] = capture(lambda: mla_plugins.aiter_mla_reduce_v1(*args, TQ, 64, out, lse))
""")
    s = r["status"]
    assert s["is_amd_aiter"] and s["reduce_convention"] == "legacy"
    assert (s["distribution"], s["version"]) == ("amd-aiter", "0.1.15.post3")
    assert "num_kv_splits" not in s["schema"] and "SymInt max_seqlen_q, Tensor final_output" in s["schema"]
    assert r["eight"] and r["nine"] and r["keywords"]
    assert [c["nargs"] for c in r["calls"]] == [8, 8, 8], "legacy AITER must get 8 arguments"
    assert "num_kv_splits: found 64" in r["too_many_splits"] and "v0.1.16" in r["too_many_splits"]
    assert "without num_kv_splits" in r["action"]
    assert r["auto_ok"] and "device cpu not supported" in r["pinned_error"]


def test_new_aiter_both_call_forms_and_the_real_error(tmp_path):
    r = run_fresh(tmp_path, "num_kv_splits", STATUS + """
import aiter
args, out, lse, ref_out, ref_lse = reduce_case()
result["direct_old_call"] = capture(lambda: aiter.mla_reduce_v1(*args, TQ, out, lse))
mla_plugins.aiter_mla_reduce_v1(*args, TQ, out, lse)
result["eight"] = same(out, lse, ref_out, ref_lse)
args, out, lse, ref_out, ref_lse = reduce_case()
mla_plugins.aiter_mla_reduce_v1(*args, TQ, 32, out, lse)
result["nine"] = same(out, lse, ref_out, ref_lse)
args, out, lse, ref_out, ref_lse = reduce_case()
mla_plugins.aiter_mla_reduce_v1(*args, TQ, final_output=out, final_lse=lse)
result["keywords"] = same(out, lse, ref_out, ref_lse)
result["calls"] = aiter.calls
""")
    s = r["status"]
    assert s["reduce_convention"] == "num_kv_splits" and s["version"] == "0.1.16"
    assert "SymInt num_kv_splits" in s["schema"]
    # the fake reproduces the text users saw when #3391 landed (aiter #3689, vLLM #46760)
    assert ("aiter::mla_reduce_v1() Expected a value of type 'int' for argument 'num_kv_splits' "
            "but instead found type 'Tensor'.") in r["direct_old_call"]
    assert "Position: 6" in r["direct_old_call"]
    assert r["eight"] and r["nine"] and r["keywords"]
    assert [(c["nargs"], c["num_kv_splits"]) for c in r["calls"]] == [(9, 0), (9, 32), (9, 0)]


def test_unknown_schema_is_quoted_and_disabled(tmp_path):
    r = run_fresh(tmp_path, "unknown", STATUS + """
args, out, lse, *_ = reduce_case()
result["shim_error"] = capture(lambda: mla_plugins.aiter_mla_reduce_v1(*args, TQ, 0, out, lse))
""")
    s = r["status"]
    assert s["reduce_convention"] == "unknown"
    assert fake_aiter.UNKNOWN_SCHEMA.split("(")[1][:40] in s["reason"]
    assert "does not know" in r["shim_error"] and "final_lse, SymInt num_kv_splits" in r["shim_error"]
    assert r["auto_ok"] and "does not know" in r["pinned_error"]


def test_pypi_async_aiter_is_named(tmp_path):
    r = run_fresh(tmp_path, "async", STATUS)
    s = r["status"]
    assert s["installed"] and not s["is_amd_aiter"] and s["reduce_convention"] is None
    assert "async-iterator package" in s["reason"] and "aiter 0.13.0" in s["reason"]
    assert r["auto_ok"] and "async-iterator" in r["pinned_error"]


def test_aiter_whose_import_raises(tmp_path):
    r = run_fresh(tmp_path, "broken", STATUS)
    s = r["status"]
    assert s["installed"] and not s["is_amd_aiter"]
    assert s["import_error"] == f"ImportError: {fake_aiter.BROKEN_ERROR}"
    assert "`import aiter` failed" in s["reason"] and fake_aiter.BROKEN_ERROR in s["reason"]
    assert r["auto_ok"] and fake_aiter.BROKEN_ERROR in r["pinned_error"]


def test_no_aiter(tmp_path):
    r = run_fresh(tmp_path, None, STATUS)
    assert not r["status"]["installed"] and r["status"]["reduce_convention"] is None
    assert r["auto_ok"] and "AITER is not installed" in r["pinned_error"]


def test_doctor_prints_the_aiter_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fake_aiter.write_package(tmp_path / "site", "legacy")), str(REPO)]), COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "mla_plugins.cli", "doctor"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "reduce convention" in proc.stdout and "legacy" in proc.stdout
    assert "amd-aiter 0.1.15.post3" in proc.stdout and "without num_kv_splits" in proc.stdout


@pytest.mark.parametrize("args,pattern", [
    ((1, 2, 3, 4, 5, 6, "x", 8), "argument 6 found str"),
    ((1, 2, 3, 4, 5, 6, 0, 8, 9, 10), "at most 9"),
    ((1, 2, 3, 4, 5, 6, -1, 8), "num_kv_splits: found -1"),
])
def test_shim_rejects_malformed_calls(args, pattern):
    with pytest.raises((TypeError, ValueError), match=pattern):
        from mla_plugins.core.aiter import normalize_reduce_args

        normalize_reduce_args(args, {})


def test_shim_keyword_errors():
    from mla_plugins.core.aiter import normalize_reduce_args

    with pytest.raises(TypeError, match="unexpected keyword argument 'tile_q'"):
        normalize_reduce_args((), {"tile_q": 1})
    with pytest.raises(TypeError, match="multiple values for argument 'partial_lse'"):
        normalize_reduce_args((1, 2), {"partial_lse": 2})
    with pytest.raises(TypeError, match="missing required argument"):
        normalize_reduce_args((1, 2, 3), {})


PROVIDER = """
# Pretend this CPU is a gfx950: the provider's plumbing runs, the fake ops stand in for the asm.
import aiter
import mla_plugins.core.kernels.base as base
import mla_plugins.core.kernels.aiter_kernel as ak
from mla_plugins.core.reference import reference_attention
base.device_kind = ak.device_kind = lambda device: "rocm"
torch.cuda.is_available = lambda: True
ak.device_arch = lambda device: "gfx950"
lens_q, lens_k = [300, 1, 600], [300, 40, 900]
cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
cq, ck = cu(lens_q), cu(lens_k)
mk = lambda n, d: torch.randn(n, 12, d, generator=gen).bfloat16()
q, k, v = mk(sum(lens_q), 192), mk(sum(lens_k), 192), mk(sum(lens_k), 128)
out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, return_lse=True, kernel="aiter")
ref_out, ref_lse = reference_attention(q, k, v, cq, ck)
result["out_err"] = relative_error(out, ref_out)
result["lse_err"] = relative_error(lse, ref_lse)
result["nan"] = bool(torch.isnan(out).any() or torch.isnan(lse).any())
result["reduce_calls"] = aiter.calls
result["bf16_error"] = capture(lambda: mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False, kernel="aiter"))
"""


@pytest.mark.parametrize("variant,nargs", [("legacy", 8), ("num_kv_splits", 9)])
def test_aiter_provider_end_to_end_on_fakes(tmp_path, variant, nargs):
    """The provider's path (head padding 12 -> 16, fp8 scales, AITER metadata buffers, the
    reduce through the shim, lse for unsplit rows) against float64. The fakes stand in for the
    asm prefill and the HIP reduce; their numerics and gfx950 scheduling are not exercised."""
    r = run_fresh(tmp_path, variant, PROVIDER)
    assert not r["nan"]
    assert r["out_err"] <= 6e-2 and r["lse_err"] <= 6e-2
    assert r["reduce_calls"] and all(c["nargs"] == nargs for c in r["reduce_calls"])
    assert "fp8=False not supported" in r["bf16_error"]
