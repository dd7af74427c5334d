"""Our MLAPrefillBackend against vLLM's own CPUSDPAMLAPrefillBackend and a float64 reference.

Same random inputs (DeepSeek head dims 192/128, never zeros) go through both backends'
real `run_prefill_new_tokens` / `run_prefill_context_chunk`, with vLLM's own metadata
classes; the merged result (vLLM's `merge_attn_states`) is checked against attention
over context + new tokens, which only holds if our lse layout is the one vLLM expects.
"""

from __future__ import annotations

import pytest
import torch

import mla_plugins

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


def _prefill_metadata(cu_q, chunks=None):
    """vLLM's prefill metadata as its builder makes it: device offsets plus the host copy
    of the query lengths (`query_lens_cpu`)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    lens = (cu_q[1:] - cu_q[:-1]).tolist()
    chunked = None
    if chunks:
        chunked = MLACommonPrefillMetadata.ChunkedContextMetadata(
            context_lens=torch.zeros(len(lens), dtype=torch.int32), workspace=torch.empty(0),
            chunks=chunks, context_lens_list=[0] * len(lens), empty_token_slices=[])
    return MLACommonPrefillMetadata(block_table=torch.zeros(len(lens), 1, dtype=torch.int32),
                                    query_start_loc=cu_q, max_query_len=max(lens),
                                    chunked_context=chunked,
                                    query_lens_cpu=torch.tensor(lens, dtype=torch.int32))


def _context_chunk(q_lens, ctx_lens, *, index=0, request_start=0, token_start=0):
    """One `ContextChunk` as vLLM's `build_mla_chunked_context_metadata` builds it, for the
    requests [request_start, request_start + len(q_lens)) of the prefill."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    cu_q, cu_k = _cu(q_lens), _cu(ctx_lens)
    return MLACommonPrefillMetadata.ContextChunk(
        index=index, request_slice=slice(request_start, request_start + len(q_lens)),
        token_slice=slice(token_start, token_start + sum(q_lens)),
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

    passed = []
    prefill = mla_plugins.mla_prefill

    def spy(*args, **kwargs):
        passed.append(kwargs.get("lse"))
        return prefill(*args, **kwargs)

    monkeypatch.setattr(mla_plugins, "mla_prefill", spy)
    o, lse = ours.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    assert lse.shape == vllm_lse.shape == (H, sum(lens)) and lse.dtype == torch.float32
    # the CPU's kernel hands back [total_q, H]: the adapter has it write vLLM's [H, total_q]
    # buffer in place (a copy afterwards would give another tensor)
    assert passed[-1] is not None and passed[-1].data_ptr() == lse.data_ptr()
    assert lse.is_contiguous() and passed[-1].stride() == (1, sum(lens))
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
    for b in (ours, theirs):
        b.prepare_metadata(_prefill_metadata(cu_q, [chunk]))

    vllm_o, vllm_lse = theirs.run_prefill_context_chunk(chunk, q, k_ctx, v_ctx)
    ctx_o, ctx_lse = ours.run_prefill_context_chunk(chunk, q, k_ctx, v_ctx)
    assert ctx_lse.shape == vllm_lse.shape == (H, sum(q_lens))
    assert rel_l2(ctx_o, vllm_o) <= TOL[fp8]
    assert (ctx_lse - vllm_lse).abs().max() <= LSE_TOL[fp8]

    new_o, new_lse = ours.run_prefill_new_tokens(q, k_new, v_new, return_softmax_lse=True)
    assert ours.stats == {"batches": 1, "plans": 2, "late": 0, "workspace_fallbacks": 0}
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


# -- serving path: one plan per batch, nothing read back in the per-layer calls --------------

_TENSOR_PROPERTIES = {torch.Tensor.device.__get__, torch.Tensor.dtype.__get__, torch.Tensor.shape.__get__}


class _DeviceOnly(torch.Tensor):
    """Offsets that live on the device: any torch op on them (.tolist(), .item(), .cpu(),
    indexing, arithmetic, being passed to a kernel) raises; asking their device does not."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _TENSOR_PROPERTIES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise AssertionError(f"device offsets used on the host: {getattr(func, '__name__', func)}")


def _device_only(t):
    return t.as_subclass(_DeviceOnly)


def _batch_with_context(gen):
    """Three prefill requests (new tokens 3, 300, 17) over two context chunks, as vLLM cuts
    them: chunk 0 holds requests 0-1 (contexts 200, 64), chunk 1 request 2 (context 513)."""
    q_lens = [3, 300, 17]
    chunk_reqs = [([0, 1], [200, 64]), ([2], [513])]
    q, k_new, v_new = _qkv(sum(q_lens), sum(q_lens), gen)
    chunks, kv = [], []
    for index, (reqs, ctx) in enumerate(chunk_reqs):
        _, k_ctx, v_ctx = _qkv(1, sum(ctx), gen)
        token_start = sum(q_lens[: reqs[0]])
        chunks.append(_context_chunk([q_lens[r] for r in reqs], ctx, index=index,
                                     request_start=reqs[0], token_start=token_start))
        kv.append((k_ctx, v_ctx))
    return q_lens, q, k_new, v_new, chunks, kv


def test_per_layer_calls_read_nothing_back_and_the_batch_is_planned_once(vllm_config, monkeypatch):
    """prepare_metadata plans from query_lens_cpu and ContextChunk.seq_lens only; the layer
    calls pass the plan to mla_prefill and never touch an offset tensor (they raise here)."""
    import mla_plugins
    from mla_plugins.vllm import prefill as module

    gen = torch.Generator().manual_seed(5)
    q_lens, q, k_new, v_new, chunks, kv = _batch_with_context(gen)
    ours, theirs = _backends(vllm_config, monkeypatch, False)
    expected = []
    theirs.prepare_metadata(_prefill_metadata(_cu(q_lens), chunks))
    for chunk, (k_ctx, v_ctx) in zip(chunks, kv, strict=True):
        expected.append(theirs.run_prefill_context_chunk(chunk, q[chunk.token_slice], k_ctx, v_ctx))
    expected.append(theirs.run_prefill_new_tokens(q, k_new, v_new, return_softmax_lse=True))

    for chunk in chunks:  # what reaches the device in vLLM: poisoned here
        chunk.query_start_loc = _device_only(chunk.query_start_loc)
        chunk.cu_seq_lens = _device_only(chunk.cu_seq_lens)
    meta = _prefill_metadata(_cu(q_lens), chunks)
    meta.query_start_loc = _device_only(meta.query_start_loc)

    calls = {"plan_prefill": [], "mla_prefill": [], "sync_allowed": []}
    phase = {"now": "prepare"}
    real_plan, real_prefill, real_allowed = mla_plugins.plan_prefill, mla_plugins.mla_prefill, module._gpu_sync_allowed

    def plan_spy(*a, **kw):
        calls["plan_prefill"].append(phase["now"])
        assert all(isinstance(x, list) for x in a[:2]), "planned from host lists"
        return real_plan(*a, **kw)

    def prefill_spy(q, k, v, *a, **kw):
        assert not a and kw["plan"] is not None and kw.get("cu_seqlens_q") is None
        calls["mla_prefill"].append(phase["now"])
        return real_prefill(q, k, v, **kw)

    def allowed_spy():
        calls["sync_allowed"].append(phase["now"])
        return real_allowed()

    monkeypatch.setattr(mla_plugins, "plan_prefill", plan_spy)
    monkeypatch.setattr(mla_plugins, "mla_prefill", prefill_spy)
    monkeypatch.setattr(module, "_gpu_sync_allowed", allowed_spy)

    ours.prepare_metadata(meta)
    phase["now"] = "layers"
    for _layer in range(3):  # every layer of the forward reuses the batch's plans
        got = [ours.run_prefill_context_chunk(chunk, q[chunk.token_slice], k_ctx, v_ctx)
               for chunk, (k_ctx, v_ctx) in zip(chunks, kv, strict=True)]
        got.append(ours.run_prefill_new_tokens(q, k_new, v_new, return_softmax_lse=True))
        for (o, lse), (ref_o, ref_lse) in zip(got, expected, strict=True):
            assert rel_l2(o, ref_o) <= TOL[False]
            assert (lse - ref_lse).abs().max() <= LSE_TOL[False]

    assert calls["plan_prefill"] == ["prepare"] * 3  # new tokens + one per context chunk
    assert calls["mla_prefill"] == ["layers"] * 9
    # one allow-region per batch, around the plans' copies to the device; none per layer
    assert calls["sync_allowed"] == ["prepare"]
    assert ours.stats == {"batches": 1, "plans": 3, "late": 0, "workspace_fallbacks": 0}


def test_unplanned_call_plans_late_with_one_read(vllm_config, monkeypatch):
    """A context chunk prepare_metadata never saw (a caller outside vLLM's builder) still
    works: planned in the call from its offsets, counted as late."""
    gen = torch.Generator().manual_seed(7)
    q_lens, ctx_lens = [5, 40], [100, 7]
    q, _, _ = _qkv(sum(q_lens), 1, gen)
    _, k, v = _qkv(1, sum(ctx_lens), gen)
    ours, theirs = _backends(vllm_config, monkeypatch, False)
    ours.prepare_metadata(_prefill_metadata(_cu(q_lens)))
    chunk = _context_chunk(q_lens, ctx_lens)
    o, lse = ours.run_prefill_context_chunk(chunk, q, k, v)
    ref_o, ref_lse = theirs.run_prefill_context_chunk(chunk, q, k, v)
    assert rel_l2(o, ref_o) <= TOL[False] and (lse - ref_lse).abs().max() <= LSE_TOL[False]
    assert ours.stats["late"] == 1


# -- workspace from vLLM's workspace manager ---------------------------------------------------

@pytest.fixture
def workspace_manager(monkeypatch):
    """vLLM's WorkspaceManager on this CPU (vLLM's GPU worker makes one per device)."""
    from vllm.v1.worker import workspace

    # growing calls torch.accelerator.empty_cache(), which raises without an accelerator
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        yield workspace.current_workspace_manager()
    finally:
        workspace.reset_workspace_manager()


@pytest.fixture(scope="module")
def model_vllm_config(tmp_path_factory):
    """A VllmConfig of the tiny DeepSeek-V2 (4 heads, DeepSeek's MLA dims), 512-token batches."""
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

    from mla_plugins.demo.tiny_model import build_tiny_deepseek_v2

    path = build_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny"))
    model = ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048)
    return VllmConfig(model_config=model, scheduler_config=SchedulerConfig(
        max_model_len=2048, max_num_batched_tokens=512, max_num_seqs=4, is_encoder_decoder=False))


def _buffer(manager):
    return manager._current_workspaces[0]  # vLLM's one slot without DBO


def test_workspace_is_reserved_in_vllms_manager_and_used_per_call(
        model_vllm_config, workspace_manager, monkeypatch):
    import mla_plugins
    from mla_plugins.vllm import prefill as module
    from mla_plugins.vllm.prefill import MLAPluginsPrefillBackend

    monkeypatch.setenv("MLA_PLUGINS_FP8", "0")
    monkeypatch.setattr(module, "_reserved", set())
    ours = MLAPluginsPrefillBackend(num_heads=H, scale=SCALE, kv_lora_rank=512, qk_nope_head_dim=128,
                                    qk_rope_head_dim=64, v_head_dim=DV, vllm_config=model_vllm_config)
    reserved = _buffer(workspace_manager)
    assert reserved is not None and reserved.numel() > 0, "reserved when the backend is built"

    seen = []
    real = mla_plugins.mla_prefill

    def spy(*a, **kw):
        seen.append(kw["workspace"])
        return real(*a, **kw)

    monkeypatch.setattr(mla_plugins, "mla_prefill", spy)
    gen = torch.Generator().manual_seed(3)
    lens = [512]  # the largest batch of this config: fits the reservation
    q, k, v = _qkv(sum(lens), sum(lens), gen)
    workspace_manager.lock()  # as vLLM does after its profile and warm-up
    ours.prepare_metadata(_prefill_metadata(_cu(lens)))
    o = ours.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    ref, _ = reference_attention(q, k, v, _cu(lens), _cu(lens), SCALE, causal=True)
    assert rel_l2(o, ref) <= TOL[False]
    (ws,) = seen
    plan = ours._new_tokens_plan
    if plan.workspace_bytes:
        assert ws is not None and ws.numel() == plan.workspace_bytes
        assert ws.untyped_storage().data_ptr() == reserved.untyped_storage().data_ptr()
        assert ws.data_ptr() % module.WORKSPACE_ALIGN == 0
    assert _buffer(workspace_manager) is reserved, "nothing grew after the lock"
    assert ours.stats["workspace_fallbacks"] == 0


def test_locked_workspace_too_small_falls_back_with_a_warning(vllm_config, workspace_manager, monkeypatch, caplog):
    ours, _ = _backends(vllm_config, monkeypatch, False)  # no model config: nothing reserved
    workspace_manager.lock()
    gen = torch.Generator().manual_seed(4)
    lens = [700, 300]
    q, k, v = _qkv(sum(lens), sum(lens), gen)
    ours.prepare_metadata(_prefill_metadata(_cu(lens)))
    if not ours._new_tokens_plan.workspace_bytes:
        pytest.skip("this plan needs no scratch on this device")
    with caplog.at_level("WARNING", logger="mla_plugins.vllm.prefill"):
        o = ours.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    ref, _ = reference_attention(q, k, v, _cu(lens), _cu(lens), SCALE, causal=True)
    assert rel_l2(o, ref) <= TOL[False]
    assert ours.stats["workspace_fallbacks"] == 1
    assert "vLLM's workspace cannot grow" in caplog.text


# -- VLLM_BATCH_INVARIANT -------------------------------------------------------------------

def test_batch_invariant_output_is_bitwise_the_same_alone_and_in_a_batch(vllm_config, monkeypatch):
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    gen = torch.Generator().manual_seed(9)
    alone = 1500  # six 256-row tiles: split over the keys by a plan with several workers
    others = [700, 33]
    ctx = 900
    q, k, v = _qkv(alone + sum(others), alone + sum(others), gen)
    _, k_ctx, v_ctx = _qkv(1, ctx + 50 + 600, gen)

    def run(backend, lens, ctx_lens, rows):
        cu = _cu(lens)
        chunk = _context_chunk(lens, ctx_lens)
        backend.prepare_metadata(_prefill_metadata(cu, [chunk]))
        n, nk = sum(lens), sum(ctx_lens)
        new = backend.run_prefill_new_tokens(q[:n], k[:n], v[:n], return_softmax_lse=True)
        old = backend.run_prefill_context_chunk(chunk, q[:n], k_ctx[:nk], v_ctx[:nk])
        merged = torch.empty_like(new[0])
        merge_attn_states(output=merged, prefix_output=old[0], prefix_lse=old[1],
                          suffix_output=new[0], suffix_lse=new[1])
        split = backend._new_tokens_plan.num_partial_tiles + backend._chunk_plans[0][1].num_partial_tiles
        return merged[rows], new[1][:, rows], split

    rows = slice(0, alone)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    ours, _ = _backends(vllm_config, monkeypatch, False)
    assert ours.batch_invariant
    o1, lse1, split1 = run(ours, [alone], [ctx], rows)
    o2, lse2, split2 = run(ours, [alone, *others], [ctx, 50, 600], rows)
    assert split1 == split2 == 0
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    default, _ = _backends(vllm_config, monkeypatch, False)
    _, _, split = run(default, [alone, *others], [ctx, 50, 600], rows)
    assert split > 0, "without the flag this batch is split over the keys (what the flag prevents)"


def test_batch_invariant_refuses_fp8(vllm_config, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT=1 with FP8 prefill"):
        _backends(vllm_config, monkeypatch, True)


def test_pinned_kernel_that_cannot_run_fails_when_the_backend_is_built(vllm_config, monkeypatch):
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "aiter")
    with pytest.raises(ValueError, match="MLA_PLUGINS_KERNEL='aiter' cannot run 4 heads per rank, "
                                         "head dims qk 192 / v 128, bfloat16, no fp8, on cpu"):
        _backends(vllm_config, monkeypatch, False)
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "no_such_kernel")
    with pytest.raises(ValueError, match="no_such_kernel"):
        _backends(vllm_config, monkeypatch, False)
    monkeypatch.setenv("MLA_PLUGINS_KERNEL", "torch")
    _backends(vllm_config, monkeypatch, False)
