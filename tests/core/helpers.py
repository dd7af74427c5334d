"""Shared builders for the core tests: random varlen batches, never zeros."""

from __future__ import annotations

import torch

from mla_plugins.core.reference import relative_error

BF16_TOL = 1e-2
FP8_TOL = 6e-2


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def random_batch(lens_q, lens_k, heads, *, dqk=192, dv=128, dtype=torch.bfloat16, scale=1.0,
                 seed=None, device="cpu"):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    tq, tk = sum(lens_q), sum(lens_k)
    mk = lambda n, d: (torch.randn(n, heads, d, generator=gen) * scale).to(device, dtype)
    return mk(tq, dqk), mk(tk, dqk), mk(tk, dv), cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)


def vllm_v_view(v: torch.Tensor) -> torch.Tensor:
    """v [T, H, 128] as vLLM's prefill passes it: the [..., 128:] half of kv_b_proj's
    [T, H, 256] output (k_nope, then v), a view with head stride 256 (same values)."""
    return torch.cat((torch.randn_like(v), v), dim=-1)[..., 128:]


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


#: (q lengths, k lengths) that every kernel is checked on: tile edges, cached prefixes,
#: rows that see no key (k_len < q_len, bottom-right), one sequence over several tiles
LENGTH_CASES = {
    "edge lengths": ([0, 1, 255, 256, 257, 300], [0, 1, 255, 256, 257, 300]),
    "cached prefix": ([1, 200, 257], [129, 700, 513]),
    "no key for early rows": ([300, 5], [100, 0]),
    "single long": ([600], [600]),
}


def check_attention(out, lse, ref_out, ref_lse, tol, *, error=relative_error) -> float:
    """Every element written, rows that see no key give 0 and -inf, errors within `tol`."""
    assert not torch.isnan(out).any(), "output has NaN (unwritten or invalid)"
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten or invalid)"
    err = error(out, ref_out)
    assert err <= tol, f"output relative error {err:.3e} > {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows that see no key must have lse -inf, others finite"
    assert (lse[~finite] == float("-inf")).all()
    assert (out[~finite] == 0).all(), "rows that see no key must output 0"
    if finite.any():
        lerr = error(lse[finite], ref_lse[finite])
        assert lerr <= tol, f"lse relative error {lerr:.3e} > {tol}"
    return err
