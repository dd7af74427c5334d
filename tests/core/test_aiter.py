"""AITER binding, probe, drop-ins and provider against fakes written from AITER's source.

No AMD GPU exists here. tests/fakes/fake_aiter.py writes a self-contained `aiter` package
per release (legacy 0.1.15.post3, num_kv_splits 0.1.16, need_lse 0.1.22.post1, ...) whose
ops are registered as torch_guard registers them and whose kernels follow AITER's planner
(v1_2_host.cuh) and reduce (reduce.cu); the asm prefill is modelled from its contract.
Each case runs in a fresh process: ops register once per process, and `import aiter` is
what a framework process does. References are float64, on inputs rounded to fp8 by the
per-tensor rule, outputs poisoned before each run. What the real kernels add: their
numerics, the asm's values for rows that see no key, the gfx950-only check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import forkserver
from tests.fakes import fake_aiter

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, os, sys, torch, mla_plugins
from mla_plugins.core.reference import relative_error
result = {}
gen = torch.Generator().manual_seed(7)
H, DV, TQ = 16, 128, 32
F8 = torch.float8_e4m3fn
SCALE = 192 ** -0.5
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
    # AITER's running-max merge vs the torch reduce: the same math in another float32 order,
    # so a few bf16 outputs round the other way (~1e-5); a wrong merge is O(1)
    rows = ~torch.isnan(ref_lse[:, 0])
    return (relative_error(out[rows], ref_out[rows]) < 1e-3 and relative_error(lse[rows], ref_lse[rows]) < 1e-6
            and bool(rows.sum() == 2 * TQ - 5) and not bool(torch.isnan(lse[rows]).any()))
def capture(fn):
    try:
        fn()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
def offsets(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
def fp8_round(t):
    # the per-tensor rule (amax -> the largest finite e4m3fn): what the provider computes from
    scale = t.float().abs().amax() / 448.0
    return ((t.float() / scale).to(F8).float() * scale).double()
def ref64(q, k, v, cq, ck, causal):
    q, k, v = (t.double() for t in (q, k, v))
    a, b = cq.tolist(), ck.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for i in range(len(a) - 1):
        ql, kl = a[i + 1] - a[i], b[i + 1] - b[i]
        if ql == 0 or kl == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[a[i]:a[i + 1]], k[b[i]:b[i + 1]]) * SCALE
        if causal:
            s = s.masked_fill(torch.arange(kl)[None] > torch.arange(ql)[:, None] + kl - ql, float("-inf"))
        l = torch.logsumexp(s, -1)
        seen = torch.isfinite(l)
        p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, l, 0.0)[..., None]), 0.0)
        out[a[i]:a[i + 1]] = torch.einsum("hqk,khd->qhd", p, v[b[i]:b[i + 1]])
        lse[a[i]:a[i + 1]] = l.T
    return out, lse
def pretend_gfx950():
    # the provider's plumbing runs on this CPU; the fake ops stand in for the GPU kernels
    import mla_plugins.core.kernels.base as base
    import mla_plugins.core.kernels.aiter_kernel as ak
    base.device_kind = ak.device_kind = lambda device: "rocm"
    torch.cuda.is_available = lambda: True
    ak.device_arch = lambda device: "gfx950"
    return ak
"""


def run_fresh(tmp_path, variant, code, **env_extra):
    """Run `code` in a new process that sees the fake `aiter` of `variant` (or none)."""
    env = dict(os.environ)
    for name in ("AITER_TRITON_ONLY", "AITER_AOT_IMPORT", "FAKE_AITER_CU_COUNT"):
        env.pop(name, None)
    env.update(env_extra)
    paths = [str(REPO)]
    if variant is not None:
        paths.insert(0, str(fake_aiter.write_package(tmp_path / "site", variant)))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    script = PRELUDE + textwrap.dedent(code) + "\nprint('RESULT' + json.dumps(result))\n"
    # a new process, forked from one that has imported torch only (tests/forkserver.py), with
    # PYTHONPATH's new entries first on its sys.path, as at an interpreter's start
    proc = forkserver.run(script, env=env, cwd=os.getcwd(), path=paths, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


STATUS = """
s = mla_plugins.probe_aiter()
result["status"] = {k: getattr(s, k) for k in ("installed", "is_amd_aiter", "distribution", "version",
                    "reduce_convention", "schema", "prefill_op", "import_error", "reason",
                    "metadata_schema")}
result["need_lse"] = s.metadata_need_lse
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
result["forwarder"] = str(__import__("inspect").signature(aiter.mla_reduce_v1))
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
    assert s["schema"] == fake_aiter.LEGACY_SCHEMA  # AITER's alias annotations included
    assert "need_lse" not in s["metadata_schema"] and not r["need_lse"]
    assert r["forwarder"] == "(*args, **kwargs)"
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
    assert s["schema"] == fake_aiter.NUM_KV_SPLITS_SCHEMA
    # the text users saw when #3391 landed (aiter #3689, vLLM #46760), from torch itself
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
    assert s["reduce_convention"] == "unknown" and s["schema"] == fake_aiter.UNKNOWN_SCHEMA
    assert fake_aiter.UNKNOWN_SCHEMA in s["reason"]
    assert "does not know" in r["shim_error"] and "final_lse, SymInt num_kv_splits" in r["shim_error"]
    assert r["auto_ok"] and "does not know" in r["pinned_error"]


def test_pypi_async_aiter_is_named(tmp_path):
    r = run_fresh(tmp_path, "async", STATUS)
    s = r["status"]
    assert s["installed"] and not s["is_amd_aiter"] and s["reduce_convention"] is None
    assert "async-iterator package" in s["reason"] and "aiter 0.13.0" in s["reason"]
    assert r["auto_ok"] and "async-iterator" in r["pinned_error"]


def test_amd_aiter_without_metadata_is_not_called_the_async_package(tmp_path):
    """A source checkout on PYTHONPATH has no dist-info: decided by what the module holds."""
    r = run_fresh(tmp_path, "no_metadata", STATUS)
    s = r["status"]
    assert s["is_amd_aiter"] and s["distribution"] is None and s["version"] is None
    assert s["reduce_convention"] == "num_kv_splits" and "async" not in s["reason"]
    assert r["auto_ok"] and "device cpu not supported" in r["pinned_error"]


@pytest.mark.parametrize("variant,exception,message", [
    ("broken", "ImportError", fake_aiter.BROKEN_ERROR),
    ("systemexit", "SystemExit", fake_aiter.SYSTEMEXIT_MESSAGE),
])
def test_aiter_whose_import_raises(tmp_path, variant, exception, message):
    """Neither an ImportError nor a SystemExit from `import aiter` ends the process."""
    r = run_fresh(tmp_path, variant, STATUS + """
result["again"] = mla_plugins.probe_aiter(refresh=True).import_error
""")
    s = r["status"]
    assert s["installed"] and not s["is_amd_aiter"]
    assert s["import_error"] == f"{exception}: {message}" == r["again"]
    assert "`import aiter` failed" in s["reason"] and message in s["reason"]
    assert r["auto_ok"] and message in r["pinned_error"]


@pytest.mark.parametrize("variant,env,cause", [
    ("num_kv_splits", {"AITER_TRITON_ONLY": "1"}, "AITER_TRITON_ONLY"),
    ("num_kv_splits", {"AITER_AOT_IMPORT": "1"}, "AITER_AOT_IMPORT"),
    ("triton_only", {}, "AITER_TRITON_ONLY"),
    ("legacy", {"AITER_TRITON_ONLY": "1"}, None),  # v0.1.15.x has no such switch
])
def test_no_registered_op_names_its_cause(tmp_path, variant, env, cause):
    r = run_fresh(tmp_path, variant, STATUS + """
result["ops"] = hasattr(torch.ops.aiter, "mla_reduce_v1")
""", **env)
    s = r["status"]
    if cause is None:
        assert r["ops"] and s["reduce_convention"] == "legacy"
        return
    assert not r["ops"] and s["is_amd_aiter"] and s["reduce_convention"] is None
    assert f"{cause}=1 is set" in s["reason"] and "too old" not in s["reason"]
    assert r["auto_ok"] and f"{cause}=1" in r["pinned_error"]


def test_no_aiter(tmp_path):
    r = run_fresh(tmp_path, None, STATUS)
    assert not r["status"]["installed"] and r["status"]["reduce_convention"] is None
    assert r["auto_ok"] and "AITER is not installed" in r["pinned_error"]


def test_import_and_probe_create_no_gpu_context(tmp_path):
    """`import mla_plugins` imports no aiter; the probe imports it and reads no device
    properties (which would create a HIP context on ROCm)."""
    r = run_fresh(tmp_path, "num_kv_splits", """
result["aiter_at_import"] = "aiter" in sys.modules
def forbidden(*a, **k):
    raise AssertionError("torch.cuda.get_device_properties called")
torch.cuda.get_device_properties = forbidden
torch.version.hip = "7.0.0"  # pretend ROCm: the arch is read from KFD sysfs or not at all
s = mla_plugins.probe_aiter()
result["convention"] = s.reduce_convention
result["aiter_after_probe"] = "aiter" in sys.modules
""")
    assert not r["aiter_at_import"] and r["aiter_after_probe"]
    assert r["convention"] == "num_kv_splits"


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


# -- the fake itself, against the rules read in AITER's source ------------------------------

PLANNER = """
import aiter
lens_q, lens_k = [700, 1, 300], [700, 40, 200]
cq, ck = offsets(lens_q), offsets(lens_k)
HK = 4
bufs = [torch.full(s if isinstance(s, tuple) else (s,), -7, dtype=d) if d != torch.uint64 else torch.empty(s, dtype=d)
        for s, d in aiter.get_ps_metadata_info_v1(3, HK, 700, 256)]
aiter.get_ps_metadata_v1(cq, ck, ck[1:] - ck[:-1], 1, HK, *bufs, qhead_granularity=1,
                         qlen_granularity=256, kvlen_granularity=128, block_size=1, is_causal=True)
_, wp, wi, ri, rf, rp = bufs
result.update(wp=wp.tolist(), wi=wi.tolist(), ri=ri.tolist(), rf=rf.tolist(), rp=rp.tolist(),
              lens_q=lens_q, lens_k=lens_k)
"""


def test_fake_planner_follows_v1_2_host(tmp_path):
    """Items per KV head, ping-pong tiles, kv_offset = tokens left after a piece, kv_end
    rounded up to 128 and clamped to the sequence end, groups sorted, tails zeroed."""
    r = run_fresh(tmp_path, "num_kv_splits", PLANNER, FAKE_AITER_CU_COUNT="4")
    wp, wi, ri, rf, rp = r["wp"], r["wi"], r["ri"], r["rf"], r["rp"]
    cq = [0, 700, 701, 1001]
    ck = [0, 700, 740, 940]
    n = wp[-1]
    items = wi[:n]
    assert all(row == [0] * 8 for row in wi[n:])  # the tail of the host vector: zeros
    heads = [((w[7] & 0xFFFF), (w[7] >> 16)) for w in items]
    assert all(hi - lo == 1 for lo, hi in heads)  # one KV head (= one q head, MHA) per item
    # clusters = gcd(4 heads, 4 CUs) = 4, one CU each: CU c walks every tile for head c
    assert wp == [0, n // 4, n // 2, 3 * n // 4, n]
    walk = [w[:7] for w in items[: n // 4]]
    assert all([w[:7] for w in items[c * n // 4:(c + 1) * n // 4]] == walk for c in range(4))
    assert [(w[2], w[3]) for w in walk] == [(0, 256), (512, 700), (256, 512), (700, 701), (701, 957),
                                            (957, 1001)]  # ping-pong 0, n-1, 1 per sequence
    for b, loc, _q0, q1, k0, k1, kv_offset in walk:
        assert loc == -1 and kv_offset == 0  # one CU per cluster: nothing is split
        assert k1 == min(k0 + -(-(min(ck[b + 1] - ck[b] - (cq[b + 1] - cq[b]) + q1 - cq[b],
                                     ck[b + 1] - ck[b])) // 128) * 128, ck[b + 1])
    assert (wi[3][4], wi[3][5]) == (700, 740)  # 40 keys: kv_end clamped to the sequence end
    assert ri == [0] * len(ri) and rf == [[0, 0]] * len(rf)

    r = run_fresh(tmp_path, "num_kv_splits", PLANNER, FAKE_AITER_CU_COUNT="3")
    wp, wi, ri, rf, rp = r["wp"], r["wi"], r["ri"], r["rf"], r["rp"]
    items = wi[: wp[-1]]
    pieces = [w for w in items if w[1] != -1]
    assert pieces, "3 CUs for 4 heads: one cluster, the tiles split"
    for b, loc, _q0, _q1, _k0, k1, kv_offset, _ in pieces:
        assert loc % 256 == 0
        if kv_offset:  # a piece that stops inside its tile: the tokens left after it
            assert kv_offset == (ck[b + 1] - ck[b]) - (k1 - ck[b])
            assert (k1 - ck[b]) % 128 == 0
    groups = len({(w[2], w[3]) for w in pieces})
    assert rf[:groups] == sorted(rf[:groups]) and all(x == [0, 0] for x in rf[groups:])
    assert ri[groups:] == [ri[groups]] * (len(ri) - groups)  # padded with the final count
    assert sorted(set(rp[: ri[-1]])) == sorted({w[1] for w in pieces})


RAW = """
import aiter
# The AITER flow as SGLang runs it, on a batch where a split tile's first rows see no key
lens_q, lens_k = [100, 300, 200], [100, 200, 300]
cq, ck = offsets(lens_q), offsets(lens_k)
T = int(cq[-1])
bufs = [torch.empty(s, dtype=d) for s, d in aiter.get_ps_metadata_info_v1(3, H, 300, 256)]
aiter.get_ps_metadata_v1(cq, ck, ck[1:] - ck[:-1], 1, H, *bufs, qhead_granularity=1,
                         qlen_granularity=256, kvlen_granularity=128, block_size=1, is_causal=True)
_, wp, wi, ri, rf, rp = bufs
q, k, v = (torch.randn(n, H, d, generator=gen).to(F8) for n, d in ((T, 192), (int(ck[-1]), 192), (int(ck[-1]), 128)))
P = max(int(ri[-1]), 1) * 256
so, sl = torch.full((P, H, 128), float("nan")), torch.full((P, H), float("nan"))
out = torch.full((T, H, 128), float("nan"), dtype=torch.bfloat16)
flse = torch.full((T, H), float("nan"))
aiter.mla_prefill_ps_asm_fwd(q, k, v, cq, ck, torch.arange(int(ck[-1]), dtype=torch.int32), wp, wi,
                             300, SCALE, True, so, sl, out, None, None, None)
aiter.mla_reduce_v1(so, sl, ri, rf, rp, 256, 0, out, flse)
blind = slice(100, 200)  # rows 0..99 of the second sequence see no key
result["blind_lse_pos_inf"] = bool(torch.isposinf(flse[blind]).all())
result["blind_out_nan"] = bool(torch.isnan(out[blind].float()).all())
result["unsplit_lse_unwritten"] = bool(torch.isnan(flse[:100]).all())
"""


def test_fake_reduce_writes_plus_inf_and_leaves_unsplit_lse(tmp_path):
    """reduce.cu: +inf where every piece is -inf (:275, :658), NaN output on the 2-3 piece
    path (a running max over -inf), and no final_lse for tiles that were not split."""
    r = run_fresh(tmp_path, "num_kv_splits", RAW, FAKE_AITER_CU_COUNT="5")
    assert r["blind_lse_pos_inf"] and r["blind_out_nan"] and r["unsplit_lse_unwritten"]


# -- the provider ----------------------------------------------------------------------------

PROVIDER = """
import aiter
ak = pretend_gfx950()
aiter._kernels.EMPTY_ROW_OUT = float(os.environ.get("EMPTY_ROW_OUT", "0"))
causal = os.environ["CAUSAL"] == "1"
# rows that see no key: 2 causal rows (5 over 3 keys), a sequence without keys, 100 rows of a
# split tile (300 over 200); tile boundaries 255/256/257; a sequence longer than its keys
lens_q, lens_k = [100, 300, 1, 520, 40, 5, 257, 255], [100, 200, 40, 700, 0, 3, 257, 300]
cq, ck = offsets(lens_q), offsets(lens_k)
Hq = 12  # padded to 16 for AITER
mk = lambda n, d: torch.randn(n, Hq, d, generator=gen).bfloat16()
q, k, v = mk(int(cq[-1]), 192), mk(int(ck[-1]), 192), mk(int(ck[-1]), 128)
ref_out, ref_lse = ref64(fp8_round(q), fp8_round(k), fp8_round(v), cq, ck, causal)
seen = torch.isfinite(ref_lse)
errs = []
for layer in range(3):  # three layers of one batch: one plan
    poison = torch.full((int(cq[-1]), Hq, 128), float("nan"), dtype=torch.bfloat16)
    out, lse = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=causal, return_lse=True,
                                       kernel="aiter", out=poison)
    errs.append([relative_error(out, ref_out), (lse.double()[seen] - ref_lse[seen]).abs().max().item()])
    assert out.data_ptr() == poison.data_ptr()
result["errs"] = errs
result["blind_rows"] = int((~seen).all(-1).sum())
result["blind_ok"] = bool((out[~seen] == 0).all() and torch.isneginf(lse[~seen]).all())
result["nan"] = bool(torch.isnan(out).any() or torch.isnan(lse).any())
out2 = mla_plugins.mla_prefill(q, k, v, cq, ck, causal=causal, kernel="aiter")
result["no_lse_err"] = relative_error(out2, ref_out)
result["no_lse_blind_ok"] = bool((out2[~seen] == 0).all())
calls = aiter.all_calls
result["plans"] = [c for c in calls if c["op"] == "get_ps_metadata_v1"]
result["asm"] = [c for c in calls if c["op"] == "mla_prefill_ps_asm_fwd"]
result["reduces"] = [c for c in calls if c["op"] == "mla_reduce_v1"]
result["bf16_error"] = capture(lambda: mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=False, kernel="aiter"))
"""


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant,nargs", [("legacy", 8), ("num_kv_splits", 9), ("need_lse", 9)])
def test_aiter_provider_end_to_end(tmp_path, variant, nargs, causal):
    """Every convention: out and lse for every row against float64 (fp8-rounded inputs), rows
    that see no key exactly 0 / -inf (AITER's reduce gives +inf and NaN there), the caller's
    poisoned `out` fully written, one AITER plan per batch and lse mode across three layers,
    partial buffers sized from the host reduce_indptr[-1], heads 12 -> 16."""
    r = run_fresh(tmp_path, variant, PROVIDER, FAKE_AITER_CU_COUNT="5", CAUSAL=str(int(causal)))
    assert not r["nan"] and r["blind_ok"] and r["no_lse_blind_ok"]
    assert r["blind_rows"] == (2 + 40 + 100 if causal else 40)
    for out_err, lse_err in r["errs"]:
        assert out_err <= 1e-2 and lse_err <= 2e-3, r["errs"]
    assert r["no_lse_err"] <= 1e-2
    # one plan for the lse calls, one for the call without lse; need_lse only where AITER takes it
    assert sorted(p["need_lse"] for p in r["plans"]) == sorted([variant == "need_lse", False])
    assert all(p["is_causal"] == causal for p in r["plans"])
    assert all(a["heads"] == 16 for a in r["asm"])
    # partial buffers: exactly reduce_indptr[-1] tiles (the planner's worst case is larger)
    assert r["reduces"] and all(c["partial_rows"] == c["partial_tiles"] * 256 for c in r["reduces"])
    assert any(c["partial_tiles"] * 256 < p["max_partials"] * 256 for c in r["reduces"] for p in r["plans"])
    assert all(c["nargs"] == nargs - (not c["final_lse"]) for c in r["reduces"])
    assert "fp8=False not supported" in r["bf16_error"]


def test_aiter_provider_does_not_depend_on_the_asm_empty_row_values(tmp_path):
    """The asm kernel's values for rows that see no key are not in any source: poisoned."""
    r = run_fresh(tmp_path, "num_kv_splits", PROVIDER, FAKE_AITER_CU_COUNT="5", CAUSAL="1",
                  EMPTY_ROW_OUT="nan")
    assert not r["nan"] and r["blind_ok"] and r["no_lse_blind_ok"]


def test_aiter_plan_carries_its_metadata(tmp_path):
    """plan_prefill(kernel="aiter") plans AITER's metadata once; every layer reuses it."""
    r = run_fresh(tmp_path, "num_kv_splits", """
import aiter, inspect
ak = pretend_gfx950()
lens = [300, 600]
cq = offsets(lens)
q, k, v = (torch.randn(900, 16, d, generator=gen).bfloat16() for d in (192, 192, 128))
if "kernel" not in inspect.signature(mla_plugins.plan_prefill).parameters:
    result["skip"] = "plan_prefill has no kernel= yet (issue 11)"
else:
    plan = mla_plugins.plan_prefill(cq, cq, num_heads=16, kernel="aiter")
    result["has_meta"] = isinstance(plan.extra.get("aiter"), ak.AiterPlanData)
    ref, _ = ref64(fp8_round(q), fp8_round(k), fp8_round(v), cq, cq, True)
    errs = [relative_error(mla_plugins.mla_prefill(q, k, v, plan=plan), ref) for _ in range(5)]
    result["errs"] = errs
    result["plans"] = sum(c["op"] == "get_ps_metadata_v1" for c in aiter.all_calls)
""", FAKE_AITER_CU_COUNT="5")
    if "skip" in r:
        pytest.skip(r["skip"])
    assert r["has_meta"] and r["plans"] == 1 and max(r["errs"]) <= 1e-2


def test_causal_tiles_far_above_the_diagonal_are_refused(tmp_path):
    """v1_2_host.cuh counts -1 KV units for a causal tile ending 128+ rows above the
    diagonal (C's truncating division), which shifts the quotas: the provider refuses such
    batches (auto falls back) instead of returning rows nobody computed."""
    r = run_fresh(tmp_path, "num_kv_splits", """
ak = pretend_gfx950()
cq, ck = offsets([700]), offsets([100])
q, k, v = (torch.randn(n, 16, d, generator=gen).bfloat16() for n, d in ((700, 192), (100, 192), (100, 128)))
result["pinned"] = capture(lambda: mla_plugins.mla_prefill(q, k, v, cq, ck, kernel="aiter"))
out = mla_plugins.mla_prefill(q, k, v, cq, ck)
ref, _ = ref64(q, k, v, cq, ck, True)
result["auto_err"] = relative_error(out, ref)
""", FAKE_AITER_CU_COUNT="5")
    assert "q_len - k_len >= 384" in r["pinned"]
    assert r["auto_err"] <= 6e-2


# -- the get_ps_metadata_v1 drop-in ----------------------------------------------------------

DROPIN = """
import aiter
from mla_plugins.core.aiter import NeedLseUnavailable
# SGLang 0.5.23's chunked-prefix passes: causal over the extend tokens, non-causal per chunk
def sglang_pass(lens_q, lens_k, causal, need_lse):
    cq, ck = offsets(lens_q), offsets(lens_k)
    T, S = int(cq[-1]), int(ck[-1])
    bufs = [torch.empty(s, dtype=d) for s, d in aiter.get_ps_metadata_info_v1(len(lens_q), H, max(lens_q), 256)]
    mla_plugins.aiter_get_ps_metadata_v1(cq, ck, ck[1:] - ck[:-1], 1, H, *bufs, qhead_granularity=1,
                                         qlen_granularity=256, kvlen_granularity=128, block_size=1,
                                         is_causal=causal, need_lse=need_lse)
    _, wp, wi, ri, rf, rp = bufs
    num_partial = int(ri[-1])
    q, k, v = (torch.randn(n, H, d, generator=gen).bfloat16() for n, d in ((T, 192), (S, 192), (S, 128)))
    q8, k8, v8 = (t.to(F8) for t in (q, k, v))  # unit scales, as SGLang passes them
    P = max(num_partial, 1) * 256
    logits, attn_lse = torch.full((P, H, 128), float("nan")), torch.full((P, H), float("nan"))
    out = torch.full((T, H, 128), float("nan"), dtype=torch.bfloat16)
    final_lse = torch.full((T, H), float("nan")) if need_lse else None
    aiter.mla_prefill_ps_asm_fwd(q8, k8, v8, cq, ck, torch.arange(S, dtype=torch.int32), wp, wi,
                                 max(lens_q), SCALE, causal, logits, attn_lse, out, None, None, None)
    mla_plugins.aiter_mla_reduce_v1(logits, attn_lse, ri, rf, rp, 256, 0, out, final_lse)
    ref_out, ref_lse = ref64(q8.double(), k8.double(), v8.double(), cq, ck, causal)
    r = {"out_err": relative_error(out, ref_out), "num_partial": num_partial}
    if need_lse:
        r["lse_err"] = (final_lse.double() - ref_lse).abs().max().item()
    return r
result["causal"] = sglang_pass([300, 600, 40], [300, 600, 40], True, True)
result["chunk"] = sglang_pass([300, 600, 40], [512, 100, 700], False, True)
result["plain"] = sglang_pass([300, 600, 40], [300, 600, 40], True, False)
result["plans"] = [c for c in aiter.all_calls if c["op"] == "get_ps_metadata_v1"]
result["direct"] = capture(lambda: aiter.get_ps_metadata_v1(*([torch.zeros(2, dtype=torch.int32)] * 3), 1, H,
    *[torch.zeros(4, dtype=torch.int32)] * 6, need_lse=True))
# more sequences than this AITER's planner buffers leave room for
result["too_many"] = capture(lambda: sglang_pass([300] * 8, [300] * 8, True, True))
"""


@pytest.mark.parametrize("variant", ["legacy", "num_kv_splits", "need_lse"])
def test_get_ps_metadata_dropin_takes_need_lse_everywhere(tmp_path, variant):
    """SGLang >= 0.5.22 passes need_lse: forwarded where AITER takes it; elsewhere dropped,
    with the unsplit tiles routed through the reduce so every row's final_lse is written."""
    r = run_fresh(tmp_path, variant, DROPIN, FAKE_AITER_CU_COUNT="5")
    for name in ("causal", "chunk", "plain"):
        assert r[name]["out_err"] <= 1e-2, (name, r[name])
    for name in ("causal", "chunk"):
        assert r[name]["lse_err"] <= 2e-3, (name, r[name])
    native = variant == "need_lse"
    assert [p["need_lse"] for p in r["plans"][:3]] == [native, native, False]
    if native:
        assert r["direct"] is None or "need_lse" not in r["direct"]
    else:
        assert "need_lse" in r["direct"]  # the break SGLang >= 0.5.22 meets on this AITER
        # 8 sequences of 2 tiles each, the old planner's buffers hold 4 * 2 partial tiles
        assert "NeedLseUnavailable" in r["too_many"]
        for text in ("#3606", fake_aiter.VARIANTS[variant]["version"], "0.1.22.post1", "0.5.22"):
            assert text in r["too_many"], r["too_many"]
