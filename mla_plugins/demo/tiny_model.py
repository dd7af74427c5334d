"""A tiny random-weight DeepSeek-V2 checkpoint, written locally (nothing downloads).

The MLA dimensions are DeepSeek's real ones (kv_lora_rank 512, rope 64, nope 128,
v 128), so vLLM takes its MLA path with a 192-wide query/key head and a 128-wide
value head; everything else is shrunk so an engine starts in seconds on a CPU.
All layers are dense (``first_k_dense_replace == num_hidden_layers``): MoE adds
nothing to the attention path under test and is slow on CPU.

Weights are scaled so activations stay O(1) and the logits are spread out
(std ~ ``logit_scale``): with the default 0.02 init every logit is near 0 and
greedy argmax would hinge on rounding noise, which makes token comparisons
between two correct attention implementations meaningless.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

MLA_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def tiny_deepseek_v2_config(
    *, num_layers: int = 2, hidden: int = 256, num_heads: int = 4, vocab: int = 1024,
    max_positions: int = 4096, rope_scaling: dict | None = None,
) -> dict:
    """The config.json dict of the tiny model."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden,
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "q_lora_rank": None,
        **MLA_DIMS,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def _weights(cfg: dict, gen: torch.Generator, logit_scale: float) -> dict[str, torch.Tensor]:
    """Random weights in the HF DeepSeek-V2 naming vLLM's loader expects."""
    h, n = cfg["hidden_size"], cfg["num_attention_heads"]
    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, dv, inter, vocab = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["intermediate_size"], cfg["vocab_size"]

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        # std 1/sqrt(fan_in) keeps activations O(1) through the layers.
        return torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f))

    def norm(d: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=gen)

    w = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # gain 1: attention neither flat nor so sharp that fp8 rounding of q.k flips it
        w[p + "self_attn.q_proj.weight"] = lin(n * (nope + rope), h)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = lin(r + rope, h)
        w[p + "self_attn.kv_a_layernorm.weight"] = norm(r)
        w[p + "self_attn.kv_b_proj.weight"] = lin(n * (nope + dv), r)
        w[p + "self_attn.o_proj.weight"] = lin(h, n * dv)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
    w["model.norm.weight"] = norm(h)
    w["lm_head.weight"] = lin(vocab, h, logit_scale)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}


def build_tiny_deepseek_v2(path: str | Path, *, seed: int = 0, logit_scale: float = 4.0, **config_kw) -> Path:
    """Write config.json and model.safetensors of a random DeepSeek-V2 into `path`; return it."""
    from safetensors.torch import save_file  # ships with vLLM's requirements

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_deepseek_v2_config(**config_kw)
    gen = torch.Generator().manual_seed(seed)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(_weights(cfg, gen, logit_scale), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
