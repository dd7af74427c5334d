"""Shared builders for the core tests: random varlen batches, never zeros."""

from __future__ import annotations

import torch

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


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
