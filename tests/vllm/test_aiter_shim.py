"""The AITER shim on vLLM's AiterMLAImpl, with faithful fake AMD AITER of both schemas.

What runs for real: vLLM 0.32's (or 0.33's) `AiterMLAImpl.__init__` (its gfx950 / FP8-KV gate and its
`from aiter import mla_prefill_ps_asm_fwd, mla_reduce_v1` binding), our wrapper, and the
fake `aiter::mla_reduce_v1` torch op with the exact legacy / num_kv_splits schema. Stood
in: the parent `MLACommonImpl.__init__` (it builds kv_b_proj layers that need a running
vLLM), the GPU op libraries `vllm.platforms.rocm` imports, the GPU's properties (gfx950).
The reduce is then called with the exact argument lists vLLM passes at its call site:
8 arguments in 0.22-0.24, `(..., tile_q, 0, out_3d, final_lse)` from 0.25 on. What a real
ROCm box adds: the HIP kernels themselves (see fake_aiter's docstring).
"""

from __future__ import annotations

import json

import pytest

from .conftest import run_python

SCRIPT = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
import torch
from tests.fakes import fake_aiter

dest = fake_aiter.write_package(sys.argv[1], sys.argv[2])
with open(dest / "aiter" / "__init__.py", "a") as f:  # the two other names vLLM imports
    f.write("\ndef flash_attn_varlen_func(*a, **k):\n    raise NotImplementedError\n"
            "def mla_prefill_ps_asm_fwd(*a, **k):\n    raise NotImplementedError\n")
sys.path.insert(0, str(dest))

from tests.fakes import gfx950
gfx950.stand_in()

from mla_plugins.vllm import register
register()
from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLAImpl

def parent_init(self, num_heads, head_size, scale, num_kv_heads, *args, **kwargs):
    self.num_heads, self.scale, self.dcp_world_size = num_heads, scale, 1
    self.qk_nope_head_dim, self.qk_rope_head_dim = kwargs["qk_nope_head_dim"], kwargs["qk_rope_head_dim"]
    self.v_head_dim = kwargs["v_head_dim"]
MLACommonImpl.__init__ = parent_init
gfx950.answer_compute_units()

H, DV, TILE = 16, 128, 256
impl = AiterMLAImpl(H, 576, 0.1, 1, None, None, "fp8", None, "decoder", None,
                    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=DV, kv_b_proj=None)
import aiter, mla_plugins
result = {"fp8_prefill_enabled": impl._fp8_prefill_enabled,
          "bound_to_shim": impl._mla_reduce_v1 is mla_plugins.aiter_mla_reduce_v1,
          "shim_marker": getattr(AiterMLAImpl.__init__, "_mla_plugins_shim", False)}

# a split plan (one sequence of 4096 rows over 3 workers) and random partials
cu = torch.tensor([0, 4096], dtype=torch.int32)
plan = mla_plugins.plan_prefill(cu, cu, num_heads=H, tile_q=TILE, num_workers=3)
g = torch.Generator().manual_seed(5)
rows = max(plan.partial_rows(), TILE)
logits = torch.randn(rows, H, DV, generator=g)
lse = torch.randn(rows, H, generator=g)

def reference(out_like):
    ref = out_like.double().clone()
    ind, fmap, pmap = plan.reduce_indptr.tolist(), plan.reduce_final_map.tolist(), plan.reduce_partial_map.tolist()
    for t in range(plan.num_split_tiles):
        q0, q1 = fmap[t]
        bases = pmap[ind[t]:ind[t + 1]]
        ls = torch.stack([lse[b:b + q1 - q0].double() for b in bases])
        os_ = torch.stack([logits[b:b + q1 - q0].double() for b in bases])
        w = torch.softmax(ls, dim=0)
        ref[q0:q1] = (w[..., None] * os_).sum(0)
    return ref

arg_lists = {}
for vllm_version in ("0.24", "0.25"):
    out = torch.randn(4096, H, DV, generator=g).to(torch.bfloat16)
    final_lse = torch.full((4096, H), float("nan"))
    ref = reference(out)
    head = (logits, lse, plan.reduce_indptr, plan.reduce_final_map, plan.reduce_partial_map, TILE)
    args = head + ((out, final_lse) if vllm_version == "0.24" else (0, out, final_lse))
    n_before = len(aiter.calls)
    impl._mla_reduce_v1(*args)  # exactly as AiterMLAImpl._mla_fp8_prefill_attn calls it
    err = float((out.double() - ref).norm() / ref.norm())
    arg_lists[vllm_version] = {"nargs_passed": len(args), "err": err,
                               "kernel_calls": aiter.calls[n_before:]}
    # without the shim, the same call straight into this AITER:
    try:
        aiter.mla_reduce_v1(*args)
        arg_lists[vllm_version]["unshimmed"] = "ok"
    except Exception as exc:
        arg_lists[vllm_version]["unshimmed"] = f"{type(exc).__name__}: {exc}"[:200]
result["calls"] = arg_lists
result["split_tiles"] = plan.num_split_tiles
print(json.dumps(result))
"""


@pytest.mark.parametrize("variant,nargs", [("legacy", 8), ("num_kv_splits", 9)])
def test_real_aiter_mla_impl_reduce_works_with_both_aiter_schemas(tmp_path, variant, nargs):
    proc = run_python(SCRIPT.replace("sys.argv[1], sys.argv[2]", f"{str(tmp_path)!r}, {variant!r}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["split_tiles"] > 0  # else the reduce would have nothing to merge
    assert got["fp8_prefill_enabled"] and got["shim_marker"] and got["bound_to_shim"]
    for version, call in got["calls"].items():
        assert call["err"] < 1e-2, (version, call)
        # the kernel saw the installed AITER's own convention, whatever vLLM passed
        assert [c["nargs"] for c in call["kernel_calls"]] == [nargs], call
    # and unshimmed, one of vLLM's two call forms breaks against this AITER
    broken = "0.25" if variant == "legacy" else "0.24"
    assert got["calls"][broken]["unshimmed"] != "ok"
    info = [line for line in proc.stderr.splitlines() if "AiterMLAImpl._mla_reduce_v1 now calls" in line]
    assert len(info) == 1 and " INFO " in info[0] and variant in info[0], proc.stderr[-2000:]


def test_shim_off_leaves_aiter_mla_impl_untouched(tmp_path):
    script = SCRIPT.replace("sys.argv[1], sys.argv[2]", f"{str(tmp_path)!r}, 'num_kv_splits'")
    script = script.split("H, DV, TILE")[0] + (
        "print(json.dumps({'marker': getattr(AiterMLAImpl.__init__, '_mla_plugins_shim', False)}))\n")
    proc = run_python(script, env={"MLA_PLUGINS_SHIM": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"marker": False}
