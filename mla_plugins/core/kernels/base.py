"""What every kernel provider implements, and the inputs it is asked about.

A kernel is a class in the style of xformers' fmha ops: it declares what it supports
(devices, dtypes, head dims, head counts) and answers `not_supported_reasons(inputs)`
with every reason it cannot run them. The dispatcher (`core/registry.py`) only ever
talks to kernels through this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from ..device import device_kind, fp8_dtype_for
from ..workspace import ALIGN, carve_views, next_token, workspace_size

if TYPE_CHECKING:
    from ..plan import PrefillPlan


@dataclass(slots=True)
class PrefillInputs:
    """Validated arguments of one `mla_prefill` call (not frozen: built on every call, and a
    frozen dataclass sets each field through object.__setattr__).

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
    #: fp8: q and k are rotated before the cast (core/fp8.py's rotation), resolved from the
    #: call's `fp8_rotate` and MLA_PLUGINS_FP8_ROTATE; False when fp8 is off
    fp8_rotate: bool = False
    #: fp8: each (sequence, head)'s outlier features of q and k have their fp8 rounding corrected
    #: (core/fp8.py), from the call's `fp8_outliers` and MLA_PLUGINS_FP8_OUTLIERS; False
    #: when fp8 is off
    fp8_outliers: bool = False
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


@dataclass(frozen=True)
class PlanRequest:
    """What `plan_prefill` asks a kernel to plan: one batch, by its host offsets.

    `overrides` holds planner parameters the caller named (tile_q, kv_granularity,
    num_workers); they win over the kernel's own `plan_params`. `fp8_given` is False when
    the caller left the compute mode open (then `fp8` is True for the selection).
    """

    seqlens_host: tuple[tuple[int, ...], tuple[int, ...]]
    num_heads: int
    causal: bool
    device: torch.device
    dtype: torch.dtype
    fp8: bool
    fp8_given: bool
    head_dim_qk: int
    head_dim_v: int
    overrides: dict = field(default_factory=dict)
    #: the calls keep the outlier features out of the fp8 cast (`plan_prefill(fp8_outliers=)`,
    #: MLA_PLUGINS_FP8_OUTLIERS): the selection passes over kernels that cannot
    fp8_outliers: bool = False
    op: ClassVar[str] = "plan"

    @property
    def batch_size(self) -> int:
        return len(self.seqlens_host[0]) - 1

    @property
    def total_q(self) -> int:
        return self.seqlens_host[0][-1]

    @property
    def total_k(self) -> int:
        return self.seqlens_host[1][-1]


Inputs = PrefillInputs | ReduceInputs | ConfigInputs | PlanRequest


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
    #: fp8 with core/fp8.py's outlier features' rounding corrected (`fp8_outliers`)
    supports_fp8_outliers: ClassVar[bool] = False
    #: None = any value
    head_dims_qk: ClassVar[frozenset[int] | None] = None
    head_dims_v: ClassVar[frozenset[int] | None] = None
    num_heads: ClassVar[frozenset[int] | None] = None
    #: the lse `run_with_lse` hands back without a copy is heads-first in memory (its
    #: transpose, [H, total_q], is contiguous: FA3's own tensor); False: [total_q, H], and a
    #: caller wanting [H, total_q] passes `lse=` as that buffer's transpose to get it written
    #: in place (`api.lse_heads_first`)
    lse_heads_first: ClassVar[bool] = False

    # -- capability checks -------------------------------------------------------------
    def environment_reasons(self) -> list[str]:
        """Why this kernel cannot run in this process at all (missing library, ...)."""
        return []

    def device_reasons(self, device: torch.device) -> list[str]:
        """Why it cannot run on `device` beyond the device kind (arch, compute capability)."""
        return []

    def extra_reasons(self, inputs: Inputs) -> list[str]:
        return []

    def auto_reasons(self, inputs: Inputs) -> list[str]:
        """Why kernel="auto" must not take this kernel for `inputs` although it can run them
        when pinned (kernel="<name>" or MLA_PLUGINS_KERNEL): the registry consults this only
        for the automatic choice."""
        return []

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        reasons = list(self.environment_reasons())
        reasons += self._device_kind_reasons(inputs.device)
        if inputs.dtype not in self.dtypes:
            reasons.append(f"dtype {inputs.dtype} not supported (supports {_names(self.dtypes)})")
        if inputs.op != "reduce":
            if inputs.fp8 and not self.supports_fp8:
                reasons.append("fp8=True not supported")
            if inputs.fp8 and getattr(inputs, "fp8_outliers", False) and not self.supports_fp8_outliers:
                reasons.append("fp8_outliers=True not supported (this kernel's API has no place "
                               "for the outlier features' correction product)")
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
    def plan_params(self, request) -> dict:
        """Keyword arguments of the core planner for this kernel (`PlanRequest`, or the
        `PrefillInputs` of a call: both carry `seqlens_host`, `num_heads`, `device`, `fp8`)."""
        return {}

    def build_plan(self, request: PlanRequest) -> PrefillPlan:
        """The plan of one batch for this kernel. The default is the core planner with
        `plan_params` (and the caller's overrides); a kernel with its own scheduler (AITER)
        returns a `PrefillPlan` whose `extra` carries its metadata."""
        from ..plan import build_core_plan

        params = {**self.plan_params(request), **request.overrides}
        plan = build_core_plan(request, kernel=self.name, **params)
        fp8 = request.fp8 if request.fp8_given else True  # open mode: room for the larger
        nbytes = workspace_size(self.workspace_layout(
            plan, fp8=fp8, num_heads=plan.num_heads, head_dim_v=plan.head_dim_v,
            fp8_dtype=fp8_dtype_for(plan.device)))
        # + ALIGN: any buffer of workspace_bytes has room to start its regions aligned
        return replace(plan, workspace_bytes=nbytes + ALIGN)

    def workspace_layout(self, plan: PrefillPlan, *, fp8: bool, num_heads: int, head_dim_v: int,
                         fp8_dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The scratch a run of `plan` needs, as (name, shape, dtype) regions of one workspace.

        The default: the split-KV partial buffers. Kernels add their own (fp8 copies, ...).
        """
        rows = plan.partial_rows()
        return [
            ("partial_out", (rows, num_heads, head_dim_v), torch.float32),
            ("partial_lse", (rows, num_heads), torch.float32),
        ]

    def run(
        self,
        inputs: PrefillInputs,
        plan: PrefillPlan,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        workspace: torch.Tensor | None = None,
    ) -> None:
        """The whole prefill on the plan: phase 1, then the reduce of split tiles.

        `workspace` is a uint8 tensor of at least the layout's size on the inputs' device,
        or None for the per-device shared one. A kernel with its own scheduler (AITER)
        overrides this; the others implement `prefill` and `reduce` on the core's plan.
        """
        scratch = self.scratch(inputs, plan, workspace)
        partial_out, partial_lse = scratch["partial_out"], scratch["partial_lse"]
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

    def run_with_lse(self, inputs: PrefillInputs, plan: PrefillPlan, out: torch.Tensor,
                     workspace: torch.Tensor | None = None) -> torch.Tensor:
        """`run`, returning lse float32 [total_q, H]: allocated here and written by `run`.
        A kernel whose library hands back its own lse (FA3: [H, total_q]) overrides this to
        return a view of it instead of copying it into a new tensor."""
        lse = torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)
        self.run(inputs, plan, out, lse, workspace)
        return lse

    def scratch(self, inputs: PrefillInputs, plan: PrefillPlan,
                workspace: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Views of the workspace by region name, made once per (plan, buffer, mode)."""
        return self.scratch_entry(inputs, plan, workspace)[0]

    def scratch_entry(self, inputs: PrefillInputs, plan: PrefillPlan,
                      workspace: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], int]:
        """(views, token): the token changes whenever the views are made anew (a grown
        shared workspace, another buffer, another mode), so launch arguments derived from
        the views can be keyed by it."""
        memo = plan.memo.get("scratch")
        fp8, dv = inputs.fp8, inputs.v.shape[2]
        # a framework may hand a new view of the same memory on every call: compare the memory
        where = None if workspace is None else (
            workspace.data_ptr() if isinstance(workspace, torch.Tensor) else id(workspace),
            workspace.numel() if isinstance(workspace, torch.Tensor) else 0)
        if memo is not None and memo[0] is fp8 and memo[1] == dv and memo[2] == where:
            shared = memo[3]
            if shared is None or shared.generation == memo[4]:
                return memo[5], memo[6]
        layout = self.workspace_layout(
            plan, fp8=fp8, num_heads=inputs.num_heads, head_dim_v=dv, fp8_dtype=inputs.fp8_dtype)
        shared, generation, views = carve_views(layout, workspace, inputs.device)
        token = next_token()
        plan.memo["scratch"] = (fp8, dv, where, shared, generation, views, token)
        return views, token

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
        # the device first: "needs a GPU" is what a CPU user must read, not a missing library
        reasons = self._device_kind_reasons(device) + list(self.environment_reasons())
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
