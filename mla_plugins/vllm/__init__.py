"""vLLM adapter: an entry-point plugin that puts mla-plugins' MLA prefill into vLLM.

vLLM runs `register()` in every process it starts (API server, engine core, workers)
through the entry point `vllm.general_plugins: mla_plugins = mla_plugins.vllm:register`
(set `VLLM_PLUGINS` to a list without `mla_plugins` to keep it out). Importing this
package imports no vLLM; `register()` imports it lazily.

What `register()` does (vLLM 0.32 and 0.33; on any other version it logs one warning and
does only the AITER shim, below):
- registers `MLAPluginsPrefillBackend` as vLLM's MLA prefill backend `CUSTOM` and under
  the name `MLA_PLUGINS`; select it with
      vllm serve MODEL --attention-config '{"mla_prefill_backend": "MLA_PLUGINS"}'
      vllm serve MODEL --attention-config.mla_prefill_backend MLA_PLUGINS
      LLM(model=..., attention_config={"mla_prefill_backend": "MLA_PLUGINS"})
  (`CUSTOM` works in the same places, while no other plugin claims it). `LLM()` parses
  attention_config before it loads plugins, so in Python the name MLA_PLUGINS needs
  `vllm.plugins.load_general_plugins()` (or `mla_plugins.vllm.register()`) first;
  `CUSTOM` does not. The name survives vLLM's spawned engine-core and worker processes:
  it pickles by name and registers itself where it is unpickled.
  vLLM's CPU platform ignores this selection: see MLA_PLUGINS_VLLM_OVERRIDE.
- MLA_PLUGINS_VLLM_OVERRIDE=CPU[,NAME...]: our backend takes these built-in slots, for
  platforms that ignore the selection above (vLLM's CPU platform always uses its `CPU`
  prefill slot). Prefill slots: any `MLAPrefillBackendEnum` name (CPU, ZEN_CPU,
  ROCM_AITER_FA, FLASH_ATTN, ...). Whole-backend slots: ROCM_AITER_MLA and
  ROCM_AITER_TRITON_MLA, vLLM's AITER MLA backends with their built-in FP8 ASM prefill
  turned off (in the impl and in the metadata builder, which then no longer plans every
  batch for it), so prefill goes through the selected MLA prefill backend (the only way in
  where AITER's FP8 path would run).
- MLA_PLUGINS_VLLM_CPU_CHUNKED_PREFILL=1: keep chunked prefill on for MLA models on the
  CPU platform, which vLLM 0.32 turns off for its reference CPU MLA backend (platforms/
  cpu.py); both vLLM's CPU SDPA prefill and ours handle the context chunks it creates.
- AITER shim (any vLLM whose `AiterMLAImpl` binds `self._mla_reduce_v1`, 0.22 through
  0.33, read from its code, not its version; MLA_PLUGINS_SHIM=0 turns it off): vLLM's
  `AiterMLAImpl._mla_reduce_v1` is bound to `mla_plugins.aiter_mla_reduce_v1`, so the
  8-argument call of vLLM 0.22-0.24 and the 9-argument call of 0.25+ both work with AITER
  before and after ROCm/aiter#3391. register() only wraps `AiterMLAImpl.__init__` when vLLM
  imports that module (no aiter import, no GPU query there); the instance is rebound in the
  process that builds the model, after vLLM's own `__init__` imported aiter, and only when
  AITER's convention is known (otherwise one log line says why and vLLM's call is left).
- MLA_PLUGINS_TRACE=<file>: each prefill call appends a JSON line (entry `new_tokens` or
  `context_chunk`, framework `vllm`, with the pid of the worker that ran it), and each
  batch the prefill backend plans (once, in `prepare_metadata`) one line with entry `plan`.
- FP8 or bf16: `mla_plugins.fp8_requested(kv_cache_dtype)`: MLA_PLUGINS_FP8=1/0 decides,
  else FP8 iff the KV cache dtype is fp8*.
"""

from __future__ import annotations

from .registration import BACKEND_NAME, PREFILL_CLASS_PATH, SUPPORTED_VLLM, register

__all__ = ["BACKEND_NAME", "PREFILL_CLASS_PATH", "SUPPORTED_VLLM", "register"]
