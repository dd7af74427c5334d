"""Dynamic per-tensor FP8 quantization, the rule every kernel follows.

scale = amax(|x|) / max_finite(fp8_dtype) (1 when x is all zeros), x_fp8 = (x / scale) cast
to fp8, dequantized = x_fp8 * scale. Scaling by amax means the largest element maps to
the largest finite fp8 value: nothing saturates and nothing becomes NaN, however large
the input (AITER's callers pass unit scales and rely on saturation instead).
"""

from __future__ import annotations

import torch


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


def fp8_scale(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 scalar tensor on x's device: amax / fp8 max, or 1 for an all-zero x."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return torch.where(amax > 0, amax / fp8_max(fp8_dtype), torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, scale): x_fp8 has x's shape in `fp8_dtype`, scale is a float32 scalar tensor."""
    scale = fp8_scale(x, fp8_dtype)
    limit = fp8_max(fp8_dtype)
    # The clamp only guards rounding at the top of the range (x / scale <= limit in exact math).
    q = (x.float() / scale).clamp_(-limit, limit).to(fp8_dtype)
    return q, scale


def dequantize_fp8(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() * scale
