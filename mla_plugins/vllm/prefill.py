"""`MLAPluginsPrefillBackend`: vLLM's MLA prefill component, running `mla_plugins.mla_prefill`.

vLLM imports this module through the class path that `register()` stores, so it may
import vLLM at the top (the package `mla_plugins.vllm` itself never does).

Tensors vLLM hands a prefill backend (after `kv_b_proj` decompression):
    q: [total_q, H, Dqk]   k: [total_k, H, Dqk]   v: [total_k, H, Dv]   bf16/fp16
and it expects lse as [H, total_q] (the layout `merge_attn_states` reads).

Serving path (vLLM 0.32/0.33, `MLACommonMetadataBuilder.build`): the builder calls
`prepare_metadata` once per batch on its own clone of this backend, then every layer's
`run_prefill_new_tokens` / `run_prefill_context_chunk` goes to that clone. So the batch is
planned there, once, from the host copies vLLM already has (`query_lens_cpu`, each
`ContextChunk.seq_lens`): one plan for the new tokens and one per context chunk. The
per-layer calls pass the plan and no offsets, so they read nothing back from the device.
Scratch comes from vLLM's workspace manager (`current_workspace_manager()`), reserved for
the largest batch when the backend is built, so vLLM's memory profile counts it.
VLLM_GPU_SYNC_CHECK=error: the only device transfer is the plans' copy to the device in
`prepare_metadata`, once per batch, inside vLLM's `gpu_sync_allowed()`; the per-layer calls
need no allow-region.

FP8 rule (the same for both adapters, `mla_plugins.fp8_requested`): MLA_PLUGINS_FP8=1
forces FP8, =0 forces bf16/fp16, otherwise FP8 iff the KV cache dtype is fp8*.

Start-up checks (`validate_configuration` where vLLM selects by name, and the constructor
on every platform): a MLA_PLUGINS_KERNEL pin that cannot run the model's dimensions, a GPU
where only the slow torch reference kernel could run, and FP8 under VLLM_BATCH_INVARIANT
are refused before the first prefill. Under VLLM_BATCH_INVARIANT the plans never split a
query tile over the keys (one worker per head), so a sequence's result does not depend on
what else is in the batch.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

import mla_plugins

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig

logger = logging.getLogger("mla_plugins.vllm.prefill")

NAME = "MLA_PLUGINS"
#: the reference kernel: runs anywhere, far slower than vLLM's own prefill on a GPU
REFERENCE_KERNEL = "torch"
#: the core wants its workspace 256-byte aligned; views of vLLM's workspace are cut to that
WORKSPACE_ALIGN = 256
#: workspace reservations made in this process (see `_reserve_workspace`)
_reserved: set[tuple] = set()


def _config_facts() -> tuple[int | None, str | None]:
    """(query heads per rank, KV cache dtype) of the config vLLM is building, when it has one."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is None or cfg.model_config is None:
        return None, None
    heads = None
    try:
        heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    except Exception:  # an odd model config: validate without a head count
        logger.debug("no head count in the current vLLM config", exc_info=True)
    return heads, cfg.cache_config.cache_dtype


def _batch_invariant() -> bool:
    import vllm.envs as envs

    return bool(getattr(envs, "VLLM_BATCH_INVARIANT", False))


def _gpu_sync_allowed():
    """vLLM's allow-region for a deliberate device sync (VLLM_GPU_SYNC_CHECK), where it has one."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:  # a vLLM without the sync check
        return contextlib.nullcontext()
    return gpu_sync_allowed()


def _offsets(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def config_reasons(
    *,
    num_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
    device: str,
    fp8: bool,
    gpu_platform: bool,
    batch_invariant: bool,
) -> list[str]:
    """Why mla-plugins must not serve this configuration ([] when it may).

    Refused: no kernel can run it; the MLA_PLUGINS_KERNEL pin cannot run it; on a GPU
    platform, only the torch reference kernel could (unless pinned on purpose); FP8 under
    VLLM_BATCH_INVARIANT (AITER's fp8 scales are per tensor over the batch, and on Hopper the
    fp8 phase-1 kernel is chosen per batch).
    """
    what = (f"{num_heads} heads per rank, head dims qk {qk_head_dim} / v {v_head_dim}, "
            f"{str(dtype).removeprefix('torch.')}, {'fp8' if fp8 else 'no fp8'}, on {device}")
    config = dict(num_heads=num_heads, qk_head_dim=qk_head_dim, v_head_dim=v_head_dim,
                  dtype=dtype, device=device, fp8=fp8)
    def kernel_reasons(name: str) -> list[str]:
        try:
            return mla_plugins.unsupported_reasons(**config, kernel=name)
        except (TypeError, ValueError) as exc:  # an unknown kernel name, a config out of range
            return [str(exc)]

    reasons: list[str] = []
    pin = mla_plugins.pinned_kernel()
    if pin is not None:
        pin_reasons = kernel_reasons(pin)
        if pin_reasons:
            reasons.append(
                f"mla-plugins: MLA_PLUGINS_KERNEL={pin!r} cannot run {what}: "
                + "; ".join(pin_reasons)
                + " (unset MLA_PLUGINS_KERNEL to let mla-plugins choose)"
            )
    else:
        per_kernel = {info.name: kernel_reasons(info.name) for info in mla_plugins.available_kernels(device)}
        runnable = [name for name, why in per_kernel.items() if not why]
        others = "; ".join(r for name, why in per_kernel.items() if name != REFERENCE_KERNEL for r in why)
        if not runnable:
            reasons.append(f"mla-plugins: no kernel can run {what}: "
                           + "; ".join(r for why in per_kernel.values() for r in why))
        elif gpu_platform and set(runnable) <= {REFERENCE_KERNEL}:
            reasons.append(
                f"mla-plugins: on this GPU only the {REFERENCE_KERNEL!r} reference kernel can run "
                f"{what}, which is many times slower than vLLM's own prefill; the fast kernels "
                f"say: {others or 'none registered'}. Fix what they name, select another MLA "
                f"prefill backend, or set MLA_PLUGINS_KERNEL={REFERENCE_KERNEL} to run the "
                "reference kernel on purpose"
            )
    if batch_invariant and fp8:
        reasons.append(
            "mla-plugins: VLLM_BATCH_INVARIANT=1 with FP8 prefill: AITER's FP8 scales are taken "
            "over the whole batch and on Hopper the FP8 kernel is chosen per batch (by its query "
            "lengths), so a sequence's result would depend on the batch; set MLA_PLUGINS_FP8=0 "
            "(or use a bf16 KV cache) for batch-invariant serving"
        )
    return reasons


_warned_amx = False


def _warn_if_amx_mla_bypasses_us(vllm_config) -> None:
    """vLLM's CPU platform takes AMX_MLA for MLA models where the CPU has AMX (unless
    attention backend CPU_MLA is asked for); AMX_MLA's forward_mha runs its own prefill and
    never calls the MLA prefill backend, so this one would be built but never run."""
    global _warned_amx
    try:
        from vllm.platforms import CpuArchEnum, current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        bypassed = (
            current_platform.is_cpu()
            and current_platform.get_cpu_architecture() == CpuArchEnum.X86
            and torch.cpu._is_amx_tile_supported()
            and vllm_config.attention_config.backend != AttentionBackendEnum.CPU_MLA
        )
    except Exception:  # a vLLM laid out otherwise: nothing to say
        return
    if bypassed and not _warned_amx:
        _warned_amx = True
        logger.warning(
            "MLA_PLUGINS prefill: vLLM picks its AMX_MLA attention backend on this CPU, which runs "
            "its own prefill and never calls MLA prefill backends (this one included); pass "
            "attention_config {\"backend\": \"CPU_MLA\"} (--attention-backend CPU_MLA) to use it"
        )


def _workspace_manager():
    """vLLM's workspace manager of this process, or None where vLLM made none (its CPU worker)."""
    try:
        from vllm.v1.worker.workspace import (
            current_workspace_manager,
            is_workspace_manager_initialized,
        )
    except ImportError:  # a vLLM without one
        return None
    return current_workspace_manager() if is_workspace_manager_initialized() else None


class MLAPluginsPrefillBackend(MLAPrefillBackend):
    """Dense MLA prefill through mla-plugins (torch, Triton or AITER kernel, chosen by the core)."""

    supported_dtypes = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return NAME

    @classmethod
    def validate_configuration(
        cls,
        device_capability: DeviceCapability | None,
        selector_config: MLAPrefillSelectorConfig,
    ) -> list[str]:
        """vLLM's generic checks plus mla-plugins' start-up checks (`config_reasons`)."""
        from vllm.platforms import current_platform

        reasons = super().validate_configuration(device_capability, selector_config)
        dims = selector_config.mla_dimensions
        qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        if qk <= 0 or dims.v_head_dim <= 0:
            reasons.append(
                f"mla-plugins: MLA dimensions {dims} are not an MLA model's "
                "(expected qk_nope_head_dim + qk_rope_head_dim > 0 and v_head_dim > 0)"
            )
            return reasons
        heads, kv_cache_dtype = _config_facts()
        reasons += config_reasons(
            num_heads=heads or 16,  # no model yet: a typical per-rank count
            qk_head_dim=qk,
            v_head_dim=dims.v_head_dim,
            dtype=selector_config.dtype,
            device=current_platform.device_type,
            fp8=mla_plugins.fp8_requested(kv_cache_dtype),
            gpu_platform=not current_platform.is_cpu(),
            batch_invariant=_batch_invariant(),
        )
        return reasons

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: VllmConfig,
    ) -> None:
        super().__init__(
            num_heads=num_heads,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            vllm_config=vllm_config,
        )
        from vllm.platforms import current_platform

        model_config = getattr(vllm_config, "model_config", None)
        cache_dtype = vllm_config.cache_config.cache_dtype if vllm_config is not None else None
        self.fp8 = mla_plugins.fp8_requested(cache_dtype)
        self.dtype = model_config.dtype if model_config is not None else torch.bfloat16
        self.head_dim_qk = qk_nope_head_dim + qk_rope_head_dim
        self.batch_invariant = _batch_invariant()
        # vLLM validates a backend selected by name only on GPU platforms; this runs in
        # every worker (MLA_PLUGINS_VLLM_OVERRIDE included), before the first batch
        reasons = config_reasons(
            num_heads=num_heads, qk_head_dim=self.head_dim_qk, v_head_dim=v_head_dim,
            dtype=self.dtype, device=current_platform.device_type, fp8=self.fp8,
            gpu_platform=not current_platform.is_cpu(), batch_invariant=self.batch_invariant,
        )
        if reasons:
            raise ValueError("MLA_PLUGINS prefill backend cannot serve this model: " + " | ".join(reasons))
        if vllm_config is not None and getattr(vllm_config, "model_config", None) is not None:
            _warn_if_amx_mla_bypasses_us(vllm_config)
        self._new_tokens_plan = None
        #: chunk.index -> (the chunk object it was planned for, its plan)
        self._chunk_plans: dict = {}
        #: batches planned, plans built in prepare_metadata, and plans made (or offsets
        #: read) inside a per-layer call because prepare_metadata had none fitting
        self.stats = {"batches": 0, "plans": 0, "late": 0, "workspace_fallbacks": 0}
        self._warned_workspace = False
        self._reserve_workspace()
        logger.debug(
            "MLA_PLUGINS prefill: %d heads, qk %d, v %d, fp8=%s (kv cache %s), batch invariant %s",
            num_heads, self.head_dim_qk, v_head_dim, self.fp8, cache_dtype, self.batch_invariant,
        )

    def supports_out(self) -> bool:
        return True

    # -- planning (once per batch) ------------------------------------------------------
    def _plan(self, cu_q, cu_k, *, causal: bool, device):
        extra = {}
        if self.batch_invariant:
            # one worker per head cluster of one head: every query tile is done whole by one
            # work item, never split over the keys, whatever else is in the batch
            extra["num_workers"] = self.num_heads
        plan = mla_plugins.plan_prefill(
            cu_q, cu_k, num_heads=self.num_heads, causal=causal, device=device, dtype=self.dtype,
            fp8=self.fp8, head_dim_qk=self.head_dim_qk, head_dim_v=self.v_head_dim, **extra,
        )
        if self.batch_invariant and plan.num_partial_tiles:
            raise RuntimeError(
                f"MLA_PLUGINS prefill: VLLM_BATCH_INVARIANT=1 but kernel {plan.kernel!r} planned "
                f"{plan.num_partial_tiles} split-KV pieces (expected none); pin another kernel "
                "with MLA_PLUGINS_KERNEL or unset VLLM_BATCH_INVARIANT"
            )
        return plan

    def prepare_metadata(self, prefill_metadata: MLACommonPrefillMetadata) -> None:
        """Plan this batch: the new tokens (causal) and every context chunk (non-causal),
        from host copies only."""
        super().prepare_metadata(prefill_metadata)
        device = prefill_metadata.query_start_loc.device
        lens_cpu = getattr(prefill_metadata, "query_lens_cpu", None)
        if lens_cpu is not None:
            q_lens = lens_cpu.tolist()  # a CPU tensor: no device read
            cu_q = _offsets(q_lens)
        else:  # a builder without the host copy: read the device offsets once per batch
            with _gpu_sync_allowed():
                cu_q = prefill_metadata.query_start_loc.tolist()
            q_lens = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
        chunked = prefill_metadata.chunked_context
        chunks = chunked.chunks if chunked is not None else ()
        self._chunk_plans = {}
        # the plans' host-to-device copies, once per batch (as vLLM's FlashInfer prefill
        # allows its plan()); the per-layer calls then read and copy nothing
        with _gpu_sync_allowed():
            self._new_tokens_plan = self._plan(cu_q, cu_q, causal=True, device=device)
            for chunk in chunks:
                chunk_q = _offsets(q_lens[chunk.request_slice])
                chunk_k = _offsets(chunk.seq_lens.tolist())  # pinned CPU in vLLM
                plan = self._plan(chunk_q, chunk_k, causal=False, device=device)
                self._chunk_plans[chunk.index] = (chunk, plan)
        planned = 1 + len(self._chunk_plans)
        self.stats["batches"] += 1
        self.stats["plans"] += planned
        mla_plugins.trace_event(
            "vllm", "plan", batch=self.stats["batches"], plans=planned, heads=self.num_heads,
            q_tokens=cu_q[-1], chunks=len(self._chunk_plans), kernel=self._new_tokens_plan.kernel,
            fp8=self.fp8, workspace_bytes=max(
                [self._new_tokens_plan.workspace_bytes]
                + [p.workspace_bytes for _, p in self._chunk_plans.values()]),
        )

    # -- workspace (vLLM's, so its memory profile counts it) ----------------------------
    def _reserve_workspace(self) -> None:
        """Grow vLLM's workspace to what the largest batch this engine schedules needs.

        Runs when the layers are built, before vLLM's memory profile and before it locks
        the workspace; vLLM's own FlashInfer/TRT-LLM prefills reserve theirs the same way.
        """
        manager = _workspace_manager()
        cfg = self.vllm_config
        if manager is None or manager.is_locked() or cfg is None or cfg.model_config is None:
            return
        from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

        tokens = cfg.scheduler_config.max_num_batched_tokens
        seqs = max(1, min(cfg.scheduler_config.max_num_seqs, tokens))
        context = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size(cfg)
        device = torch.device(cfg.device_config.device)
        key = (id(manager), str(device), self.num_heads, self.head_dim_qk, self.v_head_dim,
               self.dtype, self.fp8, self.batch_invariant, tokens, seqs, context)
        if key in _reserved:  # every layer builds a backend: size the workspace once
            return
        even = _offsets([tokens // seqs] * (seqs - 1) + [tokens - (tokens // seqs) * (seqs - 1)])
        shapes = (  # one long sequence, many short ones, each new and over a full context chunk
            ([0, tokens], [0, tokens], True),
            (even, even, True),
            ([0, tokens], [0, context], False),
            (even, _offsets([context // seqs] * seqs), False),
        )
        need = max(self._plan(cq, ck, causal=c, device=device).workspace_bytes for cq, ck, c in shapes)
        if need:
            manager.get_simultaneous(((need + WORKSPACE_ALIGN,), torch.uint8))
        _reserved.add(key)
        logger.debug("MLA_PLUGINS prefill: reserved %d workspace bytes in vLLM's workspace manager", need)

    def _workspace(self, plan) -> torch.Tensor | None:
        need = plan.workspace_bytes
        manager = _workspace_manager()
        if not need or manager is None:
            return None  # the core's per-device workspace
        try:
            (buf,) = manager.get_simultaneous(((need + WORKSPACE_ALIGN,), torch.uint8))
        except AssertionError as exc:  # locked, and this batch needs more than was reserved
            self.stats["workspace_fallbacks"] += 1
            if not self._warned_workspace:
                self._warned_workspace = True
                logger.warning("MLA_PLUGINS prefill: vLLM's workspace cannot grow to %d bytes (%s); "
                               "using mla-plugins' own workspace, outside vLLM's memory profile",
                               need, exc)
            return None
        start = -buf.data_ptr() % WORKSPACE_ALIGN
        return buf[start : start + need]

    # -- the per-layer calls ------------------------------------------------------------
    def _check_inputs(self, q: torch.Tensor) -> None:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"MLA_PLUGINS prefill: found q dtype {q.dtype}, expected bf16 or fp16; "
                "leave vLLM's FP8 query quantization (use_prefill_query_quantization) off, "
                "mla-plugins quantizes inside its kernel (MLA_PLUGINS_FP8=1 or an fp8 KV cache)"
            )

    def _run(self, q, k, v, plan, offsets, *, causal, return_lse, out, entry):
        self._check_inputs(q)
        if plan is None or plan.total_q != q.shape[0] or plan.total_k != k.shape[0]:
            # nothing planned for these shapes in prepare_metadata (a caller outside vLLM's
            # metadata builder): plan now from the device offsets, one read
            self.stats["late"] += 1
            cu_q, cu_k = offsets()
            with _gpu_sync_allowed():
                both = torch.cat((cu_q, cu_k)).tolist()
            n = cu_q.numel()
            plan = self._plan(both[:n], both[n:], causal=causal, device=q.device)
        # vLLM's lse is [H, total_q]: FA3's own comes back in that memory (its transpose is
        # contiguous); every other kernel writes a buffer of that layout in place (`lse=`)
        buf = None
        if return_lse and not mla_plugins.lse_heads_first(plan):
            buf = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        with mla_plugins.trace_context("vllm", entry):
            result = mla_plugins.mla_prefill(
                q, k, v, plan=plan, softmax_scale=self.scale, causal=causal, fp8=self.fp8,
                out=out, return_lse=return_lse, workspace=self._workspace(plan),
                lse=None if buf is None else buf.t(),
            )
        if not return_lse:
            return result
        o, lse = result
        # [total_q, H] -> [H, total_q]: a no-op on either route above
        return o, buf if buf is not None else lse.t().contiguous()

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the new tokens over themselves.

        q, k: [total_q, H, Dqk], v: [total_q, H, Dv]; returns out [total_q, H, Dv]
        (written into `out` when given), plus lse [H, total_q] if return_softmax_lse.
        """
        if output_scale is not None:
            raise NotImplementedError(
                "MLA_PLUGINS prefill: found output_scale (fused FP8 output), which it does not "
                "support (supports_quant_output is False); this is a vLLM dispatch bug, please report it"
            )

        def offsets():
            cu = self._prefill_metadata.query_start_loc
            return cu, cu

        return self._run(q, k, v, self._new_tokens_plan, offsets, causal=True,
                         return_lse=return_softmax_lse, out=out, entry="new_tokens")

    def run_prefill_context_chunk(
        self,
        chunk: MLACommonPrefillMetadata.ContextChunk,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of the new tokens over one chunk of cached context.

        q: [chunk_q, H, Dqk], k: [chunk_k, H, Dqk], v: [chunk_k, H, Dv];
        returns (out [chunk_q, H, Dv], lse [H, chunk_q]).
        """
        planned = self._chunk_plans.get(chunk.index)
        plan = planned[1] if planned is not None and planned[0] is chunk else None
        return self._run(q, k, v, plan, lambda: (chunk.query_start_loc, chunk.cu_seq_lens),
                         causal=False, return_lse=True, out=out, entry="context_chunk")
