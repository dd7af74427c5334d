"""The registered factory builds our backend from SGLang's own test-kit model runner
(`sglang.test.kits.attention_unittest`'s `MockMLAModelRunner`: a real `ModelRunner`
subclass with a real `ReqToTokenPool` and `MLATokenToKVPool`), and `forward_extend`, reached
through a real `RadixAttention` and `ForwardBatch`, matches float64 attention.

The q/k/v are formed the way DeepSeek's MHA path forms them: latent KV written to the MLA
pool for the cached prefix and the new tokens, read back by `req_to_token` locations,
decompressed by a kv_b projection, rope part appended.
"""

from __future__ import annotations

import math

import pytest
import torch

H, NOPE, ROPE, DV, LORA = 4, 128, 64, 128, 512
DQK = NOPE + ROPE
BF16_TOL, FP8_TOL = 1e-2, 6e-2
MAX_CTX = 64


@pytest.fixture(scope="module")
def sg():
    """Registered plugin plus the SGLang pieces the tests use."""
    import mla_plugins.sglang as adapter

    adapter.register()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    return type("SG", (), dict(ATTENTION_BACKENDS=ATTENTION_BACKENDS, RadixAttention=RadixAttention,
                               ForwardMode=ForwardMode, ForwardContext=ForwardContext,
                               forward_context=forward_context, kit=kit))


def _runner(sg, prefix_lens, extend_lens, *, fp8=False, decode="triton"):
    kit = sg.kit
    case = kit.MLAAttentionCase(name="mla_plugins", backend="mla_plugins", forward_mode=sg.ForwardMode.EXTEND,
                                num_heads=H, page_size=1, prefix_lens=tuple(prefix_lens),
                                extend_lens=tuple(extend_lens))
    config = kit.TinyMLAModelConfig(num_heads=H, kv_lora_rank=LORA, qk_rope_head_dim=ROPE, hidden_size=256,
                                    context_len=MAX_CTX)
    runner = kit.MockMLAModelRunner(case=case, model_config=config, dtype=torch.bfloat16, device="cpu",
                                    max_context_len=MAX_CTX, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                                    fp8_kv_cache=fp8)
    # ModelRunner stamps the resolved pair; a split prefill/decode configuration:
    runner.decode_attention_backend_str = decode
    batch = kit._make_forward_batch(case, runner, max_context_len=MAX_CTX, device="cpu")
    return case, runner, batch


def _layer(sg):
    # DeepSeek's attn_mha: H heads of 192 (q/k), v 128, scaling of the full qk dim.
    return sg.RadixAttention(num_heads=H, head_dim=DQK, scaling=DQK**-0.5, num_kv_heads=H, layer_id=0,
                             v_head_dim=DV)


def _deepseek_qkv(case, runner, batch, gen):
    """Write latent KV for every token to the pool, read it back, decompress like DeepSeek.

    Returns q [T, H, 192] (new tokens), and per-token k [N, H, 192], v [N, H, 128] for
    all tokens of every sequence (prefix first), plus the slice of the new tokens.
    """
    pool = runner.token_to_kv_pool
    req_to_token = runner.req_to_token_pool.req_to_token
    n_all = sum(case.seq_lens)
    latent = (torch.randn(n_all, 1, LORA + ROPE, generator=gen) * 0.5).to(torch.bfloat16)
    locs = torch.cat([req_to_token[b, :s].long() for b, s in enumerate(case.seq_lens)])
    layer = _layer_for_pool()
    pool.set_kv_buffer(layer, locs, latent, None)
    stored = pool.get_key_buffer(0)[locs].to(torch.bfloat16)  # fp8 pools round-trip here
    kv_b = (torch.randn(H * (NOPE + DV), LORA, generator=gen) * LORA**-0.5).to(torch.bfloat16)
    kv = (stored[:, 0, :LORA] @ kv_b.T).view(n_all, H, NOPE + DV)
    k = torch.empty(n_all, H, DQK, dtype=torch.bfloat16)
    k[..., :NOPE] = kv[..., :NOPE]
    k[..., NOPE:] = stored[:, :, LORA:]
    v = kv[..., NOPE:]  # a strided view, as DeepSeek passes it
    new_rows = torch.cat([torch.arange(st + p, st + s) for st, p, s in
                          zip(_starts(case.seq_lens), case.prefix_lens, case.seq_lens, strict=True)])
    q = torch.randn(sum(case.input_lens), H, DQK, generator=gen).to(torch.bfloat16)
    return q, k, v, new_rows


class _layer_for_pool:  # noqa: N801  (the pool reads only layer_id from it)
    layer_id = 0


def _starts(lens):
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out


def _reference(q, k, v, case, scale):
    """float64 bottom-right causal attention per sequence -> (out [T, H, Dv], lse [T, H])."""
    outs, lses = [], []
    qs = _starts(case.input_lens)
    ks = _starts(case.seq_lens)
    for b, (ql, kl) in enumerate(zip(case.input_lens, case.seq_lens, strict=True)):
        qb = q[qs[b]: qs[b] + ql].double()
        kb, vb = k[ks[b]: ks[b] + kl].double(), v[ks[b]: ks[b] + kl].double()
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        mask = torch.arange(kl)[None, :] <= (torch.arange(ql)[:, None] + (kl - ql))
        s = s.masked_fill(~mask, -math.inf)
        lses.append(torch.logsumexp(s, -1).transpose(0, 1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vb))
    return torch.cat(outs), torch.cat(lses)


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(sg, backend, batch, layer, q, k, v):
    with torch.no_grad(), sg.forward_context(sg.ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(batch)
        return layer(q.reshape(q.shape[0], -1), k, v, batch, save_kv_cache=False)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [((0, 0), (17, 5)), ((9, 0, 20), (4, 11, 1))],
    ids=["no_prefix", "cached_prefix"],
)
def test_forward_extend_matches_float64(sg, fp8, prefix_lens, extend_lens):
    case, runner, batch = _runner(sg, prefix_lens, extend_lens, fp8=fp8)
    backend = sg.ATTENTION_BACKENDS["mla_plugins"](runner)
    assert type(backend).__name__ == "MLAPluginsAttnBackend" and backend.fp8 is fp8
    gen = torch.Generator().manual_seed(1000 + sum(prefix_lens) + 7 * fp8)
    q, k, v, new_rows = _deepseek_qkv(case, runner, batch, gen)
    layer = _layer(sg)
    if sum(prefix_lens) == 0:
        k_in, v_in = k[new_rows], v[new_rows]  # AttnForwardMethod.MHA: new tokens only
    else:
        k_in, v_in = k, v  # AttnForwardMethod.MHA_ONE_SHOT: prefix + new tokens
    out = _run(sg, backend, batch, layer, q, k_in, v_in)
    assert out.shape == (q.shape[0], H * DV) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    ref, _ = _reference(q, k, v, case, DQK**-0.5)
    err = _rel_l2(out.view(-1, H, DV), ref)
    assert err <= (FP8_TOL if fp8 else BF16_TOL), f"rel-L2 {err:.3e}"


def test_chunked_prefix_path_returns_mergeable_lse(sg):
    """MHA_CHUNKED_KV: new tokens (causal, lse), then a prefix chunk (non-causal, lse)."""
    prefix_lens, extend_lens = (13, 0, 6), (3, 8, 5)
    case, runner, batch = _runner(sg, prefix_lens, extend_lens)
    backend = sg.ATTENTION_BACKENDS["mla_plugins"](runner)
    gen = torch.Generator().manual_seed(77)
    q, k, v, new_rows = _deepseek_qkv(case, runner, batch, gen)
    layer = _layer(sg)
    prefix_rows = torch.tensor(sorted(set(range(sum(case.seq_lens))) - set(new_rows.tolist())))
    batch.mha_return_lse = True
    batch.set_attn_attend_prefix_cache(False)
    o1, lse1 = _run(sg, backend, batch, layer, q, k[new_rows], v[new_rows])
    # SGLang's own chunk split (torch code of the ForwardBatch mixin), one chunk here.
    starts, lens = batch.get_prefix_chunk_seq_lens(batch.extend_prefix_lens, 1, max(prefix_lens))
    batch.prefix_chunk_cu_seq_lens = torch.zeros(1, len(prefix_lens) + 1, dtype=torch.int32)
    batch.prefix_chunk_cu_seq_lens[:, 1:] = lens.cumsum(1)
    batch.set_attn_attend_prefix_cache(True)
    batch.set_prefix_chunk_idx(0)
    o2, lse2 = _run(sg, backend, batch, layer, q, k[prefix_rows], v[prefix_rows])
    assert o1.shape == o2.shape == (q.shape[0], H, DV) and lse1.shape == (q.shape[0], H)
    assert lse1.dtype == torch.float32 and torch.isfinite(lse1).all()
    # SGLang's merge_state kernels index lse [T, H] densely
    assert lse1.is_contiguous() and lse2.is_contiguous()
    # Row of sequence 1 (no prefix) sees no prefix key: lse -inf, out 0.
    rows_b1 = slice(extend_lens[0], extend_lens[0] + extend_lens[1])
    assert torch.isneginf(lse2[rows_b1]).all() and (o2[rows_b1] == 0).all()
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    merged = (o1.double() * w1[..., None] + o2.double() * w2[..., None]) / (w1 + w2)[..., None]
    ref, ref_lse = _reference(q, k, v, case, DQK**-0.5)
    assert _rel_l2(merged, ref) <= BF16_TOL
    assert torch.allclose(m + torch.log(w1 + w2), ref_lse.float(), atol=1e-2)


def test_factory_refuses_decode_with_the_flag_to_add(sg):
    _, runner, _ = _runner(sg, (0,), (4,), decode="mla_plugins")
    with pytest.raises(ValueError, match="--decode-attention-backend"):
        sg.ATTENTION_BACKENDS["mla_plugins"](runner)


def test_factory_refuses_non_mla_models(sg):
    _, runner, _ = _runner(sg, (0,), (4,))
    runner.use_mla_backend = False
    with pytest.raises(ValueError, match="expected an MLA model"):
        sg.ATTENTION_BACKENDS["mla_plugins"](runner)


def test_deepseek_handler_keeps_extends_on_the_mha_path(sg):
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    handler = AttentionBackendRegistry.get_handler("mla_plugins")
    assert handler is not AttentionBackendRegistry.get_handler("triton")
    _, _, fresh = _runner(sg, (0, 0), (5, 3))
    assert handler(None, fresh) == AttnForwardMethod.MHA
    _, _, prefixed = _runner(sg, (7, 0), (5, 3))
    assert handler(None, prefixed) == AttnForwardMethod.MHA_ONE_SHOT


class _NoHostRead(torch.Tensor):
    """A batch tensor SGLang keeps on the device: reading it, or anything computed from it,
    on the host (a device sync on a GPU) raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            raise AssertionError(f"host read of a device tensor of the batch: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
               torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.numpy, torch.Tensor.cpu,
               torch.Tensor.__iter__}


def _watch(batch, *names):
    for name in names:
        t = getattr(batch, name, None)
        if isinstance(t, torch.Tensor) and not isinstance(t, _NoHostRead):
            setattr(batch, name, t.as_subclass(_NoHostRead))


def _count_plans(monkeypatch):
    import mla_plugins

    calls = {"plans": 0, "prefill_offsets": []}
    real_plan, real_prefill = mla_plugins.plan_prefill, mla_plugins.mla_prefill

    def plan_prefill(*a, **k):
        calls["plans"] += 1
        return real_plan(*a, **k)

    def mla_prefill(q, k, v, cu_q=None, cu_k=None, **kw):
        calls["prefill_offsets"].append((cu_q, cu_k, kw.get("plan") is not None))
        return real_prefill(q, k, v, cu_q, cu_k, **kw)

    monkeypatch.setattr(mla_plugins, "plan_prefill", plan_prefill)
    monkeypatch.setattr(mla_plugins, "mla_prefill", mla_prefill)
    return calls


LAYERS = 3


@pytest.mark.parametrize("prefix_lens,extend_lens", [((0, 0), (17, 5)), ((9, 0, 20), (4, 11, 1))],
                         ids=["no_prefix", "cached_prefix"])
def test_one_plan_per_batch_and_no_host_read_in_layers(sg, monkeypatch, prefix_lens, extend_lens):
    """MHA and MHA_ONE_SHOT: init_forward_metadata plans from the host lengths; each of
    LAYERS layer calls passes that plan and no offsets, reading no batch tensor."""
    case, runner, batch = _runner(sg, prefix_lens, extend_lens)
    backend = sg.ATTENTION_BACKENDS["mla_plugins"](runner)
    q, k, v, new_rows = _deepseek_qkv(case, runner, batch, torch.Generator().manual_seed(5))
    k_in, v_in = (k[new_rows], v[new_rows]) if sum(prefix_lens) == 0 else (k, v)
    _watch(batch, "seq_lens", "extend_seq_lens", "extend_prefix_lens", "extend_start_loc",
           "req_pool_indices", "out_cache_loc", "positions")
    calls = _count_plans(monkeypatch)
    layer = _layer(sg)
    with torch.no_grad(), sg.forward_context(sg.ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(batch)
        assert calls["plans"] == 1
        outs = [layer(q.reshape(q.shape[0], -1), k_in, v_in, batch, save_kv_cache=False)
                for _ in range(LAYERS)]
    assert calls["plans"] == 1 and backend.num_plans == 1 and backend.num_batches == 1
    assert calls["prefill_offsets"] == [(None, None, True)] * LAYERS
    ref, _ = _reference(q, k, v, case, DQK**-0.5)
    for out in outs:
        assert _rel_l2(out.view(-1, H, DV), ref) <= BF16_TOL


def test_chunked_prefix_plans_once_per_batch_from_host_chunk_lengths(sg, monkeypatch):
    """MHA_CHUNKED_KV as SGLang drives it: prepare_chunked_prefix_cache_info splits the prefix
    (here into 3 chunks), init_mha_chunk_metadata plans each chunk's call from
    prefix_chunk_seq_lens_cpu; every layer then reuses the 1 + 3 plans and reads nothing."""
    prefix_lens, extend_lens = (13, 0, 6), (3, 8, 5)
    case, runner, batch = _runner(sg, prefix_lens, extend_lens)
    backend = sg.ATTENTION_BACKENDS["mla_plugins"](runner)
    q, k, v, new_rows = _deepseek_qkv(case, runner, batch, torch.Generator().manual_seed(9))
    prefix_rows = torch.cat([torch.arange(st, st + p) for st, p in zip(_starts(case.seq_lens), prefix_lens,
                                                                      strict=True)])
    monkeypatch.setenv("SGLANG_MAX_KV_CHUNK_CAPACITY", "15")  # 15 // 3 sequences: chunks of 5 tokens
    calls = _count_plans(monkeypatch)
    layer = _layer(sg)
    with torch.no_grad(), sg.forward_context(sg.ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(batch)
        assert backend.forward_metadata.method == "chunked"
        # SGLang's own chunk split (host and device copies), then its hook, once per batch
        batch.prefix_chunk_len = None
        batch.num_prefix_chunks = None
        _split_prefix_chunks(batch, capacity=15)
        backend.init_mha_chunk_metadata(batch)
        assert calls["plans"] == 1 + batch.num_prefix_chunks == 4
        _watch(batch, "seq_lens", "extend_seq_lens", "extend_prefix_lens", "prefix_chunk_cu_seq_lens",
               "prefix_chunk_seq_lens", "prefix_chunk_starts")
        for _ in range(LAYERS):
            batch.mha_return_lse = True
            batch.set_attn_attend_prefix_cache(False)
            acc, acc_lse = layer(q.reshape(q.shape[0], -1), k[new_rows], v[new_rows], batch, save_kv_cache=False)
            batch.set_attn_attend_prefix_cache(True)
            for i in range(batch.num_prefix_chunks):
                batch.set_prefix_chunk_idx(i)
                rows = _chunk_rows(batch, i, prefix_rows, prefix_lens)
                o, lse = layer(q.reshape(q.shape[0], -1), k[rows], v[rows], batch, save_kv_cache=False)
                acc, acc_lse = _merge(acc.double(), acc_lse.double(), o.double(), lse.double())
    assert calls["plans"] == 4 and backend.num_plans == 4
    assert all(c == (None, None, True) for c in calls["prefill_offsets"])
    assert len(calls["prefill_offsets"]) == LAYERS * (1 + batch.num_prefix_chunks)
    ref, _ = _reference(q, k, v, case, DQK**-0.5)
    assert _rel_l2(acc, ref) <= BF16_TOL


def _split_prefix_chunks(batch, capacity):
    """What ForwardBatch.prepare_chunked_prefix_cache_info computes (without its KV-index
    kernels, which need SGLang's req_to_token pool in a forward context)."""
    batch.prefix_chunk_len = capacity // batch.batch_size
    batch.num_prefix_chunks = -(-max(batch.extend_prefix_lens_cpu) // batch.prefix_chunk_len)
    starts, lens = batch.get_prefix_chunk_seq_lens(torch.tensor(batch.extend_prefix_lens_cpu),
                                                   batch.num_prefix_chunks, batch.prefix_chunk_len)
    batch.prefix_chunk_starts, batch.prefix_chunk_seq_lens = starts.clone(), lens.clone()
    batch.prefix_chunk_starts_cpu, batch.prefix_chunk_seq_lens_cpu = starts, lens
    batch.prefix_chunk_cu_seq_lens = torch.zeros(batch.num_prefix_chunks, batch.batch_size + 1, dtype=torch.int32)
    batch.prefix_chunk_cu_seq_lens[:, 1:] = lens.cumsum(1)


def _chunk_rows(batch, i, prefix_rows, prefix_lens):
    """Rows of k/v (all tokens, prefix first per sequence) in prefix chunk i."""
    rows, base = [], 0
    starts, lens = batch.prefix_chunk_starts_cpu[i].tolist(), batch.prefix_chunk_seq_lens_cpu[i].tolist()
    for b, p in enumerate(prefix_lens):
        rows.append(prefix_rows[base + starts[b]: base + starts[b] + lens[b]])
        base += p
    return torch.cat(rows)


def _merge(o1, lse1, o2, lse2):
    """SGLang's merge_state in float64 (its Triton kernel needs the interpreter here)."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    out = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2).clamp_min(1e-300)[..., None]
    return out, m + torch.log(w1 + w2)
