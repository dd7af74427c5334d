"""Argument checks shared by the public API. Every message names the argument, what was
found and what was expected, so a framework user can act on it without reading our code."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16)


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: found {type(value).__name__} {value!r}, expected a positive int")
    if value < 1:
        raise ValueError(f"{name}: found {value}, expected a positive int")


def check_tensor(name: str, t, *, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: found {type(t).__name__}, expected a torch.Tensor")
    if t.dim() != ndim:
        raise ValueError(f"{name}: found shape {tuple(t.shape)} ({t.dim()}-D), expected {ndim}-D")
    if dtypes is not None and t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: found dtype {t.dtype}, expected {expected}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name}: found device {t.device}, expected {reference.device} "
                f"(the device of {reference_name}); move it with .to({str(reference.device)!r})"
            )


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k) -> tuple[list[int], list[int]]:
    """Both int32 1-D [B+1], same length and device, starting at 0, non-decreasing.

    Returns their host copies (one device sync each), so callers need not read them again.
    """
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int32,))
        if t.numel() < 1:
            raise ValueError(f"{name}: found an empty tensor, expected [batch + 1] offsets from 0")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_k: found shape {tuple(cu_seqlens_k.shape)}, expected "
            f"{tuple(cu_seqlens_q.shape)} like cu_seqlens_q (one offset per sequence + 1)"
        )
    check_same_device("cu_seqlens_q", cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    hosts = []
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        host = t.tolist()
        hosts.append(host)
        if host[0] != 0:
            raise ValueError(f"{name}: found first offset {host[0]}, expected 0")
        for i in range(1, len(host)):
            if host[i] < host[i - 1]:
                raise ValueError(
                    f"{name}: found decreasing offsets {host[i - 1]} -> {host[i]} at index {i}, "
                    "expected non-decreasing cumulative sequence lengths"
                )
    return hosts[0], hosts[1]


def check_nonnegative_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: found {type(value).__name__} {value!r}, expected an int >= 0")
    if value < 0:
        raise ValueError(f"{name}: found {value}, expected an int >= 0 (0 = kernel default)")
