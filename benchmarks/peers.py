"""The peers benchmarks/prefill.py measures ours against, each as a closure over one batch.

Every constructor returns `(run, result)`: `run()` does the timed work (and may be captured
in a CUDA graph), `result()` gives the output as [total_q, H, Dv] for the error check.
Strongest first: FlashAttention-3 (PyPI `fa3-fwd`, the FA3 vLLM and SGLang run on Hopper)
in FP8 on inputs quantized beforehand, FA3 FP8 end to end (the quantization it needs from
the bf16 q, k, v the frameworks hand over, timed with it), FA3 bf16, cuDNN FP8 and bf16
through the cuDNN frontend (bf16 with cuDNN's own bottom-right mask for k > q), and torch
SDPA (cuDNN backend; `causal_lower_right` for k > q, which is not cuDNN's bottom-right kernel
but a dense mask: a labelled extra column).
"""

from __future__ import annotations

import torch

DQK, DV = 192, 128
F8 = torch.float8_e4m3fn


def fa3():
    """FA3's Python interface module (fa3-fwd's, or FA3's own build's), or raise ImportError."""
    try:
        import fa3_fwd_interface as fa
    except ImportError:
        import flash_attn_interface as fa
    return fa


def head_quant_torch(x, cu, rotate=False):
    """(x_fp8, descale [B, H]) by core/fp8.py's per-(sequence, head) rule, in torch (not timed)."""
    from mla_plugins.core.fp8 import head_quantize

    return head_quantize(x, cu, F8, rotate_=rotate)


def head_quant_qkv(q, k, v, cu_q, cu_k):
    """(q8, k8, v8, dq, dk, dv): q, k and v by `head_quant_torch` (cu_q, cu_k: host lists), in
    the order `fa3_peer(..., quantized=)` takes."""
    (q8, dq), (k8, dk), (v8, dv) = (head_quant_torch(x, cu) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
    return q8, k8, v8, dq, dk, dv


def fa3_peer(q, k, v, cq, ck, max_q, max_k, scale, *, fp8=False, quantized=None, out=None):
    """FA3 through its public `flash_attn_varlen_func` (the call frameworks make): bf16, or
    FP8 on `quantized` = (q8, k8, v8, dq, dk, dv) made beforehand (descales [B, H])."""
    fa = fa3()
    if fp8:
        q8, k8, v8, dq, dk, dv = quantized
        state = {}

        def run():
            state["o"] = fa.flash_attn_varlen_func(q8, k8, v8, cq, ck, max_q, max_k, softmax_scale=scale,
                                                   causal=True, q_descale=dq, k_descale=dk, v_descale=dv)
    else:
        state = {}

        def run():
            state["o"] = fa.flash_attn_varlen_func(q, k, v, cq, ck, max_q, max_k, softmax_scale=scale,
                                                   causal=True)
    run()
    return run, lambda: state["o"]


def per_tensor_quant(x):
    """torch eager per-tensor dynamic fp8 (amax, then cast): what a framework without a fused
    kernel would do; descale broadcast to [B, H] for FA3."""
    amax = x.abs().amax().float()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x.float() / scale).clamp_(-448, 448).to(F8), scale


def fa3_fp8_e2e_peer(q, k, v, cq, ck, max_q, max_k, scale, batch, heads, *, quant="triton",
                     workspace=None):
    """FA3 FP8 plus the quantization it needs, both timed. quant="triton": the fastest we
    have, mla-plugins' per-(sequence, head) Triton kernel without the rotation
    (`triton_quant.quantize_heads`); quant="torch": torch eager per-tensor (amax + cast)."""
    fa = fa3()
    state = {}
    if quant == "triton":
        from mla_plugins.core.kernels import triton_heads as th

        fn = th.quantize_heads
        splits = th.head_splits(max(max_q, max_k), batch, heads,
                                torch.cuda.get_device_properties(q.device).multi_processor_count)
        out = (torch.empty(q.shape, dtype=F8, device=q.device), torch.empty(k.shape, dtype=F8, device=q.device),
               torch.empty(v.shape, dtype=F8, device=q.device),
               torch.empty(3, batch, heads, device=q.device),
               torch.empty(splits, 3, batch, heads, device=q.device))

        def run():
            fn(q, k, v, cq, ck, batch, max_q, max_k, splits, F8, rotate=False, out=out)
            d = out[3]
            state["o"] = fa.flash_attn_varlen_func(out[0], out[1], out[2], cq, ck, max_q, max_k,
                                                   softmax_scale=scale, causal=True,
                                                   q_descale=d[0], k_descale=d[1], v_descale=d[2])
    else:
        def run():
            (q8, sq), (k8, sk), (v8, sv) = per_tensor_quant(q), per_tensor_quant(k), per_tensor_quant(v)
            ones = torch.ones(batch, heads, device=q.device)
            state["o"] = fa.flash_attn_varlen_func(q8, k8, v8, cq, ck, max_q, max_k, softmax_scale=scale,
                                                   causal=True, q_descale=ones * sq, k_descale=ones * sk,
                                                   v_descale=ones * sv)
    run()
    return run, lambda: state["o"]


def _build(g, device) -> torch.Tensor:
    """Validate and plan a cuDNN frontend graph (heuristics A, then the fallback); its workspace."""
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=device)


def _uniform(lens_q, lens_k):
    if len(set(lens_q)) != 1 or len(set(lens_k)) != 1:
        raise ValueError("uniform batches only")
    return len(lens_q), lens_q[0], lens_k[0]


def cudnn_bf16_peer(q, k, v, lens_q, lens_k, heads, scale):
    """cuDNN's own bf16 attention through the frontend, [B, H, S, D] views, causal top-left
    for equal lengths and cuDNN's bottom-right mask (`use_causal_mask_bottom_right`) for k > q."""
    import cudnn

    b, sq, sk = _uniform(lens_q, lens_k)
    qs = q.view(b, sq, heads, DQK).permute(0, 2, 1, 3)
    ks = k.view(b, sk, heads, DQK).permute(0, 2, 1, 3)
    vs = v.view(b, sk, heads, DV).permute(0, 2, 1, 3)
    o = torch.empty(b, sq, heads, DV, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)
    handle = cudnn.create_handle()
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq_, tk_, tv_ = (g.tensor_like(t) for t in (qs, ks, vs))
    to, _stats = g.sdpa(q=tq_, k=tk_, v=tv_, is_inference=True, attn_scale=scale,
                        use_causal_mask=sq == sk, use_causal_mask_bottom_right=sq != sk)
    to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride()))
    ws = _build(g, q.device)
    pack = {tq_: qs, tk_: ks, tv_: vs, to: o}

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g.execute(pack, ws, handle=handle)

    run()
    return run, lambda: o.permute(0, 2, 1, 3).reshape(-1, heads, DV)


def cudnn_fp8_peer(q, k, v, lens_q, lens_k, heads, scale, quantized=None):
    """cuDNN's FP8 attention (frontend sdpa_fp8) on pre-quantized inputs, FP8 output. With
    `quantized` = (q8, k8, v8, dq, dk, dv) per-tensor descales are taken from it (one per
    tensor: the frontend's descale is a scalar); else unit descales on x.to(fp8)."""
    import cudnn

    b, sq, sk = _uniform(lens_q, lens_k)
    if quantized is not None:
        q8, k8, v8, dq, dk, dv = quantized
    else:
        q8, k8, v8 = q.to(F8), k.to(F8), v.to(F8)
        dq = dk = dv = torch.ones((), device=q.device)
    q8 = q8.view(b, sq, heads, DQK).permute(0, 2, 1, 3)
    k8 = k8.view(b, sk, heads, DQK).permute(0, 2, 1, 3)
    v8 = v8.view(b, sk, heads, DV).permute(0, 2, 1, 3)
    o8 = torch.empty(b, sq, heads, DV, dtype=F8, device=q.device).permute(0, 2, 1, 3)
    one = torch.ones(1, 1, 1, 1, device=q.device)
    desc = {n: t.reshape(1, 1, 1, 1).float().contiguous() for n, t in (("dq", dq), ("dk", dk), ("dv", dv))}
    amax_s = torch.zeros(1, 1, 1, 1, device=q.device)
    amax_o = torch.zeros(1, 1, 1, 1, device=q.device)
    handle = cudnn.create_handle()
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq_, tk_, tv_ = (g.tensor_like(t) for t in (q8, k8, v8))
    for t in (tq_, tk_, tv_):
        t.set_data_type(cudnn.data_type.FP8_E4M3)
    sc = {n: g.tensor_like(one) for n in ("dq", "dk", "dv", "ds", "ss", "so")}
    outs = g.sdpa_fp8(q=tq_, k=tk_, v=tv_, descale_q=sc["dq"], descale_k=sc["dk"], descale_v=sc["dv"],
                      descale_s=sc["ds"], scale_s=sc["ss"], scale_o=sc["so"], is_inference=True,
                      attn_scale=scale, use_causal_mask=sq == sk,
                      use_causal_mask_bottom_right=sq != sk)
    o, rest = outs[0], [t for t in outs[1:] if t is not None]
    o.set_output(True).set_dim(list(o8.shape)).set_stride(list(o8.stride())).set_data_type(
        cudnn.data_type.FP8_E4M3)
    amaxes = [amax_s, amax_o][: len(rest)]
    for t in rest:
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    ws = _build(g, q.device)
    pack = {tq_: q8, tk_: k8, tv_: v8, o: o8, sc["ds"]: one, sc["ss"]: one, sc["so"]: one,
            sc["dq"]: desc["dq"], sc["dk"]: desc["dk"], sc["dv"]: desc["dv"]}
    pack.update(dict(zip(rest, amaxes, strict=False)))

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g.execute(pack, ws, handle=handle)

    run()
    return run, lambda: o8.permute(0, 2, 1, 3).reshape(-1, heads, DV).float()


def sdpa_cudnn_peer(q, k, v, lens_q, lens_k, heads):
    """torch SDPA, cuDNN backend; for k > q a `causal_lower_right` mask (torch's route, not
    cuDNN's own bottom-right kernel: 1.6-1.9x slower on the H200)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention

    b, sq, sk = _uniform(lens_q, lens_k)
    qs = q.view(b, sq, heads, DQK).transpose(1, 2)
    ks = k.view(b, sk, heads, DQK).transpose(1, 2)
    vs = v.view(b, sk, heads, DV).transpose(1, 2)
    mask = causal_lower_right(sq, sk) if sk != sq else None
    state = {}

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if mask is None:
                state["o"] = scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            else:
                state["o"] = scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)

    run()
    return run, lambda: state["o"].transpose(1, 2).reshape(-1, heads, DV)
