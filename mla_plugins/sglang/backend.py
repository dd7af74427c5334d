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

Planning: once per batch, from SGLang's host copies of the lengths
(`extend_seq_lens_cpu`, `extend_prefix_lens_cpu`; the prefix chunks' `prefix_chunk_seq_lens_cpu`
in `init_mha_chunk_metadata`), never from a device tensor: `init_forward_metadata` builds the
`mla_plugins.plan_prefill` plan of each call shape the batch's forward method makes, and
every layer's call passes `plan=` (no offsets read back, scratch from the workspace reserved
at construction for SGLang's largest prefill). Cores without host-offset plans (older
mla_plugins) get the offsets as before.

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
from dataclasses import dataclass, field

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


def _cumsum0(lengths) -> list[int]:
    """host lengths -> [0, l0, l0+l1, ...]"""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


@dataclass
class ExtendMetadata:
    """Offsets of one extend batch, built from host lengths (the plans hold device copies).

    cu_q_host:   [B+1] offsets of the new tokens per sequence (`extend_seq_lens_cpu`)
    cu_all_host: [B+1] offsets of prefix + new tokens per sequence
    method: "extend" (no cached prefix), "extend_with_prefix" (MHA_ONE_SHOT) or "chunked"
            (MHA_CHUNKED_KV), as `deepseek_forward_method` decides for this batch
    plans: plan per call shape ("extend", "extend_with_prefix", ("prefix_chunk", i)), built
           once per batch and used by every layer
    """

    total_q: int
    total_all: int
    num_prefix_tokens: int
    cu_q_host: tuple[int, ...] = ()
    cu_all_host: tuple[int, ...] = ()
    method: str = "extend"
    plans: dict = field(default_factory=dict)


def _host_lengths(forward_batch) -> tuple[list[int], list[int]]:
    """(new tokens, cached prefix) per sequence, from the batch's host copies."""
    extend = forward_batch.extend_seq_lens_cpu
    if extend is None:
        # No host copy (not seen from SGLang's scheduler): one device read for the batch.
        extend = forward_batch.extend_seq_lens.tolist()
    extend = [int(n) for n in extend]
    prefix = forward_batch.extend_prefix_lens_cpu
    if prefix is None:
        seq_cpu = forward_batch.seq_lens_cpu
        seq = seq_cpu.tolist() if seq_cpu is not None else forward_batch.seq_lens.tolist()
        prefix = [int(s) - n for s, n in zip(seq[: len(extend)], extend, strict=True)]
    return extend, [int(n) for n in prefix]


def _method(prefix_lens, seq_total: int, capacity: int) -> str:
    if not any(prefix_lens):
        return "extend"
    return "extend_with_prefix" if seq_total <= capacity else "chunked"


def extend_metadata(forward_batch) -> ExtendMetadata:
    """Build the prefill offsets of a real SGLang `ForwardBatch` of an extend mode (host lengths)."""
    extend, prefix = _host_lengths(forward_batch)
    cu_q = _cumsum0(extend)
    cu_all = _cumsum0(p + n for p, n in zip(prefix, extend, strict=True))
    meta = ExtendMetadata(cu_q[-1], cu_all[-1], cu_all[-1] - cu_q[-1], tuple(cu_q), tuple(cu_all))
    meta.method = _method(prefix, cu_all[-1], forward_batch.get_max_chunk_capacity())
    return meta


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
    extend, prefix = _host_lengths(forward_batch)
    method = _method(prefix, sum(extend) + sum(prefix), forward_batch.get_max_chunk_capacity())
    return {"extend": AttnForwardMethod.MHA, "extend_with_prefix": AttnForwardMethod.MHA_ONE_SHOT,
            "chunked": AttnForwardMethod.MHA_CHUNKED_KV}[method]


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


def _model_dims(runner) -> tuple[int | None, int | None, int | None, torch.dtype]:
    """(heads per rank on DeepSeek's MHA path, qk head dim, v head dim, dtype); None when
    the runner does not say (then the first layer's call tells, once per batch)."""
    cfg = getattr(runner, "model_config", None)
    hf = getattr(cfg, "hf_config", None)

    def dim(name):
        value = getattr(cfg, name, None)
        return value if isinstance(value, int) else getattr(hf, name, None)

    nope, rope, dv, heads = (dim(n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                               "num_attention_heads"))
    try:
        from sglang.srt.runtime_context import get_parallel

        attn_tp = get_parallel().attn_tp_size
    except Exception:  # older SGLang or no parallel state (a test runner): per-layer dims decide
        attn_tp = None
    local = heads // attn_tp if isinstance(heads, int) and isinstance(attn_tp, int) and attn_tp > 0 else None
    dqk = nope + rope if isinstance(nope, int) and isinstance(rope, int) else None
    dtype = getattr(runner, "dtype", None)
    return local, dqk, dv if isinstance(dv, int) else None, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


def _max_prefill_tokens(runner) -> int | None:
    args = getattr(runner, "server_args", None)
    for name in ("chunked_prefill_size", "max_prefill_tokens"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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
            self.heads, self.head_dim_qk, self.head_dim_v, self.dtype = _model_dims(model_runner)
            #: batches seen and plans built (one per call shape per batch, never per layer)
            self.num_batches = 0
            self.num_plans = 0
            self.workspace_bytes = self._reserve_workspace(_max_prefill_tokens(model_runner))
            logger.info(
                "mla_plugins SGLang prefill backend: kv_cache_dtype=%s -> %s prefill; %s",
                self.kv_cache_dtype_str, "fp8" if self.fp8 else "bf16/fp16",
                f"plans per batch, workspace {self.workspace_bytes} bytes reserved",
            )

        def _reserve_workspace(self, max_tokens: int | None) -> int:
            """Size the shared workspace once, for a batch of SGLang's largest prefill."""
            if not (max_tokens and self.heads and self.head_dim_qk and self.head_dim_v):
                return 0
            try:
                plan = mla_plugins.plan_prefill(
                    [0, max_tokens], [0, max_tokens], num_heads=self.heads, causal=True,
                    device=self.device, dtype=self.dtype, fp8=self.fp8,
                    head_dim_qk=self.head_dim_qk, head_dim_v=self.head_dim_v,
                )
                mla_plugins.reserve_workspace(self.device, plan.workspace_bytes)
                return plan.workspace_bytes
            except Exception:  # the workspace then grows on the first call that needs it
                logger.warning("mla_plugins: reserving the prefill workspace for %d tokens failed; "
                               "it grows on first use", max_tokens, exc_info=True)
                return 0

        def _plan(self, meta: ExtendMetadata, key, cu_q, cu_k, *, causal: bool, heads: int,
                  dqk: int, dv: int, dtype: torch.dtype):
            plan = meta.plans.get(key)
            if plan is not None and plan.num_heads == heads:
                return plan
            plan = meta.plans[key] = mla_plugins.plan_prefill(
                list(cu_q), list(cu_k), num_heads=heads, causal=causal, device=self.device,
                dtype=dtype, fp8=self.fp8, head_dim_qk=dqk, head_dim_v=dv,
            )
            self.num_plans += 1
            logger.debug("mla_plugins plan: batch %d %s %s kernel=%s", self.num_batches, meta.method,
                         key if isinstance(key, str) else f"{key[0]}[{key[1]}]", plan.kernel)
            return plan

        def _plan_now(self, meta: ExtendMetadata, key, cu_q, cu_k, causal: bool):
            if self.heads and self.head_dim_qk and self.head_dim_v:
                self._plan(meta, key, cu_q, cu_k, causal=causal, heads=self.heads,
                           dqk=self.head_dim_qk, dv=self.head_dim_v, dtype=self.dtype)

        # --- metadata: both base-class generations -------------------------------------
        def init_forward_metadata(self, forward_batch):
            mode = forward_batch.forward_mode
            if mode.is_decode_or_idle():
                if mode.is_decode():
                    raise RuntimeError(f"{BACKEND_NAME} got a decode batch. {_decode_flag_hint()}")
                self.forward_metadata = None
                return
            self.num_batches += 1
            meta = self.forward_metadata = extend_metadata(forward_batch)
            # The calls this batch's forward method makes (prefix chunks: init_mha_chunk_metadata).
            if meta.method == "extend_with_prefix":
                self._plan_now(meta, "extend_with_prefix", meta.cu_q_host, meta.cu_all_host, True)
            else:
                self._plan_now(meta, "extend", meta.cu_q_host, meta.cu_q_host, True)

        def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
            if in_capture:
                raise RuntimeError(
                    f"{BACKEND_NAME} does not support CUDA-graph capture of prefill; run with "
                    "--disable-piecewise-cuda-graph (decode graphs belong to the decode backend)"
                )
            self.init_forward_metadata(forward_batch)

        def init_forward_metadata_in_graph(self, forward_batch):
            return None

        def init_mha_chunk_metadata(self, forward_batch, disable_flashinfer_ragged: bool = False):
            """SGLang calls this once per batch (first layer) after splitting the cached prefix
            into chunks: plan each chunk's call from the host chunk lengths."""
            meta = self.forward_metadata
            lens = getattr(forward_batch, "prefix_chunk_seq_lens_cpu", None)
            if meta is None or lens is None or not forward_batch.num_prefix_chunks:
                return
            for i in range(forward_batch.num_prefix_chunks):
                self._plan_now(meta, ("prefix_chunk", i), meta.cu_q_host, _cumsum0(lens[i].tolist()), False)

        def _chunk_offsets_host(self, forward_batch, idx: int) -> list[int]:
            lens = getattr(forward_batch, "prefix_chunk_seq_lens_cpu", None)
            if lens is not None:
                return _cumsum0(lens[idx].tolist())
            # SGLang versions without the host copy: one device read per chunk and batch
            return [int(x) for x in forward_batch.prefix_chunk_cu_seq_lens[idx].tolist()]

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
                key, causal, entry, return_lse = ("prefix_chunk", idx), False, "prefix_chunk", True
                cu_k_host = None  # only read if this chunk has no plan yet
            elif k3.shape[0] == meta.total_q:
                key, causal, entry = "extend", True, "extend"
                cu_k_host = meta.cu_q_host
            elif k3.shape[0] == meta.total_all:
                key, causal, entry = "extend_with_prefix", True, "extend_with_prefix"
                cu_k_host = meta.cu_all_host
            else:
                raise ValueError(
                    f"{BACKEND_NAME}: found {k3.shape[0]} key rows, expected {meta.total_q} (new "
                    f"tokens) or {meta.total_all} (cached prefix + new tokens)"
                )
            with mla_plugins.trace_context(FRAMEWORK, entry):
                plan = meta.plans.get(key)
                if plan is None or plan.num_heads != heads:
                    if cu_k_host is None:
                        cu_k_host = self._chunk_offsets_host(forward_batch, idx)
                    plan = self._plan(meta, key, meta.cu_q_host, cu_k_host, causal=causal,
                                      heads=heads, dqk=dqk, dv=dv, dtype=q3.dtype)
                # SGLang's merge_state kernels index lse [T, H] densely: the kernel writes it
                # there (a provider whose own lse has another layout, FA3's [H, T] or
                # [B, H, S], makes its one copy into it)
                lse = (torch.empty((q3.shape[0], heads), dtype=torch.float32, device=q3.device)
                       if return_lse else None)
                result = mla_plugins.mla_prefill(
                    q3, k3, v3, plan=plan, softmax_scale=layer.scaling, causal=causal,
                    fp8=self.fp8, return_lse=return_lse, lse=lse,
                )
            if return_lse:
                return result
            return result.view(-1, heads * dv)

        def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            raise NotImplementedError(f"{BACKEND_NAME} has no mixed (chunked prefill + decode) path")

    return MLAPluginsAttnBackend
