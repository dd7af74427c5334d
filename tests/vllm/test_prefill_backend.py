"""Our MLAPrefillBackend against vLLM's own CPUSDPAMLAPrefillBackend and a float64 reference.

Same random inputs (DeepSeek head dims 192/128, never zeros) go through both backends'
real `run_prefill_new_tokens` / `run_prefill_context_chunk`, with vLLM's own metadata
classes; the merged result (vLLM's `merge_attn_states`) is checked against attention
over context + new tokens, which only holds if our lse layout is the one vLLM expects.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import reference_attention, rel_l2

H, DQK, DV = 4, 192, 128
SCALE = DQK**-0.5
TOL = {False: 1e-2, True: 6e-2}  # the core's tolerances: bf16, fp8
LSE_TOL = {False: 1e-3, True: 0.25}  # absolute, natural log; fp8 e4m3 rounds q.k by ~2^-4 relative
# (test ids say "fp8_compute": a bare "fp8" id would trigger the GPU-only fp8 marker skip)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(total_q, total_k, gen):
    q = torch.randn(total_q, H, DQK, generator=gen).to(torch.bfloat16)
    k = torch.randn(total_k, H, DQK, generator=gen).to(torch.bfloat16)
    v = torch.randn(total_k, H, DV, generator=gen).to(torch.bfloat16)
    return q, k, v


def _backends(vllm_config, monkeypatch, fp8):
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    from mla_plugins.vllm.prefill import MLAPluginsPrefillBackend

    monkeypatch.setenv("MLA_PLUGINS_FP8", "1" if fp8 else "0")
    kw = dict(num_heads=H, scale=SCALE, kv_lora_rank=512, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=DV, vllm_config=vllm_config)
    ours, theirs = MLAPluginsPrefillBackend(**kw), CPUSDPAMLAPrefillBackend(**kw)
    assert ours.fp8 is fp8 and ours.supports_out()
    return ours, theirs


def _prefill_metadata(cu_q):
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    lens = (cu_q[1:] - cu_q[:-1]).tolist()
    return MLACommonPrefillMetadata(block_table=torch.zeros(len(lens), 1, dtype=torch.int32),
                                    query_start_loc=cu_q, max_query_len=max(lens))


def _context_chunk(q_lens, ctx_lens):
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    cu_q, cu_k = _cu(q_lens), _cu(ctx_lens)
    return MLACommonPrefillMetadata.ContextChunk(
        index=0, request_slice=slice(0, len(q_lens)), token_slice=slice(0, sum(q_lens)),
        continuation_token_end=0, is_continuation=False, num_context_tokens=sum(ctx_lens),
        query_start_loc=cu_q, max_query_len=max(q_lens), cu_seq_lens=cu_k,
        starts=torch.zeros(len(q_lens), dtype=torch.int32), max_seq_len=max(ctx_lens),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        token_to_seq=torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(ctx_lens)),
        all_rows_active=True,
    )


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_compute"])
def test_new_tokens_match_vllm_cpu_backend(vllm_config, monkeypatch, fp8):
    gen = torch.Generator().manual_seed(11 + fp8)
    lens = [1, 255, 257, 40]  # one row, tile boundaries (256-row tiles), a short one
    cu = _cu(lens)
    q, k, v = _qkv(sum(lens), sum(lens), gen)
    ours, theirs = _backends(vllm_config, monkeypatch, fp8)
    for b in (ours, theirs):
        b.prepare_metadata(_prefill_metadata(cu))

    ref_o, ref_lse = reference_attention(q, k, v, cu, cu, SCALE, causal=True)
    vllm_o, vllm_lse = theirs.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)

    out = torch.full((sum(lens), H, DV), float("nan"), dtype=torch.bfloat16)
    got = ours.run_prefill_new_tokens(q, k, v, return_softmax_lse=False, out=out)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any(), "every element of out written"
    assert rel_l2(out, vllm_o) <= TOL[fp8] and rel_l2(out, ref_o) <= TOL[fp8]

    o, lse = ours.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    assert lse.shape == vllm_lse.shape == (H, sum(lens)) and lse.dtype == torch.float32
    assert rel_l2(o, vllm_o) <= TOL[fp8]
    assert (lse - ref_lse.T).abs().max() <= LSE_TOL[fp8]
    assert (lse - vllm_lse).abs().max() <= LSE_TOL[fp8]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_compute"])
def test_context_chunk_and_merge_match_full_attention(vllm_config, monkeypatch, fp8):
    """New tokens (causal) + one context chunk (non-causal), merged by vLLM == attention over both."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    gen = torch.Generator().manual_seed(23 + fp8)
    q_lens, ctx_lens = [3, 300, 17], [200, 64, 513]
    cu_q, cu_ctx = _cu(q_lens), _cu(ctx_lens)
    q, k_new, v_new = _qkv(sum(q_lens), sum(q_lens), gen)
    _, k_ctx, v_ctx = _qkv(1, sum(ctx_lens), gen)
    ours, theirs = _backends(vllm_config, monkeypatch, fp8)
    chunk = _context_chunk(q_lens, ctx_lens)

    vllm_o, vllm_lse = theirs.run_prefill_context_chunk(chunk, q, k_ctx, v_ctx)
    ctx_o, ctx_lse = ours.run_prefill_context_chunk(chunk, q, k_ctx, v_ctx)
    assert ctx_lse.shape == vllm_lse.shape == (H, sum(q_lens))
    assert rel_l2(ctx_o, vllm_o) <= TOL[fp8]
    assert (ctx_lse - vllm_lse).abs().max() <= LSE_TOL[fp8]

    ours.prepare_metadata(_prefill_metadata(cu_q))
    new_o, new_lse = ours.run_prefill_new_tokens(q, k_new, v_new, return_softmax_lse=True)
    merged = torch.full_like(new_o, float("nan"))
    merge_attn_states(output=merged, prefix_output=ctx_o, prefix_lse=ctx_lse,
                      suffix_output=new_o, suffix_lse=new_lse)

    # the same attention in one piece: each sequence's keys = its context, then its new tokens
    ks, vs, cu_all = [], [], [0]
    for b in range(len(q_lens)):
        ks += [k_ctx[cu_ctx[b]:cu_ctx[b + 1]], k_new[cu_q[b]:cu_q[b + 1]]]
        vs += [v_ctx[cu_ctx[b]:cu_ctx[b + 1]], v_new[cu_q[b]:cu_q[b + 1]]]
        cu_all.append(cu_all[-1] + ctx_lens[b] + q_lens[b])
    ref_o, _ = reference_attention(q, torch.cat(ks), torch.cat(vs), cu_q,
                                   torch.tensor(cu_all, dtype=torch.int32), SCALE, causal=True)
    assert not merged.isnan().any()
    assert rel_l2(merged, ref_o) <= TOL[fp8]


def test_rejects_fp8_query_and_fused_output(vllm_config, monkeypatch):
    ours, _ = _backends(vllm_config, monkeypatch, False)
    cu = _cu([4])
    ours.prepare_metadata(_prefill_metadata(cu))
    q, k, v = _qkv(4, 4, torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="found q dtype torch.float8_e4m3fn, expected bf16 or fp16"):
        ours.run_prefill_new_tokens(q.to(torch.float8_e4m3fn), k, v, return_softmax_lse=False)
    with pytest.raises(NotImplementedError, match="output_scale"):
        ours.run_prefill_new_tokens(q, k, v, return_softmax_lse=False, output_scale=torch.ones(()))
