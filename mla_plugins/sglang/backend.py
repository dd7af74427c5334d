"""The `mla_plugins` SGLang attention backend: MLA prefill on DeepSeek's MHA path.

DeepSeek-style layers (`DeepseekV2AttentionMLA`) run an extend batch as multi-head
attention over decompressed K/V (`attn_mha`): q `[T, H, 192]`, k `[N, H, 192]`,
v `[N, H, 128]`. Our DeepSeek handler picks, per batch:

- MHA            no cached prefix: k/v are the T new tokens, causal;
- MHA_ONE_SHOT   cached prefixes that fit SGLang's chunk capacity: k/v cover every token of
                 every sequence (prefix first), bottom-right causal;
- MHA_CHUNKED_KV longer prefixes: first the new tokens (causal, with lse), then one call per
                 prefix chunk (`forward_batch.attn_attend_prefix_cache`), non-causal with
                 lse, which SGLang merges with `merge_state`.

All three go through `mla_plugins.mla_prefill`, fp8 by `mla_plugins.fp8_requested` of the
server's `--kv-cache-dtype` (the same rule as the vLLM adapter).

Decode is not ours: SGLang builds `HybridAttnBackend(prefill=ours, decode=theirs)` from
`--prefill-attention-backend mla_plugins --decode-attention-backend <theirs>`; asked to be
the decode backend too, the factory raises an error that names that flag.

Base-class generations: 0.5.11-0.5.12 declare `init_forward_metadata` abstract (and
0.5.11's `forward_extend` takes no **kwargs); 0.5.15+ split it into
`init_forward_metadata_out_graph` / `_in_graph`. This class implements all three, so it
runs eagerly on both. CUDA-graph capture is not supported (prefill is never captured unless
piecewise/breakable prefill graphs are enabled; those route DeepSeek to absorbed MLA,
which this backend refuses with a clear error).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

import mla_plugins

logger = logging.getLogger("mla_plugins.sglang.backend")

BACKEND_NAME = "mla_plugins"
FRAMEWORK = "sglang"


def _decode_flag_hint() -> str:
    return (
        f"mla_plugins implements MLA prefill only. Keep it for prefill and name a decode backend: "
        f"--prefill-attention-backend {BACKEND_NAME} --decode-attention-backend <triton|fa3|flashinfer|"
        "flashmla|aiter> (aiter on ROCm, fa3/flashinfer on CUDA)"
    )


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> int32 [B+1] offsets starting at 0."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths.to(torch.int32), 0)
    return out


@dataclass
class ExtendMetadata:
    """Offsets of one extend batch.

    cu_seqlens_q:   int32 [B+1], new tokens per sequence (`extend_seq_lens`)
    cu_seqlens_all: int32 [B+1], prefix + new tokens per sequence (`seq_lens`)
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_all: torch.Tensor
    total_q: int
    total_all: int
    num_prefix_tokens: int


def extend_metadata(forward_batch) -> ExtendMetadata:
    """Build the prefill offsets from a real SGLang `ForwardBatch` of an extend mode."""
    device = forward_batch.seq_lens.device
    if forward_batch.extend_seq_lens is not None:
        extend_lens = forward_batch.extend_seq_lens.to(device)
    else:
        extend_lens = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int32, device=device)
    seq_lens = forward_batch.seq_lens[: extend_lens.numel()]
    cu_q = _cumsum0(extend_lens)
    cu_all = _cumsum0(seq_lens)
    if forward_batch.extend_seq_lens_cpu is not None:
        total_q = int(sum(forward_batch.extend_seq_lens_cpu))
    else:
        total_q = int(cu_q[-1])
    if forward_batch.seq_lens_cpu is not None:
        total_all = int(forward_batch.seq_lens_cpu[: extend_lens.numel()].sum())
    else:
        total_all = int(cu_all[-1])
    return ExtendMetadata(cu_q, cu_all, total_q, total_all, total_all - total_q)


def deepseek_forward_method(attn, forward_batch):
    """`AttentionBackendRegistry` handler: keep DeepSeek's plain extends on the MHA path."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    mode = forward_batch.forward_mode
    if not mode.is_extend_without_speculative():
        # Speculative verify/draft extends use the absorbed form; the backend refuses them
        # with a message (decode never reaches this handler: it uses the decode backend's).
        return AttnForwardMethod.MLA
    prefix_lens = forward_batch.extend_prefix_lens_cpu
    if prefix_lens is None or sum(prefix_lens) == 0:
        return AttnForwardMethod.MHA
    seq_lens = forward_batch.seq_lens_cpu
    total = int(seq_lens.sum()) if seq_lens is not None else None
    if total is not None and total <= forward_batch.get_max_chunk_capacity():
        return AttnForwardMethod.MHA_ONE_SHOT
    return AttnForwardMethod.MHA_CHUNKED_KV


def _kv_cache_dtype_str(runner) -> str | None:
    """The server's --kv-cache-dtype ("auto", "fp8_e4m3", ...) as this runner sees it."""
    for owner, attr in ((runner, "kv_cache_dtype_str"), (getattr(runner, "server_args", None), "kv_cache_dtype")):
        value = getattr(owner, attr, None) if owner is not None else None
        if isinstance(value, str):
            return value
    dtype = getattr(runner, "kv_cache_dtype", None)
    return str(dtype).removeprefix("torch.").replace("float8_", "fp8_") if dtype is not None else None


def _backend_names(runner) -> tuple[str | None, str | None]:
    """(prefill, decode) backend names this runner was built for, across SGLang versions."""
    prefill = getattr(runner, "prefill_attention_backend_str", None)
    decode = getattr(runner, "decode_attention_backend_str", None)
    args = getattr(runner, "server_args", None)
    if args is not None:
        default = getattr(args, "attention_backend", None)
        prefill = prefill or getattr(args, "prefill_attention_backend", None) or default
        decode = decode or getattr(args, "decode_attention_backend", None) or default
    return prefill, decode


def create_backend(runner):
    """The factory registered under `mla_plugins`: `factory(model_runner) -> AttentionBackend`."""
    if not getattr(runner, "use_mla_backend", False):
        arch = getattr(getattr(runner, "model_config", None), "attention_arch", None)
        raise ValueError(
            f"attention backend {BACKEND_NAME!r}: found a model whose attention is {arch} "
            "(use_mla_backend=False), expected an MLA model (DeepSeek-V2/V3/R1, Kimi-K2). "
            "Use another --prefill-attention-backend for this model."
        )
    prefill, decode = _backend_names(runner)
    if decode == BACKEND_NAME:
        raise ValueError(
            f"attention backend {BACKEND_NAME!r} was selected for decode (prefill={prefill!r}, "
            f"decode={decode!r}). {_decode_flag_hint()}"
        )
    return backend_class()(runner)


@functools.cache
def backend_class():
    """Define the backend class on first use, so importing this module imports no SGLang."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class MLAPluginsAttnBackend(AttentionBackend):
        """MLA prefill through `mla_plugins.mla_prefill`; see the module docstring."""

        def __init__(self, model_runner):
            super().__init__()
            self.device = torch.device(model_runner.device)
            self.kv_cache_dtype_str = _kv_cache_dtype_str(model_runner)
            self.fp8 = mla_plugins.fp8_requested(self.kv_cache_dtype_str)
            self.forward_metadata: ExtendMetadata | None = None
            logger.info(
                "mla_plugins SGLang prefill backend: kv_cache_dtype=%s -> %s prefill",
                self.kv_cache_dtype_str, "fp8" if self.fp8 else "bf16/fp16",
            )

        # --- metadata: both base-class generations -------------------------------------
        def init_forward_metadata(self, forward_batch):
            mode = forward_batch.forward_mode
            if mode.is_decode_or_idle():
                if mode.is_decode():
                    raise RuntimeError(f"{BACKEND_NAME} got a decode batch. {_decode_flag_hint()}")
                self.forward_metadata = None
                return
            self.forward_metadata = extend_metadata(forward_batch)

        def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
            if in_capture:
                raise RuntimeError(
                    f"{BACKEND_NAME} does not support CUDA-graph capture of prefill; run with "
                    "--disable-piecewise-cuda-graph (decode graphs belong to the decode backend)"
                )
            self.init_forward_metadata(forward_batch)

        def init_forward_metadata_in_graph(self, forward_batch):
            return None

        # --- forward ---------------------------------------------------------------------
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            raise RuntimeError(f"{BACKEND_NAME} got a decode call. {_decode_flag_hint()}")

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            """q: [T, H*Dqk] or [T, H, Dqk]; k: [N, H, Dqk]; v: [N, H, Dv].

            Returns [T, H*Dv], or ([T, H, Dv], lse [T, H] float32) when SGLang asks for lse
            (`forward_batch.mha_return_lse`, the chunked-prefix path).
            """
            heads, dqk, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
            if k is None or v is None or "k_rope" in kwargs or layer.tp_k_head_num != heads:
                raise NotImplementedError(
                    f"{BACKEND_NAME} runs MLA prefill in MHA form (q/k/v with {heads} heads each); "
                    f"found the absorbed MLA form (k={'None' if k is None else tuple(k.shape)}, "
                    f"{layer.tp_k_head_num} kv heads), which DeepSeek uses for speculative "
                    "verify/draft extends and captured prefill graphs. Run without speculative "
                    "decoding and without piecewise prefill graphs, or use another prefill backend."
                )
            if save_kv_cache:
                raise ValueError(
                    f"{BACKEND_NAME}: found save_kv_cache=True, expected False: DeepSeek's MHA path "
                    "writes its latent KV cache itself before attention"
                )
            meta = self.forward_metadata
            if meta is None:
                meta = self.forward_metadata = extend_metadata(forward_batch)
            q3 = q.reshape(-1, heads, dqk)
            k3 = k.view(-1, heads, dqk)
            v3 = v.view(-1, heads, dv)
            if q3.shape[0] != meta.total_q:
                raise ValueError(
                    f"{BACKEND_NAME}: found {q3.shape[0]} query rows, expected {meta.total_q} "
                    "(the batch's extend tokens)"
                )
            return_lse = bool(getattr(forward_batch, "mha_return_lse", False))
            if getattr(forward_batch, "attn_attend_prefix_cache", False):
                # One chunk of cached prefix: every new token sees all of it.
                idx = forward_batch.prefix_chunk_idx
                cu_k = forward_batch.prefix_chunk_cu_seq_lens[idx].to(torch.int32)
                causal, entry, return_lse = False, "prefix_chunk", True
            elif k3.shape[0] == meta.total_q:
                cu_k, causal, entry = meta.cu_seqlens_q, True, "extend"
            elif k3.shape[0] == meta.total_all:
                cu_k, causal, entry = meta.cu_seqlens_all, True, "extend_with_prefix"
            else:
                raise ValueError(
                    f"{BACKEND_NAME}: found {k3.shape[0]} key rows, expected {meta.total_q} (new "
                    f"tokens) or {meta.total_all} (cached prefix + new tokens)"
                )
            with mla_plugins.trace_context(FRAMEWORK, entry):
                result = mla_plugins.mla_prefill(
                    q3, k3, v3, meta.cu_seqlens_q, cu_k,
                    softmax_scale=layer.scaling, causal=causal, fp8=self.fp8, return_lse=return_lse,
                )
            if return_lse:
                return result
            return result.view(-1, heads * dv)

        def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            raise NotImplementedError(f"{BACKEND_NAME} has no mixed (chunked prefill + decode) path")

    return MLAPluginsAttnBackend
