"""Framework-free core: plan, kernels, reduce, AITER binding, kernel registry."""

from .aiter import AiterStatus, aiter_get_ps_metadata_v1, aiter_mla_reduce_v1, probe_aiter
from .api import (
    available_kernels,
    lse_heads_first,
    mla_prefill,
    mla_reduce,
    plan_prefill,
    unsupported_reasons,
)
from .imports import after_import
from .kernels import hookimpl
from .kernels.base import Kernel, KernelInfo, PrefillInputs, ReduceInputs
from .plan import PrefillPlan
from .registry import KernelNotSupportedError, get_registry
from .settings import flag as env_flag
from .settings import fp8_requested, pinned_kernel, shim_enabled
from .trace import trace_context, trace_event
from .workspace import reserve as reserve_workspace

__all__ = [
    "after_import",
    "AiterStatus",
    "Kernel",
    "KernelInfo",
    "KernelNotSupportedError",
    "PrefillInputs",
    "PrefillPlan",
    "ReduceInputs",
    "aiter_get_ps_metadata_v1",
    "aiter_mla_reduce_v1",
    "available_kernels",
    "env_flag",
    "fp8_requested",
    "get_registry",
    "hookimpl",
    "lse_heads_first",
    "mla_prefill",
    "mla_reduce",
    "pinned_kernel",
    "plan_prefill",
    "probe_aiter",
    "reserve_workspace",
    "shim_enabled",
    "trace_context",
    "trace_event",
    "unsupported_reasons",
]
