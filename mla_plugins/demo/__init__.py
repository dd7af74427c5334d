"""Demos of `make demo`, outside the adapters: a tiny random DeepSeek-V2 checkpoint
(`tiny_model`), vLLM's real engine on it (`vllm_engine`, `vllm_demo`) and SGLang's
(`sglang_demo`). Nothing in the adapters imports this package."""
