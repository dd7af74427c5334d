"""Stand-in for the `vllm` package in the core session (no vLLM installed there): just enough
for the REAL vLLM 0.32 `vllm/vllm_flash_attn/__init__.py` and `flash_attn_interface.py` (both
verbatim here) to import and answer `fa_version_unsupported_reason(3)`. The real vLLM is tested
in the vllm session (tests/vllm/test_flash_attn_vllm.py), with only `_vllm_fa3_C` faked.
"""
