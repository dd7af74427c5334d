"""The AITER shim through SGLang's real aiter backend module, with faithful fake AITERs.

Path tested: SGLang 0.5.23's real `sglang.srt.layers.attention.aiter_backend` module and its
real `AiterAttnBackend._mla_fp8_prefill_attn_ps` (the 9-argument call, 0.5.15+), plus the
exact 8-argument list 0.5.12 passes, through the module attribute the shim rebinds.

The fakes (`tests.fakes.fake_aiter`) carry AITER's legacy and num_kv_splits
torch-op schemas and the FP8 prefill trio; they lack AITER's other kernels, so the module's
`from aiter import (...)` falls into its ImportError branch. The test then binds the four
names that import would have bound (the prefill trio and `mla_reduce_v1`) from the fake, as
the real import does, before the shim runs. What the real kernels add: see fake_aiter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import json, sys, types, torch
from tests.fakes import fake_aiter
fake_aiter.install(sys.argv[1], sys.argv[2])
import aiter
import mla_plugins
import mla_plugins.sglang as adapter

adapter.register()                      # AITER usable -> the shim waits for the module
from mla_plugins.sglang import shim
before_import = shim.install_aiter_shim()
import sglang.srt.layers.attention.aiter_backend as ab
deferred_bound = ab.__dict__.get("mla_reduce_v1") is mla_plugins.aiter_mla_reduce_v1
if not deferred_bound:                  # MLA_PLUGINS_SHIM=0: what `from aiter import` binds
    ab.mla_reduce_v1 = aiter.mla_reduce_v1
for name in ("mla_prefill_ps_asm_fwd", "get_ps_metadata_info_v1", "get_ps_metadata_v1"):
    setattr(ab, name, getattr(aiter, name))

H, T = 16, 300                          # 300 rows: two 256-row tiles; 6 fake CUs split KV
lens = [300]
gen = torch.Generator().manual_seed(5)
q = torch.randn(T, H, 192, generator=gen).to(torch.bfloat16)
k = torch.randn(T, H, 192, generator=gen).to(torch.bfloat16)
v = torch.randn(T, H, 128, generator=gen).to(torch.bfloat16)
cu = torch.tensor([0, T], dtype=torch.int32)
holder = types.SimpleNamespace(fp8_prefill_num_head=H, fp8_prefill_num_kv_head=H, device="cpu",
                               input_dtype=torch.bfloat16, pad_heads=None)
bufs = ab.AiterAttnBackend.make_mla_prefill_ps_meta_data_buffer(holder, 1, T, 256)
work_meta, work_indptr, work_info, r_indptr, r_final, r_partial = bufs
aiter.get_ps_metadata_v1(cu, cu, cu[1:], 1, H, work_meta, work_indptr, work_info, r_indptr, r_final,
                         r_partial, qhead_granularity=1, qlen_granularity=256, kvlen_granularity=128,
                         block_size=1, is_causal=True)
n_partial = int(r_indptr[-1])
ps = ab.MlaPrefillPsMetadata(qo_indptr=cu, kv_indptr=cu, kv_indices=torch.arange(T, dtype=torch.int32),
                             work_metadata=work_meta, work_indptr=work_indptr, work_info_set=work_info,
                             reduce_indptr=r_indptr, reduce_final_map=r_final, reduce_partial_map=r_partial,
                             max_q_len=T, is_causal=True, need_lse=False, num_partial_tiles=n_partial)
layer = types.SimpleNamespace(tp_q_head_num=H, v_head_dim=128, scaling=192 ** -0.5)
result = {"before_import": before_import, "deferred_bound": deferred_bound, "n_partial": n_partial}
try:
    out, _ = ab.AiterAttnBackend._mla_fp8_prefill_attn_ps(holder, q, k, v, layer, ps)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * 192 ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.double())
    result["rel_l2_9arg"] = ((out.double() - ref).norm() / ref.norm()).item()
    # 0.5.12's exact call: (logits, attn_lse, reduce_indptr, reduce_final_map,
    # reduce_partial_map, tile_q, output, final_lse) on fresh random partials.
    P = max(n_partial, 1) * 256
    logits = torch.randn(P, H, 128, generator=gen)
    lse = torch.randn(P, H, generator=gen)
    out8 = torch.full((T, H, 128), float("nan"), dtype=torch.bfloat16)
    ab.mla_reduce_v1(logits, lse, r_indptr, r_final, r_partial, 256, out8, None)
    expect = torch.full_like(out8, float("nan"))
    from mla_plugins.core.reduce import torch_reduce
    torch_reduce(logits, lse, r_indptr, r_final, r_partial, 256, expect, None)
    written = ~torch.isnan(expect)
    result["reduce_8arg_ok"] = bool(torch.equal(out8[written], expect[written]) and written.any())
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
result["calls"] = aiter.calls
print(json.dumps(result))
"""


def run_variant(tmp_path, variant, **env):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "fake"), variant],
                          env={**os.environ, "SGLANG_PLUGINS": "", **env}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant,splits", [("legacy", None), ("num_kv_splits", 0)])
def test_sglang_aiter_backend_runs_on_both_aiter_conventions(tmp_path, variant, splits):
    r = run_variant(tmp_path, variant)
    assert r["before_import"] == "deferred" and r["deferred_bound"], r
    assert "error" not in r, r["error"]
    assert r["n_partial"] > 0  # the plan really split KV, so the reduce really ran
    assert r["rel_l2_9arg"] <= 6e-2
    assert r["reduce_8arg_ok"]
    # Both reduces reached the fake op in the installed AITER's own schema: no num_kv_splits
    # for the legacy op, SGLang's 0 for the new one (the 8-argument call included).
    assert len(r["calls"]) == 2 and all(c["num_kv_splits"] == splits for c in r["calls"])


def test_shim_off_leaves_sglang_calling_aiter_as_it_does(tmp_path):
    """MLA_PLUGINS_SHIM=0 with a pre-#3391 AITER: SGLang 0.5.23's 9-argument call fails with
    AITER's own error, the bug the shim exists for."""
    r = run_variant(tmp_path, "legacy", MLA_PLUGINS_SHIM="0")
    assert r["before_import"] == "disabled" and not r["deferred_bound"]
    assert "error" in r and "final_output" in r["error"], r
