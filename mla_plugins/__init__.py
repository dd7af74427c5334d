"""mla-plugins: one shared, fast, version-proof FP8 MLA prefill for vLLM and SGLang.

The public API lives here; the framework adapters (`mla_plugins.vllm`,
`mla_plugins.sglang`) use nothing else. Importing this package imports no framework.
"""

from .core import (
    AiterStatus,
    Kernel,
    KernelInfo,
    KernelNotSupportedError,
    PrefillInputs,
    PrefillPlan,
    ReduceInputs,
    after_import,
    aiter_get_ps_metadata_v1,
    aiter_mla_reduce_v1,
    available_kernels,
    env_flag,
    fp8_requested,
    hookimpl,
    lse_heads_first,
    mla_prefill,
    mla_reduce,
    pinned_kernel,
    plan_prefill,
    probe_aiter,
    reserve_workspace,
    shim_enabled,
    trace_context,
    trace_event,
    unsupported_reasons,
)

__version__ = "0.1.0"

__all__ = [
    "after_import",
    "AiterStatus",
    "Kernel",
    "KernelInfo",
    "KernelNotSupportedError",
    "PrefillInputs",
    "PrefillPlan",
    "ReduceInputs",
    "__version__",
    "aiter_get_ps_metadata_v1",
    "aiter_mla_reduce_v1",
    "available_kernels",
    "env_flag",
    "fp8_requested",
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
