"""The AITER provider takes every buffer of a planned call from the reusable workspace.

Against the source-faithful fakes (tests/fakes/fake_aiter.py), in a fresh process per case
as in test_aiter.py. A TorchDispatchMode sees every op the provider dispatches (the fake
AITER ops run inside it as one op each, as the real kernels would) and flags any result
whose storage is neither a call tensor nor the workspace: a planned call must allocate
nothing there. What the real kernels add: their own device scratch (none documented for
mla_prefill_ps_asm_fwd / mla_reduce_v1 beyond the buffers passed in), and the torch ops'
internal reduction scratch on a GPU, which no dispatch mode sees.
"""

from __future__ import annotations

import pytest

from tests.core.test_aiter import run_fresh

WORKSPACE = """
import aiter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from mla_plugins.core import workspace as wsmod
ak = pretend_gfx950()
Hq = int(os.environ["HEADS"])
CPU = torch.device("cpu")

class Allocations(TorchDispatchMode):
    # storages of op results that existed before the call: the call's tensors, the workspace
    def __init__(self, known):
        super().__init__()
        self.known, self.new = known, {}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        for t in tree_leaves(res):
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.known:
                    self.new.setdefault(ptr, f"{func} -> {tuple(t.shape)} {t.dtype}")
        return res

def storage(t):
    return t.untyped_storage().data_ptr()

def batch(lens_q, lens_k):
    cq, ck = offsets(lens_q), offsets(lens_k)
    return cq, ck

def inputs(cq, ck):
    mk = lambda n, d: torch.randn(n, Hq, d, generator=gen).bfloat16()
    return mk(int(cq[-1]), 192), mk(int(ck[-1]), 192), mk(int(ck[-1]), 128)

def poison_shared():
    buf = wsmod.get_workspace(CPU).buffer
    if buf is not None:
        buf.fill_(255)  # NaN in bf16, fp32 and e4m3fn

def call(plan, cq, ck, lse, workspace=None):
    # fresh random q, k, v (a new layer), a poisoned out; returns (errors, allocations)
    q, k, v = inputs(cq, ck)
    ref_out, ref_lse = ref64(fp8_round(q), fp8_round(k), fp8_round(v), cq, ck, True)
    seen = torch.isfinite(ref_lse)
    out = torch.full((q.shape[0], Hq, 128), float("nan"), dtype=torch.bfloat16)
    shared = wsmod.get_workspace(CPU).buffer
    known = {storage(t) for t in (q, k, v, out) + ((shared,) if shared is not None else ())
             + ((workspace,) if workspace is not None else ())}
    mode = Allocations(known)
    with mode:
        got = mla_plugins.mla_prefill(q, k, v, plan=plan, out=out, return_lse=lse, workspace=workspace)
    got_out, got_lse = got if lse else (got, None)
    if got_lse is not None:
        mode.new.pop(storage(got_lse), None)  # the lse asked for is the call's one result
    err = [relative_error(got_out, ref_out)]
    if lse:
        err.append((got_lse.double()[seen] - ref_lse[seen]).abs().max().item())
        err.append(bool(torch.isneginf(got_lse[~seen]).all()))
    err.append(bool(torch.isnan(got_out).any()) or (lse and bool(torch.isnan(got_lse).any())))
    return err, sorted(mode.new.values())

def views(plan, lse):
    memo = plan.memo.get(("aiter_scratch", lse))
    return {n: (t.data_ptr(), tuple(t.shape)) for n, t in memo[6].items()}

# A: rows that see no key, tile boundaries, a split tile; B: a larger batch
cq_a, ck_a = batch([100, 300, 1, 520, 5, 257], [100, 200, 40, 700, 3, 300])
cq_b, ck_b = batch([1600, 700, 256], [1700, 700, 300])
plan_a = mla_plugins.plan_prefill(cq_a, ck_a, num_heads=Hq, kernel="aiter")
plan_b = mla_plugins.plan_prefill(cq_b, ck_b, num_heads=Hq, kernel="aiter")
result["kernels"] = [plan_a.kernel, plan_b.kernel]
mla_plugins.reserve_workspace(CPU, plan_a.workspace_bytes)
ws = wsmod.get_workspace(CPU)
gen0, size0 = ws.generation, ws.buffer.numel()

# first calls of the plan: no-lse metadata was planned with the plan, so nothing to allocate;
# with lse the metadata is planned on first use (host work), never the workspace
runs = {}
for lse in (False, True):
    runs[lse] = []
    for layer in range(3):
        poison_shared()
        runs[lse].append(call(plan_a, cq_a, ck_a, lse))
    result[f"allocs_{lse}"] = [r[1] for r in runs[lse][1:]]
result["first_lse_allocs"] = runs[True][0][1] != []
result["errs"] = [r[0] for rs in runs.values() for r in rs]
result["grew_for_a"] = (ws.generation, ws.buffer.numel()) != (gen0, size0)
result["first_no_lse_allocs"] = runs[False][0][1]
# the views of each mode lie in the reserved buffer and stay put across layers
base, end = ws.buffer.data_ptr(), ws.buffer.data_ptr() + ws.buffer.numel()
result["inside"] = all(base <= ptr < end for lse in (False, True) for ptr, _ in views(plan_a, lse).values())
same = views(plan_a, False)
call(plan_a, cq_a, ck_a, False)
result["same_views"] = views(plan_a, False) == same

# B needs more: the shared workspace grows once, then A's views are carved anew from it
poison_shared()
result["b"] = [call(plan_b, cq_b, ck_b, lse) for lse in (False, True, True)]
result["grew_for_b"] = ws.generation > gen0 and ws.buffer.numel() > size0
poison_shared()
result["a_after_b"] = [call(plan_a, cq_a, ck_a, lse) for lse in (False, True)]
base, end = ws.buffer.data_ptr(), ws.buffer.data_ptr() + ws.buffer.numel()
result["a_moved"] = all(base <= ptr < end for ptr, _ in views(plan_a, False).values())

# a caller's buffer of exactly plan.workspace_bytes serves both modes, poisoned
own = torch.full((plan_a.workspace_bytes,), 255, dtype=torch.uint8)
result["own"] = [call(plan_a, cq_a, ck_a, lse, workspace=own) for lse in (False, True, False)]
o0, o1 = own.data_ptr(), own.data_ptr() + own.numel()
result["own_inside"] = all(o0 <= ptr < o1 for lse in (False, True) for ptr, _ in views(plan_a, lse).values())
result["asm_split_rows"] = sorted({c["split_rows"] for c in aiter.all_calls if c["op"] == "mla_prefill_ps_asm_fwd"})
"""


def _check_errs(errs):
    for e in errs:
        assert e[0] <= 1e-2, errs  # out vs float64 on fp8-rounded inputs
        assert not e[-1], errs  # no NaN from the poisoned workspace
        if len(e) == 4:
            assert e[1] <= 2e-3 and e[2], errs  # lse, and -inf where no key is visible


@pytest.mark.parametrize("variant,heads", [("legacy", 12), ("need_lse", 16)])
def test_aiter_planned_calls_take_everything_from_the_workspace(tmp_path, variant, heads):
    """legacy + 12 heads: padded to 16 (padded output and lse buffers), lse by the host
    routing (one-piece groups copied through the workspace); need_lse + 16 heads: written
    straight into out / lse, lse by AITER's planner. Both: buffers reused across layers and
    calls, no allocation outside the workspace after the plan, the reserved size enough for
    both lse modes, grown for a larger plan, a caller's buffer of plan.workspace_bytes
    enough, poisoned buffers never reaching a result, every result equal to float64."""
    r = run_fresh(tmp_path, variant, WORKSPACE, FAKE_AITER_CU_COUNT="5", HEADS=str(heads))
    assert r["kernels"] == ["aiter", "aiter"]
    _check_errs(r["errs"])
    for lse in ("False", "True"):
        assert r[f"allocs_{lse}"] == [[], []], r[f"allocs_{lse}"]
    assert r["first_no_lse_allocs"] == [], r["first_no_lse_allocs"]
    assert r["first_lse_allocs"]  # the lse metadata is planned on first use (host buffers)
    assert not r["grew_for_a"]  # plan_a.workspace_bytes bounds the lse mode too
    assert r["inside"] and r["same_views"]
    _check_errs([e for e, _ in r["b"]])
    assert [a for _, a in r["b"]][2] == []
    assert r["grew_for_b"]
    _check_errs([e for e, _ in r["a_after_b"]])
    assert all(a == [] for _, a in r["a_after_b"]) and r["a_moved"]
    _check_errs([e for e, _ in r["own"]])
    assert [a for _, a in r["own"]][2] == [] and r["own_inside"]
    # the partial buffers are exact (reduce_indptr[-1] tiles), not the workspace's bound
    assert all(rows % 256 == 0 for rows in r["asm_split_rows"])
