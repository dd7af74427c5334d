"""How the FA3 provider's tests drive it against these fakes on the CPU (shared by
tests/core/test_flash_attn.py and tests/vllm/test_flash_attn_vllm.py): the real schemas' slot
positions, fresh random batches, a run through the public API into a NaN-filled out, and the
float64 comparison."""

from __future__ import annotations

import re

import torch

import mla_plugins
from mla_plugins.core.kernels import flash_attn
from mla_plugins.core.reference import relative_error

from . import kernel as fake
from . import schemas

NEG_INF = float("-inf")

#: namespace of each build's op (the real builds' TORCH_LIBRARY names)
NAMESPACE = {"fa3_fwd": "fa3_fwd", "flash_attn_3": "flash_attn_3", "sgl_kernel": "sgl_kernel",
             "vllm": "_vllm_fa3_C"}
SCHEMA = {"fa3_fwd": schemas.FA3_FWD_0_0_3, "flash_attn_3": schemas.FA3_HEAD,
          "sgl_kernel": schemas.SGL_KERNEL_0_4_10, "vllm": schemas.VLLM_FA3}
#: the schema position of each argument the provider fills per call, read off the real
#: schemas (identical in the four builds up to is_causal)
POSITIONS = {"q": 0, "k": 1, "v": 2, "out": 6, "cu_seqlens_q": 7, "cu_seqlens_k": 8,
             "max_seqlen_q": 12, "max_seqlen_k": 13, "q_descale": 20, "k_descale": 21,
             "v_descale": 22, "softmax_scale": 23, "is_causal": 24}
#: what every other argument may be for a plain varlen forward (FA3's semantics: no optional
#: tensor, no window, no chunking, no softcap, no sink, no context parallelism)
PLAIN = {"window_size_left": {-1}, "window_size_right": {-1}, "attention_chunk": {0},
         "softcap": {0.0}, "num_splits": {0, 1}, "pack_gqa": {None, False}, "sm_margin": {0},
         "cp_world_size": {1}, "cp_rank": {0}, "only_qv": {False},
         "is_rotary_interleaved": {True, False}}


def schema_names(schema: str) -> list[str]:
    """Argument names of a schema string, in order (read from the text, not from torch)."""
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    return [re.split(r"\s*=", part.strip())[0].split()[-1] for part in inner.split(",")]


def schema_has_defaults(schema: str) -> list[bool]:
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    return ["=" in part for part in inner.split(",")]


def usable(name: str) -> flash_attn.Binding:
    b = flash_attn.binding()
    looked = "; ".join(x.describe() for x in flash_attn.bindings())
    assert b is not None, f"no usable FA3 binding; looked at: {looked}"
    assert b.name == name, f"bound {b.name!r}, expected {name!r}; looked at: {looked}"
    return b


def by_name(name: str) -> flash_attn.Binding:
    return next(b for b in flash_attn.bindings() if b.name == name)


# -- inputs and runs ---------------------------------------------------------------------


def batch(lens, heads, *, dqk=192, dv=128, dtype=torch.bfloat16, seed):
    """Fresh Gaussian q, k, v for (q_len, k_len) pairs; host offsets."""
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    q = torch.randn(tq, heads, dqk, generator=gen).to(dtype)
    k = torch.randn(tk, heads, dqk, generator=gen).to(dtype)
    v = torch.randn(tk, heads, dv, generator=gen).to(dtype)
    cq, ck = [0], [0]
    for a, b in lens:
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + b)
    return q, k, v, cq, ck


def run(q, k, v, cq, ck, *, fp8, rotate=None, causal=True, scale=None, namespace=None):
    """plan_prefill + mla_prefill pinned to flash_attn on the CPU, into a NaN-filled out.
    Checks the call reached the fake op (one more recorded call) when there are keys."""
    heads = q.shape[1]
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=heads, causal=causal, device="cpu",
                                    dtype=q.dtype, fp8=fp8, head_dim_qk=q.shape[2],
                                    head_dim_v=v.shape[2], kernel="flash_attn")
    assert plan.kernel == "flash_attn"
    calls = fake.CALLS.get(namespace, []) if namespace else None
    seen = len(calls) if calls is not None else 0
    out = torch.full((q.shape[0], heads, v.shape[2]), float("nan"), dtype=q.dtype)
    result = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=fp8,
                                     fp8_rotate=rotate, causal=causal, softmax_scale=scale,
                                     out=out, return_lse=True)
    got, lse = result
    assert got is out, "mla_prefill must return the out it was given"
    if namespace and q.shape[0] and k.shape[0]:
        assert len(fake.CALLS[namespace]) == seen + 1, f"the call did not reach {namespace}::fwd"
    return got, lse


def check(out, lse, ref_out, ref_lse, tol, what=""):
    assert not torch.isnan(out).any(), f"{what}: output has NaN (unwritten rows or invalid values)"
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN"
    err = relative_error(out, ref_out)
    assert err <= tol, f"{what}: output relative L2 error {err:.3e} > {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), (
        f"{what}: rows that see no key must have lse -inf and all others a finite lse; "
        f"got {int((~torch.isfinite(lse)).sum())} non-finite, expected {int((~finite).sum())}")
    assert (lse[~finite] == NEG_INF).all(), f"{what}: rows that see no key must have lse -inf (not +inf)"
    assert (out[~finite] == 0).all(), f"{what}: rows that see no key must output exactly 0"
    if finite.any():
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=2e-5,
                                   msg=lambda m: f"{what}: lse differs from float64: {m}")


#: arguments where mla-plugins and vLLM's own FA3 call may differ without changing the result:
#: is_rotary_interleaved (no rotary tensors are passed: unread), num_splits (vLLM passes 0,
#: FA3's split heuristic; the provider 1 where a plan asks for batch invariance: the same
#: attention, one kernel, no combine), scheduler_metadata (the provider's, made by
#: get_scheduler_metadata from the call's own arguments, which the fake forward checks; vLLM's
#: flash_attn_varlen_func passes None unless given one: FA3 then makes the same schedule itself)
VLLM_CALL_MAY_DIFFER = {"is_rotary_interleaved", "num_splits", "scheduler_metadata"}


def compare_with_vllm_call(flash_attn_varlen_func, *, fp8: bool, seed: int) -> None:
    """One request through the provider, then the same tensors through vLLM's own
    `flash_attn_varlen_func(..., fa_version=3)`; both reach the fake `_vllm_fa3_C::fwd`, which
    records the argument lists. Every argument the provider fills must sit where vLLM puts it
    (the same object), every other one must equal vLLM's (but VLLM_CALL_MAY_DIFFER), and the
    two outputs must be bit-identical."""
    lens = [(5, 5), (3, 9), (6, 2), (0, 4)]
    q, k, v, cq, ck = batch(lens, 4, seed=seed)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None, scale=0.06,
                   namespace="_vllm_fa3_C")
    ours = list(fake.CALLS["_vllm_fa3_C"][-1])
    p = POSITIONS
    out2 = torch.full_like(out, float("nan"))
    descales = {}
    if fp8:
        descales = dict(q_descale=ours[p["q_descale"]], k_descale=ours[p["k_descale"]],
                        v_descale=ours[p["v_descale"]])
    out_v, lse_v = flash_attn_varlen_func(
        ours[p["q"]], ours[p["k"]], ours[p["v"]], ours[p["max_seqlen_q"]], ours[p["cu_seqlens_q"]],
        ours[p["max_seqlen_k"]], cu_seqlens_k=ours[p["cu_seqlens_k"]], softmax_scale=0.06,
        causal=True, out=out2, return_softmax_lse=True, fa_version=3, **descales)
    theirs = list(fake.CALLS["_vllm_fa3_C"][-1])
    names = schema_names(schemas.VLLM_FA3)
    assert len(ours) == len(theirs) == len(names)
    for slot, i in p.items():
        if slot == "out":
            assert theirs[i] is out2 and ours[i] is out, "out: each call's own buffer at position 6"
        elif slot in descales or slot in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"):
            assert theirs[i] is ours[i], f"{slot}: vLLM passes it at position {i}, mla-plugins does not"
        elif not fp8 and slot.endswith("_descale"):
            assert ours[i] is None and theirs[i] is None, f"{slot}: None without fp8"
        else:
            assert ours[i] == theirs[i], f"{slot} (position {i}): ours {ours[i]!r}, vLLM's {theirs[i]!r}"
    slots = set(p.values())
    differ = {names[i]: (ours[i], theirs[i]) for i in range(len(names))
              if i not in slots and not (ours[i] is theirs[i] or ours[i] == theirs[i])}
    assert set(differ) <= VLLM_CALL_MAY_DIFFER, f"arguments that differ from vLLM's own call: {differ}"
    assert out_v is out2
    assert torch.equal(out, out2), "the same FA3 call must give the same output"
    assert torch.equal(lse, lse_v.t()), "the provider's lse is FA3's, transposed"
