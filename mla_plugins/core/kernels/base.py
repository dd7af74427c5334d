"""What every kernel provider implements, and the inputs it is asked about.

A kernel is a class in the style of xformers' fmha ops: it declares what it supports
(devices, dtypes, head dims, head counts) and answers `not_supported_reasons(inputs)`
with every reason it cannot run them. The dispatcher (`core/registry.py`) only ever
talks to kernels through this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ..device import device_kind

if TYPE_CHECKING:
    from ..plan import PrefillPlan


@dataclass(frozen=True)
class PrefillInputs:
    """Validated arguments of one `mla_prefill` call.

    q: [total_q, H, Dqk], k: [total_k, H, Dqk], v: [total_k, H, Dv] (bf16 or fp16).
    cu_seqlens_q / cu_seqlens_k: int32 [B+1] on the same device as q.
    `fp8_dtype` is the float8 format the device computes in when `fp8` is set.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    softmax_scale: float
    causal: bool
    fp8: bool
    fp8_dtype: torch.dtype
    max_seqlen_q: int
    max_seqlen_k: int
    #: host copies of (cu_seqlens_q, cu_seqlens_k) when the caller already read them
    seqlens_host: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    op: ClassVar[str] = "prefill"

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim_qk(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[2]

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


@dataclass(frozen=True)
class ReduceInputs:
    """Validated arguments of one `mla_reduce` call (AITER's post-#3391 order).

    partial_out: fp32 [P, H, Dv], partial_lse: fp32 [P, H],
    reduce_indptr: int32 [T+1], reduce_final_map: int32 [T, 2] or None,
    reduce_partial_map: int32 [n], out: [total_q, H, Dv] bf16/fp16, final_lse: fp32 [total_q, H] or None.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final_map: torch.Tensor | None
    reduce_partial_map: torch.Tensor
    tile_q: int
    num_kv_splits: int
    out: torch.Tensor
    final_lse: torch.Tensor | None
    op: ClassVar[str] = "reduce"

    @property
    def device(self) -> torch.device:
        return self.out.device

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    @property
    def num_heads(self) -> int:
        return self.out.shape[1]

    @property
    def head_dim_v(self) -> int:
        return self.out.shape[2]


@dataclass(frozen=True)
class ConfigInputs:
    """A configuration without tensors, for framework-side `validate_configuration` checks."""

    num_heads: int
    head_dim_qk: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    fp8: bool
    op: ClassVar[str] = "config"


Inputs = PrefillInputs | ReduceInputs | ConfigInputs


@dataclass(frozen=True)
class KernelInfo:
    """One row of `available_kernels()`."""

    name: str
    available: bool
    reasons: list[str] = field(default_factory=list)
    description: str = ""


class Kernel:
    """Base class of kernel providers.

    Subclasses set the capability attributes and implement `prefill` and `reduce`;
    `not_supported_reasons` checks the declared capabilities and adds `extra_reasons`.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: lower runs first under kernel="auto"
    priority: ClassVar[int] = 100
    #: "cpu", "cuda" (NVIDIA) and/or "rocm" (AMD, torch.version.hip)
    devices: ClassVar[frozenset[str]] = frozenset()
    #: input/output dtypes (q, k, v, out)
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.bfloat16, torch.float16})
    supports_fp8: ClassVar[bool] = True
    supports_bf16_compute: ClassVar[bool] = True
    #: None = any value
    head_dims_qk: ClassVar[frozenset[int] | None] = None
    head_dims_v: ClassVar[frozenset[int] | None] = None
    num_heads: ClassVar[frozenset[int] | None] = None

    # -- capability checks -------------------------------------------------------------
    def environment_reasons(self) -> list[str]:
        """Why this kernel cannot run in this process at all (missing library, ...)."""
        return []

    def device_reasons(self, device: torch.device) -> list[str]:
        """Why it cannot run on `device` beyond the device kind (arch, compute capability)."""
        return []

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        return []

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        reasons = list(self.environment_reasons())
        reasons += self._device_kind_reasons(inputs.device)
        if inputs.dtype not in self.dtypes:
            reasons.append(f"dtype {inputs.dtype} not supported (supports {_names(self.dtypes)})")
        if inputs.op != "reduce":
            if inputs.fp8 and not self.supports_fp8:
                reasons.append("fp8=True not supported")
            if not inputs.fp8 and not self.supports_bf16_compute:
                reasons.append("fp8=False not supported (this kernel computes in fp8 only)")
            if self.head_dims_qk is not None and inputs.head_dim_qk not in self.head_dims_qk:
                reasons.append(
                    f"query/key head dim {inputs.head_dim_qk} not supported "
                    f"(supports {sorted(self.head_dims_qk)})"
                )
        if self.head_dims_v is not None and inputs.head_dim_v not in self.head_dims_v:
            reasons.append(
                f"value head dim {inputs.head_dim_v} not supported (supports {sorted(self.head_dims_v)})"
            )
        if self.num_heads is not None and inputs.num_heads not in self.num_heads:
            reasons.append(
                f"{inputs.num_heads} heads not supported (supports {sorted(self.num_heads)})"
            )
        if not reasons:
            reasons += self.extra_reasons(inputs)
        return reasons

    # -- work ----------------------------------------------------------------------------
    def plan_params(self, inputs: PrefillInputs) -> dict:
        """Keyword arguments for `plan_prefill` when the caller passed no plan."""
        return {}

    def run(
        self,
        inputs: PrefillInputs,
        plan: PrefillPlan | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """The whole prefill: plan (unless given), phase 1, then the reduce of split tiles.

        A kernel with its own scheduler (AITER) overrides this; the others implement
        `prefill` and `reduce` on the core's plan.
        """
        from ..plan import cached_plan

        if plan is None:
            plan = cached_plan(inputs, self.plan_params(inputs))
        rows = plan.partial_rows()
        heads, dv = inputs.num_heads, inputs.head_dim_v
        partial_out = torch.empty((rows, heads, dv), dtype=torch.float32, device=inputs.device)
        partial_lse = torch.empty((rows, heads), dtype=torch.float32, device=inputs.device)
        self.prefill(inputs, plan, out, lse, partial_out, partial_lse)
        if plan.num_partial_tiles:
            self.reduce(
                ReduceInputs(
                    partial_out=partial_out,
                    partial_lse=partial_lse,
                    reduce_indptr=plan.reduce_indptr,
                    reduce_final_map=plan.reduce_final_map,
                    reduce_partial_map=plan.reduce_partial_map,
                    tile_q=plan.tile_q,
                    num_kv_splits=0,
                    out=out,
                    final_lse=lse,
                )
            )

    def prefill(
        self,
        inputs: PrefillInputs,
        plan: PrefillPlan,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        partial_out: torch.Tensor,
        partial_lse: torch.Tensor,
    ) -> None:
        """Phase 1 over the plan's work items.

        A work item whose `partial_o_loc` is -1 writes its rows straight to
        `out` [total_q, H, Dv] (and `lse` [total_q, H] if given); a piece of a split
        tile writes its slice-normalized output and natural-log LSE to
        `partial_out` [P*tile_q, H, Dv] / `partial_lse` [P*tile_q, H] at rows
        `partial_o_loc + (row - qo_start)`. The core then calls `reduce`.
        """
        raise NotImplementedError

    def reduce(self, inputs: ReduceInputs) -> None:
        """Phase 2: merge the pieces of each split tile by log-sum-exp into `inputs.out`."""
        raise NotImplementedError

    def info(self, device: torch.device) -> KernelInfo:
        reasons = list(self.environment_reasons())
        if not reasons:
            reasons += self._device_kind_reasons(device)
        return KernelInfo(self.name, not reasons, reasons, self.description)

    def _device_kind_reasons(self, device: torch.device) -> list[str]:
        kind = device_kind(device)
        if kind not in self.devices:
            return [f"device {kind} not supported (supports {sorted(self.devices)})"]
        if kind in ("cuda", "rocm") and not torch.cuda.is_available():
            # asked about a GPU configuration from a process that has none (config checks)
            return [f"no {kind} device is visible to this torch ({torch.__version__})"]
        return self.device_reasons(device)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _names(dtypes) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in dtypes)
