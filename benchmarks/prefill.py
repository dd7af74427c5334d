"""MLA prefill on the GPU: ours (Triton fp8 / bf16) against torch SDPA peers, in one process.

    PYTHONPATH=. python benchmarks/prefill.py [--out benchmarks/results/h200.json] [--sweep]

For each shape: TFLOP/s of ours in fp8 (end to end from bf16 inputs, and the attention
alone on pre-quantized inputs), ours in bf16, torch SDPA with the cuDNN backend (bf16)
and with the flash backend (value padded to 192); ratios to cuDNN; the FP8 GEMM ceiling
(torch._scaled_mm) and the copy-bandwidth ceiling; the reduce alone in TB/s; planning
time for 1, 64 and 256 sequences; relative error of each against float64 on a sample.

FLOPs count 2 * H * (Dqk + Dv) per visible (query, key) pair (causal work is about half).
Timing: CUDA events (triton.testing.do_bench: L2 flushed before each run), median of
many runs after warm-up, random inputs. Plans are built once per shape, outside the
timed region, as frameworks build them once per forward and reuse them across layers.

`--sweep` times phase 1 for a list of tile configurations instead (the measurements
behind the defaults in `mla_plugins/core/kernels/triton_kernel.py`, see NOTES.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict

import torch

DQK, DV = 192, 128
SHAPES = [
    # name, q lens, k lens, heads (issue 12's list: large, small, chunked = k > q)
    ("B1-S8192-H128", [8192], [8192], 128),
    ("B4-S4096-H16", [4096] * 4, [4096] * 4, 16),
    ("B1-S16384-H16", [16384], [16384], 16),
    ("B8-S2048-H128", [2048] * 8, [2048] * 8, 128),
    ("B1-S1024-H16", [1024], [1024], 16),
    ("B1-S2048-H8", [2048], [2048], 8),
    ("B16-S512-H16", [512] * 16, [512] * 16, 16),
    ("chunked-q512-k8192-H16", [512], [8192], 16),
    ("chunked-q512-k8192-H128", [512], [8192], 128),
    ("chunked-q2048-k18432-H16", [2048], [18432], 16),
]


def visible_pairs(lens_q, lens_k, causal=True):
    """(query, key) pairs that attend: row i of a sequence sees min(k, max(0, i + k - q + 1)) keys."""
    total = 0
    for q, k in zip(lens_q, lens_k, strict=True):
        total += q * k if not causal else sum(min(k, max(0, i + k - q + 1)) for i in range(q))
    return total


def flops(lens_q, lens_k, heads, causal=True):
    return 2 * heads * (DQK + DV) * visible_pairs(lens_q, lens_k, causal)


def bench(fn, warmup=25, rep=200):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def make_batch(lens_q, lens_k, heads, device, seed=0):
    from tests.core.helpers import random_batch

    return random_batch(lens_q, lens_k, heads, seed=seed, device=device)


def fp8_gemm_ceiling(device):
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    ms = bench(fn)
    return 2 * n**3 / ms / 1e9


def bf16_gemm_ceiling(device):
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def copy_ceiling(device):
    x = torch.randn(512 * 1024 * 1024, device=device)  # 2 GiB
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() * 4 / ms / 1e9  # TB/s, read + write


def sdpa_peer(q, k, v, cq, heads, backend, causal=True):
    """A closure running SDPA on [B, H, S, D] views (uniform batches) or per sequence."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import pad, scaled_dot_product_attention

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    bounds = cq.tolist()
    lens = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if k.shape[0] != q.shape[0]:
        # SDPA's is_causal is top-left aligned: no peer for a cached prefix (k_len > q_len)
        raise ValueError("no SDPA peer for bottom-right causal with k_len > q_len")
    if backend == "flash":
        v = pad(v, (0, DQK - DV))
    if len(set(lens)) == 1:
        b, s = len(lens), lens[0]
        qs = q.view(b, s, heads, DQK).transpose(1, 2)
        ks = k.view(b, s, heads, DQK).transpose(1, 2)
        vs = v.view(b, s, heads, v.shape[-1]).transpose(1, 2)
        parts = [(qs, ks, vs)]
    else:
        parts = []
        for a, e in zip(bounds, bounds[1:], strict=False):
            parts.append(tuple(t[a:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))

    def run():
        outs = []
        with sdpa_kernel(be):
            for qs, ks, vs in parts:
                outs.append(scaled_dot_product_attention(qs, ks, vs, is_causal=causal))
        return outs

    def to_packed(outs):
        if len(parts) == 1 and len(lens) > 1:
            o = outs[0].transpose(1, 2).reshape(-1, heads, outs[0].shape[-1])
        else:
            o = torch.cat([x.squeeze(0).transpose(0, 1) for x in outs])
        return o[..., :DV]

    return run, to_packed


def time_ours(q, k, v, cq, ck, heads, fp8, plan, config=None, e2e=True, graphs=None):
    """(ms end to end, ms attention alone or None) for one shape, by `bench` (L2 flushed
    before each call, the host's launch time included where it exceeds the GPU's). With
    `graphs` (a dict), the same two replayed from CUDA graphs go there too
    (`e2e_graph_ms`, `attn_graph_ms`: GPU time, no launch gaps, warm L2)."""
    from mla_plugins.core.kernels import triton_quant as tq
    from mla_plugins.core.kernels.triton_kernel import TritonKernel, run_prefill
    from tests.gpu.conftest import make_inputs

    inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=fp8)
    out = torch.empty(q.shape[0], heads, DV, dtype=q.dtype, device=q.device)
    po = torch.empty(max(plan.partial_rows(), 1), heads, DV, device=q.device)
    pl = torch.empty(max(plan.partial_rows(), 1), heads, device=q.device)
    kernel = TritonKernel()

    def run_e2e():
        run_prefill(inputs, plan, out, None, po, pl, config=config)
        if plan.num_partial_tiles:
            from mla_plugins.core.kernels.triton_reduce import reduce

            reduce(po, pl, plan.reduce_indptr, plan.reduce_final_map, plan.reduce_partial_map,
                   plan.tile_q, out, None)

    ms_e2e = bench(run_e2e) if (e2e or not fp8) else None
    if graphs is not None and ms_e2e is not None:
        graphs["e2e_graph_ms"] = graph_ms(run_e2e)
    ms_attn = None
    if fp8:
        quant = tq.quantize_qkv(q, k, v, cq, ck, len(plan.cu_seqlens_host[1]) - 1, plan.max_seqlen_q,
                                plan.max_seqlen_k, inputs.fp8_dtype, rotate=inputs.fp8_rotate)

        def run_attn():
            run_prefill(inputs, plan, out, None, po, pl, config=config, quantized=quant)

        ms_attn = bench(run_attn)
        if graphs is not None:
            graphs["attn_graph_ms"] = graph_ms(run_attn)
    del kernel
    return ms_e2e, ms_attn


def _warm_one(args):
    """Compile one (fp8, config) in a worker process (fills the shared Triton cache)."""
    fp8, cfg = args
    try:
        sys.path.insert(0, os.getcwd())
        from mla_plugins.core.api import plan_prefill
        from mla_plugins.core.kernels.triton_kernel import TileConfig

        config = TileConfig(**cfg)
        q, k, v, cq, ck = make_batch([300], [300], 16, "cuda", seed=1)
        plan = plan_prefill(cq, ck, num_heads=16, causal=True, tile_q=config.block_m, num_workers=1)
        time_small(q, k, v, cq, ck, 16, fp8, plan, config)
        return None
    except Exception as exc:  # reported by the parent
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def time_small(q, k, v, cq, ck, heads, fp8, plan, config):
    from mla_plugins.core.kernels.triton_kernel import run_prefill
    from tests.gpu.conftest import make_inputs

    inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=fp8)
    out = torch.empty(q.shape[0], heads, DV, dtype=q.dtype, device=q.device)
    po = torch.empty(max(plan.partial_rows(), 1), heads, DV, device=q.device)
    pl = torch.empty(max(plan.partial_rows(), 1), heads, device=q.device)
    run_prefill(inputs, plan, out, None, po, pl, config=config)
    torch.cuda.synchronize()


def precompile(jobs, workers=8):
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(_warm_one, jobs))


def sweep(args):
    from mla_plugins.core.api import plan_prefill
    from mla_plugins.core.kernels.triton_kernel import TileConfig

    device = torch.device("cuda")
    configs = []
    variants = {
        True: [(128, 128, 8, 3, True, False), (128, 128, 8, 3, True, True), (128, 128, 8, 4, True, False),
               (128, 64, 8, 3, True, False), (128, 64, 8, 4, True, True), (64, 128, 4, 3, True, False),
               (64, 128, 4, 3, True, True), (64, 64, 4, 4, True, False), (256, 128, 16, 2, True, False),
               (256, 64, 16, 3, True, False)],
        False: [(128, 64, 8, 3, True, False), (128, 64, 8, 3, True, True), (128, 128, 8, 2, True, False),
                (64, 64, 4, 3, True, False), (64, 128, 4, 2, True, False), (256, 64, 16, 2, True, False)],
    }
    for fp8, rows in variants.items():
        for bm, bn, w, st, tma, ws in rows:
            configs.append((fp8, asdict(TileConfig(bm, bn, w, st, tma, ws))))
    t0 = time.time()
    errs = precompile(configs)
    print(f"precompiled {len(configs)} variants in {time.time() - t0:.0f}s", flush=True)
    results = []
    shapes = [s for s in SHAPES if s[0] in ("B8-S2048-H128", "B1-S16384-H16")]
    for name, lq, lk, heads in shapes:
        q, k, v, cq, ck = make_batch(lq, lk, heads, device)
        fl = flops(lq, lk, heads)
        for (fp8, cfg), err in zip(configs, errs, strict=True):
            row = {"shape": name, "fp8": fp8, **cfg}
            if err:
                row["error"] = err
            else:
                try:
                    config = TileConfig(**cfg)
                    plan = plan_prefill(cq, ck, num_heads=heads, causal=True, tile_q=config.block_m,
                                        num_workers=1)
                    e2e, attn = time_ours(q, k, v, cq, ck, heads, fp8, plan, config, e2e=False)
                    ms = attn if fp8 else e2e
                    row.update(ms_attn=ms, tflops_attn=fl / ms / 1e9)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results.append(row)
            c = row
            tag = f"{name} {'fp8 ' if fp8 else 'bf16'} bm{c['block_m']} bn{c['block_n']} w{c['num_warps']} " \
                  f"s{c['num_stages']} tma{int(c['use_tma'])} ws{int(c['warp_spec'])}"
            print(f"{tag}: " + (f"{row['tflops_attn']:.0f} TFLOP/s" if "error" not in row else row["error"][:120]),
                  flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"sweep": results, "env": environment()}, f, indent=1)


VARIANT_SHAPES = ("B1-S8192-H128", "B8-S2048-H128", "B1-S16384-H16", "B4-S4096-H16", "B1-S1024-H16",
                  "B16-S512-H16", "chunked-q512-k8192-H16", "varlen-H16")


def variants(args):
    """fp8 phase-1 variants side by side (the portable Triton kernel, the Gluon kernel at each
    ring depth): error against float64 and TFLOP/s end to end and of the attention alone,
    each with its own plan (tile_q = the variant's block_m)."""
    from dataclasses import replace

    from mla_plugins.core.api import plan_prefill
    from mla_plugins.core.kernels.triton_kernel import (
        FP8_CONFIG,
        GLUON_FP8_CONFIG,
        run_prefill,
        split_workers,
    )
    from mla_plugins.core.kernels.triton_reduce import reduce
    from tests.gpu.conftest import make_inputs, reference_on_device, rel_err

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = {"triton 64x64 w4 s4": FP8_CONFIG}
    for st, pp, pers, lf in ((3, False, False, False), (4, False, False, False), (4, True, False, False),
                             (4, False, True, False)):
        cfg = replace(GLUON_FP8_CONFIG, num_stages=st, pingpong=pp, persistent=pers, longest_first=lf)
        configs[f"gluon {cfg.block_m}x{cfg.block_n} s{st}{' pingpong' if pp else ''}"
                f"{' persistent' if pers else ''}{' longest-first' if lf else ''}"] = cfg
    shapes = {n: (lq, lk, h) for n, lq, lk, h in SHAPES}
    shapes["varlen-H16"] = ([1024, 777, 300, 64, 1], [1024, 777, 300 + 129, 64, 1], 16)
    names = args.shapes.split(",") if args.shapes else list(VARIANT_SHAPES)
    rows = []
    for name in names:
        lq, lk, heads = shapes[name]
        q, k, v, cq, ck = make_batch(lq, lk, heads, device)
        fl = flops(lq, lk, heads)
        ref, _ = reference_on_device(q, k, v, cq, ck, heads_per_step=4)
        inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=True)
        for label, cfg in configs.items():
            row = {"shape": name, "variant": label}
            try:
                workers = split_workers(lq, lk, heads, cfg.block_m, sms)
                plan = plan_prefill(cq, ck, num_heads=heads, causal=True, tile_q=cfg.block_m,
                                    num_workers=workers)
                out = torch.full((q.shape[0], heads, DV), float("nan"), dtype=q.dtype, device=device)
                lse = torch.full((q.shape[0], heads), float("nan"), device=device)
                po = torch.empty(max(plan.partial_rows(), 1), heads, DV, device=device)
                pl = torch.empty(max(plan.partial_rows(), 1), heads, device=device)
                run_prefill(inputs, plan, out, lse, po, pl, config=cfg)
                if plan.num_partial_tiles:
                    reduce(po, pl, plan.reduce_indptr, plan.reduce_final_map, plan.reduce_partial_map,
                           plan.tile_q, out, lse)
                torch.cuda.synchronize()
                row["err"] = rel_err(out, ref)
                row["nan"] = bool(torch.isnan(out).any().item() or torch.isnan(lse).any().item())
                row["workers"] = workers
                graphs = {}
                e2e, attn = time_ours(q, k, v, cq, ck, heads, True, plan, cfg, graphs=graphs)
                row.update(e2e_ms=e2e, attn_ms=attn, e2e_tflops=fl / e2e / 1e9, attn_tflops=fl / attn / 1e9)
                for key, gms in graphs.items():
                    if gms:
                        row[key] = gms
                        row[key.replace("_ms", "_tflops")] = fl / gms / 1e9
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"variants": rows, "env": environment(),
                   "command": "PYTHONPATH=. python benchmarks/prefill.py " + " ".join(sys.argv[1:])},
                  f, indent=1)


def environment():
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
    }


def reduce_bandwidth(device):
    """The reduce alone on synthetic split tiles: 512 tiles x 4 pieces, tile_q 128, H 16."""
    from mla_plugins.core.kernels.triton_reduce import reduce

    tiles, pieces, tile_q, heads = 512, 4, 128, 16
    n = tiles * pieces
    po = torch.randn(n * tile_q, heads, DV, device=device)
    pl = torch.randn(n * tile_q, heads, device=device)
    indptr = torch.arange(0, n + 1, pieces, dtype=torch.int32, device=device)
    fmap = torch.stack([torch.arange(tiles) * tile_q, torch.arange(1, tiles + 1) * tile_q], 1)
    fmap = fmap.to(device, torch.int32)
    pmap = (torch.randperm(n) * tile_q).to(device, torch.int32)
    out = torch.empty(tiles * tile_q, heads, DV, dtype=torch.bfloat16, device=device)
    lse = torch.empty(tiles * tile_q, heads, device=device)
    fn = lambda: reduce(po, pl, indptr, fmap, pmap, tile_q, out, lse)
    ms = bench(fn)
    moved = po.numel() * 4 + pl.numel() * 4 + out.numel() * 2 + lse.numel() * 4
    return {"ms": ms, "bytes": moved, "tb_s": moved / ms / 1e9,
            "shape": f"{tiles} tiles x {pieces} pieces, tile_q {tile_q}, H {heads}, Dv {DV}"}


def planning_times(device):
    import mla_plugins
    from mla_plugins.core.kernels.triton_kernel import split_workers

    rows = []
    for nseq, length in ((1, 8192), (64, 2048), (256, 512)):
        lens = [length] * nseq
        cq = torch.tensor([0] + [length * (i + 1) for i in range(nseq)], dtype=torch.int32, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        workers = split_workers(lens, lens, 128, 128, sms)
        for label, kw in (("ours (tile 128)", {"tile_q": 128, "num_workers": workers}),
                          ("AITER-style (tile 256, one worker per SM)", {"tile_q": 256})):
            mla_plugins.plan_prefill(cq, cq, num_heads=128, **kw)  # warm
            ts = []
            for _ in range(20):
                torch.cuda.synchronize()
                t = time.perf_counter()
                mla_plugins.plan_prefill(cq, cq, num_heads=128, **kw)
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t) * 1e3)
            rows.append({"sequences": nseq, "len": length, "plan": label, "ms": statistics.median(ts)})
    return rows


def accuracy_sample(device):
    """Relative error vs float64 of every implementation on one random varlen batch."""
    import mla_plugins
    from tests.gpu.conftest import reference_on_device, rel_err

    lq = lk = [1024, 777, 300]
    heads = 16
    q, k, v, cq, ck = make_batch(lq, lk, heads, device, seed=5)
    ref, _ = reference_on_device(q, k, v, cq, ck)
    errs = {}
    for fp8 in (True, False):
        out = mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=fp8, kernel="triton")
        errs["ours fp8" if fp8 else "ours bf16"] = rel_err(out, ref)
    errs["torch kernel fp8"] = rel_err(mla_plugins.mla_prefill(q, k, v, cq, ck, fp8=True, kernel="torch"), ref)
    for backend in ("cudnn", "flash"):
        try:
            run, pack = sdpa_peer(q, k, v, cq, heads, backend)
            errs[f"sdpa {backend} bf16"] = rel_err(pack(run()), ref)
        except Exception as exc:
            errs[f"sdpa {backend} bf16"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {"shape": f"lens {lq}, H {heads}, causal", "rel_err": errs}


def cudnn_fp8_peer(q, k, v, lens_q, lens_k, heads, scale):
    """cuDNN's own FP8 attention (nvidia-cudnn-frontend sdpa_fp8) on pre-quantized
    [B, H, S, D] inputs with unit descales, FP8 output; uniform batches only."""
    import cudnn

    if len(set(lens_q)) != 1 or len(set(lens_k)) != 1:
        raise ValueError("uniform batches only")
    b, sq, sk = len(lens_q), lens_q[0], lens_k[0]
    f8 = torch.float8_e4m3fn
    q8 = q.to(f8).view(b, sq, heads, DQK).permute(0, 2, 1, 3)
    k8 = k.to(f8).view(b, sk, heads, DQK).permute(0, 2, 1, 3)
    v8 = v.to(f8).view(b, sk, heads, DV).permute(0, 2, 1, 3)
    o8 = torch.empty(b, sq, heads, DV, dtype=f8, device=q.device).permute(0, 2, 1, 3)
    one = torch.ones(1, 1, 1, 1, device=q.device)
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
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    ws = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=q.device)
    pack = {tq_: q8, tk_: k8, tv_: v8, o: o8, **{sc[n]: one for n in sc}}
    pack.update(dict(zip(rest, amaxes, strict=False)))

    def run():
        # on the caller's stream, so a CUDA graph can capture it (graph_ms)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g.execute(pack, ws, handle=handle)

    run()
    torch.cuda.synchronize()
    return run, lambda: o8.permute(0, 2, 1, 3).reshape(-1, heads, DV)


def cudnn_bf16_peer(q, k, v, lens_q, lens_k, heads):
    """torch SDPA, cuDNN backend, [B, H, S, D] views; bottom-right causal when k > q."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention

    if len(set(lens_q)) != 1 or len(set(lens_k)) != 1:
        raise ValueError("uniform batches only")
    b, sq, sk = len(lens_q), lens_q[0], lens_k[0]
    qs = q.view(b, sq, heads, DQK).transpose(1, 2)
    ks = k.view(b, sk, heads, DQK).transpose(1, 2)
    vs = v.view(b, sk, heads, DV).transpose(1, 2)
    mask = causal_lower_right(sq, sk) if sk != sq else None

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if mask is None:
                return scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            return scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)

    return run, lambda o: o.transpose(1, 2).reshape(-1, heads, DV)


def graph_ms(fn):
    """GPU time of fn replayed from a CUDA graph (no launch gaps), or None if capture fails."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:
        return None


def main_bench(args):
    import mla_plugins
    from tests.gpu.conftest import reference_on_device, rel_err

    device = torch.device("cuda")
    result = {"env": environment()}
    result["ceilings"] = {
        "fp8_gemm_tflops": fp8_gemm_ceiling(device),
        "bf16_gemm_tflops": bf16_gemm_ceiling(device),
        "copy_tb_s": copy_ceiling(device),
    }
    print(json.dumps(result["ceilings"]), flush=True)
    gemm = result["ceilings"]["fp8_gemm_tflops"]
    rows = []
    only = set(args.shapes.split(",")) if args.shapes else None
    for name, lq, lk, heads in SHAPES:
        if only and name not in only:
            continue
        q, k, v, cq, ck = make_batch(lq, lk, heads, device)
        fl = flops(lq, lk, heads)
        scale = DQK**-0.5
        row = {"shape": name, "heads": heads, "tflop": fl / 1e12}
        ref, _ = reference_on_device(q, k, v, cq, ck, heads_per_step=4)
        for fp8 in (True, False):
            key = "fp8" if fp8 else "bf16"
            try:
                plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=heads, fp8=fp8,
                                                kernel="triton", device=device) \
                    if _has_new_plan_api() else _kernel_plan(q, k, v, cq, ck, heads, fp8)
                out = torch.empty(q.shape[0], heads, DV, dtype=q.dtype, device=device)

                def fn(plan=plan, out=out, fp8=fp8, q=q, k=k, v=v, cq=cq, ck=ck):
                    mla_plugins.mla_prefill(q, k, v, cq, ck, plan=plan, fp8=fp8, out=out,
                                            return_lse=False, kernel="triton")

                fn()
                row[f"err_{key}"] = rel_err(out, ref)
                row[f"ours_{key}_plan"] = plan.summary()
                ms = bench(fn)
                row[f"ours_{key}_ms"] = ms
                row[f"ours_{key}_tflops"] = fl / ms / 1e9
                gms = graph_ms(fn)
                if gms:
                    row[f"ours_{key}_graph_tflops"] = fl / gms / 1e9
                if fp8:
                    # the two parts alone: the one-launch q/k/v quantization (rotated as
                    # the default says) and the attention on its output
                    from mla_plugins.core.fp8 import rotation_applies
                    from mla_plugins.core.kernels import triton_quant as tq

                    nb, mq, mk = len(lq), max(lq), max(lk)
                    rot = rotation_applies(DQK, None)
                    qms = bench(lambda q=q, k=k, v=v, cq=cq, ck=ck, nb=nb, mq=mq, mk=mk, rot=rot:
                                tq.quantize_qkv(q, k, v, cq, ck, nb, mq, mk, torch.float8_e4m3fn,
                                                rotate=rot))
                    row["quant_qkv_rotated"] = rot
                    row["quant_qkv_ms"] = qms
                    # bf16 read, fp8 written (the k/v table column before this was k/v only)
                    row["quant_qkv_tb_s"] = (q.numel() + k.numel() + v.numel()) * 3 / qms / 1e9
                    _, attn = time_ours(q, k, v, cq, ck, heads, True, plan, e2e=False)
                    row["ours_fp8_attn_ms"] = attn
                    row["ours_fp8_attn_tflops"] = fl / attn / 1e9
            except Exception as exc:
                row[f"ours_{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
        try:
            # bf16 on the layout vLLM passes (head stride 256; read through TMA like packed v)
            from tests.core.helpers import vllm_v_view

            v_view = vllm_v_view(v)
            plan = mla_plugins.plan_prefill(cq.tolist(), ck.tolist(), num_heads=heads, fp8=False,
                                            kernel="triton", device=device)
            out = torch.empty(q.shape[0], heads, DV, dtype=q.dtype, device=device)

            def fn_view(plan=plan, out=out, q=q, k=k, v=v_view, cq=cq, ck=ck):
                mla_plugins.mla_prefill(q, k, v, cq, ck, plan=plan, fp8=False, out=out,
                                        return_lse=False, kernel="triton")

            fn_view()
            row["err_bf16_vllm_layout"] = rel_err(out, ref)
            row["ours_bf16_vllm_layout_tflops"] = fl / bench(fn_view) / 1e9
            del v_view
        except Exception as exc:
            row["ours_bf16_vllm_layout_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        try:
            run, unpack = cudnn_bf16_peer(q, k, v, lq, lk, heads)
            row["err_cudnn_bf16"] = rel_err(unpack(run()), ref)
            ms = bench(run)
            row["cudnn_bf16_tflops"] = fl / ms / 1e9
            gms = graph_ms(run)
            if gms:
                row["cudnn_bf16_graph_tflops"] = fl / gms / 1e9
        except Exception as exc:
            row["cudnn_bf16_tflops"] = None
            row["cudnn_bf16_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            run, unpack = cudnn_fp8_peer(q, k, v, lq, lk, heads, scale)
            row["err_cudnn_fp8"] = rel_err(unpack().float(), ref)
            ms = bench(run)
            row["cudnn_fp8_tflops"] = fl / ms / 1e9
            gms = graph_ms(run)
            if gms:
                row["cudnn_fp8_graph_tflops"] = fl / gms / 1e9
        except Exception as exc:
            row["cudnn_fp8_tflops"] = None
            row["cudnn_fp8_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        f8, b16 = row.get("ours_fp8_tflops"), row.get("ours_bf16_tflops")
        c8, cb = row.get("cudnn_fp8_tflops"), row.get("cudnn_bf16_tflops")
        row["ours_fp8_vs_cudnn_fp8"] = f8 / c8 if f8 and c8 else None
        row["ours_fp8_vs_cudnn_bf16"] = f8 / cb if f8 and cb else None
        row["ours_bf16_vs_cudnn_bf16"] = b16 / cb if b16 and cb else None
        row["ours_fp8_of_fp8_gemm"] = f8 / gemm if f8 else None
        # GPU time (the small shapes' goal): both replayed from CUDA graphs
        g8, gc8 = row.get("ours_fp8_graph_tflops"), row.get("cudnn_fp8_graph_tflops")
        row["ours_fp8_vs_cudnn_fp8_gpu"] = g8 / gc8 if g8 and gc8 else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    result["shapes"] = rows
    result["serving"] = _serving()
    result["command"] = "PYTHONPATH=. python benchmarks/prefill.py " + " ".join(sys.argv[1:])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)


def _has_new_plan_api() -> bool:
    import inspect

    import mla_plugins

    return "kernel" in inspect.signature(mla_plugins.plan_prefill).parameters


def _kernel_plan(q, k, v, cq, ck, heads, fp8):
    """The Triton kernel's own plan (before plan_prefill took kernel=)."""
    import mla_plugins
    from mla_plugins.core.kernels.triton_kernel import TritonKernel
    from tests.gpu.conftest import make_inputs

    inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=fp8)
    return mla_plugins.plan_prefill(cq, ck, num_heads=heads, causal=True,
                                    **TritonKernel().plan_params(inputs))


def print_table(r):
    c = r["ceilings"]
    print(f"\n{r['env']['gpu']}  torch {r['env']['torch']}  triton {r['env']['triton']}  cuDNN {r['env']['cudnn']}")
    print(f"ceilings: FP8 GEMM {c['fp8_gemm_tflops']:.0f} TFLOP/s, bf16 GEMM {c['bf16_gemm_tflops']:.0f} TFLOP/s, "
          f"copy {c['copy_tb_s']:.2f} TB/s")
    head = ("shape", "fp8", "fp8 graph", "fp8 attn", "quant TB/s", "bf16", "cuDNN fp8", "cud8 graph", "cuDNN bf16", "bf16 graph", "fp8/cud8", "gpu f8/c8",
            "fp8/cud16", "bf16/cud16", "fp8/GEMM", "err fp8", "err bf16")
    print("TFLOP/s (causal, bottom-right for k > q; FLOPs = 2*H*(192+128) per visible pair)")
    print(" ".join(f"{h:>11}" for h in head))
    f = lambda x, p=0: "-" if x is None else (f"{x:.{p}f}" if isinstance(x, float) else str(x))
    for row in r["shapes"]:
        vals = (row["shape"][:24], f(row.get("ours_fp8_tflops")), f(row.get("ours_fp8_graph_tflops")),
                f(row.get("ours_fp8_attn_tflops")), f(row.get("quant_qkv_tb_s", row.get("quant_kv_tb_s")), 2), f(row.get("ours_bf16_tflops")), f(row.get("cudnn_fp8_tflops")),
                f(row.get("cudnn_fp8_graph_tflops")), f(row.get("cudnn_bf16_tflops")),
                f(row.get("cudnn_bf16_graph_tflops")),
                f(row.get("ours_fp8_vs_cudnn_fp8"), 2), f(row.get("ours_fp8_vs_cudnn_fp8_gpu"), 2), f(row.get("ours_fp8_vs_cudnn_bf16"), 2),
                f(row.get("ours_bf16_vs_cudnn_bf16"), 2), f(row.get("ours_fp8_of_fp8_gemm"), 2),
                f(row.get("err_fp8"), 4), f(row.get("err_bf16"), 4))
        print(" ".join(f"{v:>11}" for v in vals))
    for row in r["shapes"]:
        for key in ("cudnn_fp8_error", "cudnn_bf16_error", "ours_fp8_error", "ours_bf16_error"):
            if row.get(key):
                print(f"{row['shape']} {key}: {row[key][:160]}")


def _serving() -> list[dict]:
    """The "serving" section: benchmarks/serving.py's 61-call loops (H6)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from serving import run_serving

    return run_serving()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="fp8 phase-1 variants (Triton, Gluon per ring depth): error and TFLOP/s")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--serving-only", action="store_true",
                    help="only the 'serving' section (benchmarks/serving.py), merged into --out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/prefill.py needs a CUDA GPU")
    if args.serving_only:
        result = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                result = json.load(f)
        result["serving"] = _serving()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    try:
        (sweep if args.sweep else variants if args.variants else main_bench)(args)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()

