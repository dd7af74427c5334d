"""The ROCM_AITER_MLA slot (MLA_PLUGINS_VLLM_OVERRIDE=ROCM_AITER_MLA).

vLLM's `AiterMLAImpl.forward_mha` runs AITER's FP8 ASM prefill on gfx950 with an fp8 KV
cache and never consults the selected MLA prefill backend. This subclass turns that path
off, so prefill goes through `MLACommonImpl.forward_mha` and the selected prefill backend
(select MLA_PLUGINS, or also put ROCM_AITER_FA in the override list). Decode is AITER's.
Imported by vLLM through the class path only (it imports vLLM at the top).
"""

from __future__ import annotations

from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLABackend, AiterMLAImpl


class MLAPluginsAiterMLAImpl(AiterMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fp8_prefill_enabled = False  # prefill: the selected MLAPrefillBackend


class MLAPluginsAiterMLABackend(AiterMLABackend):
    @staticmethod
    def get_impl_cls() -> type[MLAPluginsAiterMLAImpl]:
        return MLAPluginsAiterMLAImpl
