"""`MLAPluginsPrefillBackend`: vLLM's MLA prefill component, running `mla_plugins.mla_prefill`.

vLLM imports this module through the class path that `register()` stores, so it may
import vLLM at the top (the package `mla_plugins.vllm` itself never does).

Tensors vLLM hands a prefill backend (after `kv_b_proj` decompression):
    q: [total_q, H, Dqk]   k: [total_k, H, Dqk]   v: [total_k, H, Dv]   bf16/fp16
and it expects lse as [H, total_q] (the layout `merge_attn_states` reads).

FP8 rule (the same for both adapters, `mla_plugins.fp8_requested`): MLA_PLUGINS_FP8=1
forces FP8, =0 forces bf16/fp16, otherwise FP8 iff the KV cache dtype is fp8*.
"""

from __future__ import annotations

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


def _cu_seqlens(t: torch.Tensor) -> torch.Tensor:
    """Offsets as the core wants them: int32 (vLLM's are int32 already; no copy then)."""
    return t.to(torch.int32)


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
        """vLLM's generic checks plus every reason mla-plugins' kernels give for this config."""
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
        fp8 = mla_plugins.fp8_requested(kv_cache_dtype)
        device = current_platform.device_type
        kernel_reasons = mla_plugins.unsupported_reasons(
            num_heads=heads or 16,  # no model yet: a typical per-rank count
            qk_head_dim=qk,
            v_head_dim=dims.v_head_dim,
            dtype=selector_config.dtype,
            device=device,
            fp8=fp8,
        )
        reasons += [f"mla-plugins ({'fp8' if fp8 else 'no fp8'}, {device}): {r}" for r in kernel_reasons]
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
        cache_dtype = vllm_config.cache_config.cache_dtype if vllm_config is not None else None
        self.fp8 = mla_plugins.fp8_requested(cache_dtype)
        logger.debug(
            "MLA_PLUGINS prefill: %d heads, qk %d, v %d, fp8=%s (kv cache %s)",
            num_heads, qk_nope_head_dim + qk_rope_head_dim, v_head_dim, self.fp8, cache_dtype,
        )

    def supports_out(self) -> bool:
        return True

    def _check_inputs(self, q: torch.Tensor) -> None:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"MLA_PLUGINS prefill: found q dtype {q.dtype}, expected bf16 or fp16; "
                "leave vLLM's FP8 query quantization (use_prefill_query_quantization) off, "
                "mla-plugins quantizes inside its kernel (MLA_PLUGINS_FP8=1 or an fp8 KV cache)"
            )

    def _run(self, q, k, v, cu_q, cu_k, *, causal, return_lse, out, entry):
        self._check_inputs(q)
        with mla_plugins.trace_context("vllm", entry):
            result = mla_plugins.mla_prefill(
                q, k, v, _cu_seqlens(cu_q), _cu_seqlens(cu_k),
                softmax_scale=self.scale, causal=causal, fp8=self.fp8,
                out=out, return_lse=return_lse,
            )
        if not return_lse:
            return result
        o, lse = result
        return o, lse.transpose(0, 1).contiguous()  # [total_q, H] -> vLLM's [H, total_q]

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
        cu = self._prefill_metadata.query_start_loc
        return self._run(q, k, v, cu, cu, causal=True, return_lse=return_softmax_lse, out=out,
                         entry="new_tokens")

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
        return self._run(q, k, v, chunk.query_start_loc, chunk.cu_seq_lens, causal=False,
                         return_lse=True, out=out, entry="context_chunk")
