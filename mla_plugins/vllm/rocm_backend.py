"""The ROCM_AITER_MLA and ROCM_AITER_TRITON_MLA slots (MLA_PLUGINS_VLLM_OVERRIDE).

vLLM's `AiterMLAImpl.forward_mha` runs AITER's FP8 ASM prefill on gfx950 with an fp8 KV
cache and never consults the selected MLA prefill backend; `AiterTritonMLAImpl` inherits
it. These subclasses turn that path off, so prefill goes through `MLACommonImpl.forward_mha`
and the selected prefill backend (select MLA_PLUGINS, or also put ROCM_AITER_FA in the
override list). The metadata builder has its own copy of the FP8 flag (vLLM 0.32: lines
803-808 and 1591; 0.33: 1037-1041 and 1899-1904): while it is on, the builder reserves the
FP8 scratch and plans every prefill batch with AITER's `get_ps_metadata_v1` for a path that
never runs, so the builder here turns it off as well. Decode is AITER's.
Imported by vLLM through the class path only (it imports vLLM at the top).
"""

from __future__ import annotations

from vllm.v1.attention.backends.mla.aiter_triton_mla import (
    AiterTritonMLABackend,
    AiterTritonMLAImpl,
)
from vllm.v1.attention.backends.mla.rocm_aiter_mla import (
    AiterMLABackend,
    AiterMLAImpl,
    AiterMLAMetadataBuilder,
)


class MLAPluginsAiterMLAMetadataBuilder(AiterMLAMetadataBuilder):
    """vLLM's AITER MLA builder without its FP8-prefill buffers and per-batch planning."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # build() plans with get_ps_metadata_v1 while this is on; the impl never runs that path
        self._fp8_prefill_enabled = False

    def _init_fp8_prefill_ps_buffers(self, *args, **kwargs) -> None:
        # vLLM's __init__ calls this while its flag is still on: no PS buffers, no workspace
        # reservation for the FP8 scratch of a path that is off
        return None


class MLAPluginsAiterMLAImpl(AiterMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fp8_prefill_enabled = False  # prefill: the selected MLAPrefillBackend


class MLAPluginsAiterMLABackend(AiterMLABackend):
    @staticmethod
    def get_impl_cls() -> type[MLAPluginsAiterMLAImpl]:
        return MLAPluginsAiterMLAImpl

    @staticmethod
    def get_builder_cls() -> type[MLAPluginsAiterMLAMetadataBuilder]:
        return MLAPluginsAiterMLAMetadataBuilder


class MLAPluginsAiterTritonMLAImpl(AiterTritonMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fp8_prefill_enabled = False  # prefill: the selected MLAPrefillBackend


class MLAPluginsAiterTritonMLABackend(AiterTritonMLABackend):
    @staticmethod
    def get_impl_cls() -> type[MLAPluginsAiterTritonMLAImpl]:
        return MLAPluginsAiterTritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[MLAPluginsAiterMLAMetadataBuilder]:
        return MLAPluginsAiterMLAMetadataBuilder
