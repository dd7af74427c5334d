"""MLA prefill on the GPU: ours against the strongest peers, in one process.

    PYTHONPATH=. python benchmarks/prefill.py [--out benchmarks/results/h200.json]
        [--dispatch-out mla_plugins/core/dispatch_h200.json] [--shapes A,B] [--variants]

For each shape (SHAPES): ours through the public API as the adapters call it (one
`plan_prefill` per batch, `mla_prefill(..., plan=plan)`), in fp8 from bf16 inputs
(quantization included) and in bf16, with kernel="auto" (`auto_*`: what a framework gets),
the Triton provider pinned (`ours_*`, and `ours_fp8_attn`: its attention alone on inputs
quantized beforehand) and the FlashAttention-3 provider pinned (`fa_*`); the peers of
benchmarks/peers.py: FA3 FP8 on inputs quantized beforehand (`fa3_fp8`), FA3 FP8 plus the
quantization it needs, both timed (`fa3_fp8_e2e`: mla-plugins' per-(sequence, head) Triton
quantization without rotation, the fastest there is; `fa3_fp8_e2e_torch`: torch eager
per-tensor), FA3 bf16, cuDNN bf16 through the frontend with its own bottom-right mask for
k > q (`cudnn_bf16_br`), cuDNN FP8, torch SDPA (cuDNN backend, `causal_lower_right` for
k > q). Each timed call by call (`*_tflops`: triton.testing.do_bench, L2 flushed, median)
and replayed from a CUDA graph (`*_graph_tflops`: GPU time, what the ratios use). Ceilings in
the same process: FP8 GEMM (torch._scaled_mm), bf16 GEMM, device copy. Errors against
float64 (`err_*`). Then the accuracy section (benchmarks/accuracy.py) and the serving
section (benchmarks/serving.py). `--dispatch-out` writes the table kernel="auto" ranks the
kernels by (mla_plugins/core/dispatch.py): the GPU time of each (kernel, mode) per shape.

FLOPs count 2 * H * (Dqk + Dv) per visible (query, key) pair (causal work is about half).
`--variants` checks and times the fp8 phase-1 variants of the Triton provider instead
(the measurements behind its defaults, see NOTES.md); `--sweep` the tile configurations.
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
        plan = plan_prefill(cq, ck, num_heads=16, causal=True, kernel="triton", tile_q=config.block_m, num_workers=1)
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
                    plan = plan_prefill(cq, ck, num_heads=heads, causal=True, kernel="triton", tile_q=config.block_m,
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


def variant_configs(fp8: bool) -> dict:
    """The phase-1 variants `--variants` measures, by label: the portable kernel and the Gluon
    kernel (fp8, or 16-bit with `--bf16`): its default (one CTA per unit, q by TMA, the
    accumulator rescaled after the next q k^T is issued; 16-bit also k and v on barriers of
    their own and Triton's barriers removed), with the other rescale place (`rescale_late`),
    and fp8's persistent form; in
    fp8 each of the three with `sum_mma` the other way from the default (the row sums by the
    tensor cores: stop 36, right since stop 40). Stop 36 also measured part of the
    exponentials on the FMA pipe (slower; removed, NOTES). Stop 43: k and v on barriers of
    their own (`split_kv`: the 16-bit default since, slower in fp8), and 16-bit 128-key steps
    over two stages (the 16-bit default since) against stop 28's 64-key steps over four.
    Stop 44: the warpgroup barriers before the kernel's mbarrier arrives and waits removed
    from its PTX (`lean_sync`): fp8 with it, alone and with split_kv (neutral, off); 16-bit's
    default since, with the late rescale, each the other way.
    Stop 28's runs measured the step, ring and q_tma choices, stop 29's the rescale's place
    and loading each unit's fields a unit ahead (NOTES)."""
    from dataclasses import replace

    from mla_plugins.core.kernels.triton_kernel import (
        BF16_CONFIG,
        FP8_CONFIG,
        GLUON_BF16_CONFIG,
        GLUON_FP8_CONFIG,
    )

    if fp8:
        configs = {"triton 64x64 w4 s4": FP8_CONFIG}
        base = GLUON_FP8_CONFIG
        other = not base.sum_mma
        knobs = ({}, {"rescale_late": False}, {"persistent": True, "q_tma": False,
                                                 "rescale_late": False},
                 {"sum_mma": other}, {"sum_mma": other, "rescale_late": False},
                 {"sum_mma": other, "persistent": True, "q_tma": False, "rescale_late": False},
                 {"split_kv": not base.split_kv}, {"lean_sync": not base.lean_sync},
                 {"lean_sync": not base.lean_sync, "split_kv": not base.split_kv})
    else:
        configs = {"triton 128x64 w8 s3": BF16_CONFIG}
        base = GLUON_BF16_CONFIG
        # stop 44's (stop 43's with rescale_late and lean_sync) with each knob the other way,
        # both off (stop 43's default), and stop 28's (64-key steps over four stages, pingpong)
        knobs = ({}, {"rescale_late": False}, {"lean_sync": False},
                 {"rescale_late": False, "lean_sync": False}, {"pingpong": True},
                 {"split_kv": False},
                 {"block_n": 64, "num_stages": 4, "pingpong": True, "split_kv": False,
                  "rescale_late": False, "lean_sync": False})
    for knob in knobs:
        cfg = replace(base, **knob)
        configs[f"gluon {cfg.block_m}x{cfg.block_n} s{cfg.num_stages}"
                f"{' pingpong' if cfg.pingpong else ''}{' persistent' if cfg.persistent else ''}"
                f"{' q_tma' if cfg.q_tma else ''}{' late' if cfg.rescale_late else ''}"
                f"{' sum_mma' if cfg.sum_mma else ''}{' split_kv' if cfg.split_kv else ''}"
                f"{' lean' if cfg.lean_sync else ''}"] = cfg
    return configs


def variants(args):
    """Phase-1 variants side by side (`variant_configs`; fp8, or 16-bit with --bf16): error
    against float64 and TFLOP/s end to end and (fp8) of the attention alone, each with its
    own plan (tile_q = the variant's block_m); FA3 in the same process: bf16 in 16-bit, in fp8
    FA3 FP8 alone and with its quantization (`_fa3_fp8_rows`)."""
    from mla_plugins.core.api import plan_prefill
    from mla_plugins.core.kernels.triton_kernel import run_prefill, split_workers
    from mla_plugins.core.kernels.triton_reduce import reduce
    from tests.gpu.conftest import make_inputs, reference_on_device, rel_err

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    fp8 = not args.bf16
    configs = variant_configs(fp8)
    if args.variant_filter:
        wanted = args.variant_filter.split(",")
        configs = {k: c for k, c in configs.items() if any(w == k for w in wanted)}
    shapes = {n: (lq, lk, h) for n, lq, lk, h in SHAPES}
    shapes["varlen-H16"] = ([1024, 777, 300, 64, 1], [1024, 777, 300 + 129, 64, 1], 16)
    names = args.shapes.split(",") if args.shapes else list(VARIANT_SHAPES)
    rows = []
    for name in names:
        lq, lk, heads = shapes[name]
        q, k, v, cq, ck = make_batch(lq, lk, heads, device)
        fl = flops(lq, lk, heads)
        ref, _ = reference_on_device(q, k, v, cq, ck, heads_per_step=4)
        inputs = make_inputs(q, k, v, cq, ck, causal=True, fp8=fp8)
        peer_rows = ([_fa3_bf16_row(name, q, k, v, cq, ck, lq, lk, ref, fl)] if not fp8
                     else _fa3_fp8_rows(name, q, k, v, cq, ck, lq, lk, ref, fl, heads))
        for peer_row in peer_rows:
            rows.append(peer_row)
            print(json.dumps(peer_row), flush=True)
        for label, cfg in configs.items():
            row = {"shape": name, "variant": label}
            try:
                workers = split_workers(lq, lk, heads, cfg.block_m, sms)
                plan = plan_prefill(cq, ck, num_heads=heads, causal=True, kernel="triton", tile_q=cfg.block_m,
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
                e2e, attn = time_ours(q, k, v, cq, ck, heads, fp8, plan, cfg, graphs=graphs)
                row.update(e2e_ms=e2e, e2e_tflops=fl / e2e / 1e9)
                if attn:
                    row.update(attn_ms=attn, attn_tflops=fl / attn / 1e9)
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


def _fa3_fp8_rows(name, q, k, v, cq, ck, lq, lk, ref, fl, heads) -> list:
    """FA3 FP8 on the variants' inputs: the attention alone on inputs quantized beforehand
    (`attn_graph_*`, beside our variants' attention alone) and "FA3 FP8 e2e", its quantization
    timed with it (`e2e_graph_*`), so one `--variants` run gives issue 21's two ratios."""
    import peers

    from tests.gpu.conftest import rel_err

    rows = []
    hq, hk = cq.tolist(), ck.tolist()
    for label, key in (("fa3 fp8", "attn"), ("fa3 fp8 e2e", "e2e")):
        row = {"shape": name, "variant": label}
        try:
            if key == "attn":
                run, res = peers.fa3_peer(q, k, v, cq, ck, max(lq), max(lk), DQK**-0.5, fp8=True,
                                          quantized=peers.head_quant_qkv(q, k, v, hq, hk))
            else:
                run, res = peers.fa3_fp8_e2e_peer(q, k, v, cq, ck, max(lq), max(lk), DQK**-0.5,
                                                  len(lq), heads)
            run()
            row["err"] = rel_err(res(), ref)
            gms = graph_ms(run)
            if gms:
                row.update({f"{key}_graph_ms": gms, f"{key}_graph_tflops": fl / gms / 1e9})
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    return rows


def _fa3_bf16_row(name, q, k, v, cq, ck, lq, lk, ref, fl) -> dict:
    """FA3 bf16 (its public call, the frameworks' peer) on the variants' inputs."""
    row = {"shape": name, "variant": "fa3 bf16"}
    try:
        import peers

        from tests.gpu.conftest import rel_err

        run, res = peers.fa3_peer(q, k, v, cq, ck, max(lq), max(lk), DQK**-0.5)
        run()
        row["err"] = rel_err(res(), ref)
        gms = graph_ms(run)
        if gms:
            row.update(e2e_graph_ms=gms, e2e_graph_tflops=fl / gms / 1e9)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


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


def graph_ms(fn):
    """GPU time of fn replayed from a CUDA graph (no launch gaps), or None if capture fails."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:
        return None


def measure(fn, *, graph=True):
    """(ms call by call, L2 flushed; ms per call replayed from a CUDA graph, GPU time)."""
    ms = bench(fn)
    return ms, (graph_ms(fn) if graph else None)


def _ours_call(q, k, v, plan, fp8, out, kernel="auto"):
    import mla_plugins

    def fn():
        mla_plugins.mla_prefill(q, k, v, plan=plan, fp8=fp8, out=out, kernel=kernel)

    return fn


def _attention_only(q, k, v, cq, ck, heads, plan):
    """Ours in fp8 on inputs quantized beforehand (the quantization not timed): the Triton
    provider's phase 1 (and reduce) alone, as `time_ours` does."""
    _, attn = time_ours(q, k, v, cq, ck, heads, True, plan, e2e=False, graphs=(g := {}))
    return attn, g.get("attn_graph_ms")


def shape_row(name, lq, lk, heads, device, gemm, only_auto=False):
    """Every variant and peer of one shape (see the module docstring); `only_auto`: the
    kernel="auto" variants alone (measured again once the dispatch table is written)."""
    import peers

    import mla_plugins
    from mla_plugins.core.dispatch import batch_work
    from tests.gpu.conftest import reference_on_device, rel_err

    q, k, v, cq, ck = make_batch(lq, lk, heads, device)
    fl = flops(lq, lk, heads)
    scale = DQK**-0.5
    row = {"shape": name, "heads": heads, "tflop": fl / 1e12}
    work, mean_q = batch_work(cq.tolist(), ck.tolist(), heads, True)
    row["work"], row["mean_q"] = work, mean_q
    ref, _ = reference_on_device(q, k, v, cq, ck, heads_per_step=4)
    out = torch.empty(q.shape[0], heads, DV, dtype=q.dtype, device=device)
    hq, hk = cq.tolist(), ck.tolist()

    fns, samples = {}, {}

    def record(key, fn, result=None, graph=True):
        try:
            fn()
            got = result() if result is not None else out
            row[f"err_{key}"] = rel_err(got, ref)
            ms, gms = measure(fn, graph=graph)
            row[f"{key}_ms"], row[f"{key}_tflops"] = ms, fl / ms / 1e9
            if gms:
                row[f"{key}_graph_ms"], row[f"{key}_graph_tflops"] = gms, fl / gms / 1e9
                fns[key], samples[key] = fn, [gms]
        except Exception as exc:
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()

    def peer(key, make):
        try:
            run, res = make()
            record(key, run, res)
        except Exception as exc:
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"

    # ours through the public API, a plan per batch, as the adapters call it
    variants = (("auto_fp8", "auto", True), ("auto_bf16", "auto", False),
                ("ours_fp8", "triton", True), ("ours_bf16", "triton", False),
                ("fa_fp8", "flash_attn", True), ("fa_bf16", "flash_attn", False))
    for key, kernel, fp8 in variants[:2] if only_auto else variants:
        try:
            plan = mla_plugins.plan_prefill(hq, hk, num_heads=heads, fp8=fp8, kernel=kernel,
                                            device=device)
        except Exception as exc:
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        if kernel == "auto":
            row[f"{key}_kernel"] = plan.kernel + (" (bf16)" if plan.auto_bf16 else "")
        record(key, _ours_call(q, k, v, plan, fp8, out, kernel))
        if key == "ours_fp8":
            try:
                attn, attn_g = _attention_only(q, k, v, cq, ck, heads, plan)
                row["ours_fp8_attn_ms"], row["ours_fp8_attn_tflops"] = attn, fl / attn / 1e9
                if attn_g:
                    row["ours_fp8_attn_graph_tflops"] = fl / attn_g / 1e9
            except Exception as exc:
                row["ours_fp8_attn_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
    row["auto_kernel"] = row.get("auto_fp8_kernel")
    if only_auto:
        # the peers the goals divide by, in the same run
        import peers

        max_q, max_k = max(lq), max(lk)
        for key, make in (
                ("fa3_fp8_e2e", lambda: peers.fa3_fp8_e2e_peer(q, k, v, cq, ck, max_q, max_k, scale,
                                                               len(lq), heads)),
                ("fa3_bf16", lambda: peers.fa3_peer(q, k, v, cq, ck, max_q, max_k, scale))):
            peer(key, make)
        # the goals' ratios compare figures of ~1% noise (where auto runs FA3 bf16 itself,
        # the same kernel): two more rounds of each, interleaved, and the median of three
        for _ in range(2):
            for key in ("auto_fp8", "auto_bf16", "fa3_bf16", "fa3_fp8_e2e"):
                if key in fns and (gms := graph_ms(fns[key])):
                    samples[key].append(gms)
        for key, got in samples.items():
            gms = statistics.median(got)
            row[f"{key}_graph_ms"], row[f"{key}_graph_tflops"] = gms, fl / gms / 1e9
            row[f"{key}_graph_ms_samples"] = got
        ratios(row, gemm)
        return row
    # peers
    max_q, max_k = max(lq), max(lk)
    try:
        quant = peers.head_quant_qkv(q, k, v, hq, hk)
        run, res = peers.fa3_peer(q, k, v, cq, ck, max_q, max_k, scale, fp8=True, quantized=quant)
        record("fa3_fp8", run, res)
        del quant
    except Exception as exc:
        row["fa3_fp8_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    for key, qmode in (("fa3_fp8_e2e", "triton"), ("fa3_fp8_e2e_torch", "torch")):
        try:
            run, res = peers.fa3_fp8_e2e_peer(q, k, v, cq, ck, max_q, max_k, scale, len(lq), heads,
                                              quant=qmode)
            record(key, run, res)
        except Exception as exc:
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        run, res = peers.fa3_peer(q, k, v, cq, ck, max_q, max_k, scale)
        record("fa3_bf16", run, res)
    except Exception as exc:
        row["fa3_bf16_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    for key, make in (("cudnn_bf16_br", lambda: peers.cudnn_bf16_peer(q, k, v, lq, lk, heads, scale)),
                      ("cudnn_fp8", lambda: peers.cudnn_fp8_peer(q, k, v, lq, lk, heads, scale)),
                      ("sdpa_cudnn_bf16", lambda: peers.sdpa_cudnn_peer(q, k, v, lq, lk, heads))):
        peer(key, make)

    ratios(row, gemm)
    # the measured variants the dispatch table ranks (GPU time, µs)
    row["dispatch_gpu_us"] = {
        f"{kernel}:{mode}": row[f"{key}_graph_ms"] * 1e3
        for key, kernel, mode in (("fa_fp8", "flash_attn", "fp8"), ("fa_bf16", "flash_attn", "bf16"),
                                  ("ours_fp8", "triton", "fp8"), ("ours_bf16", "triton", "bf16"))
        if row.get(f"{key}_graph_ms")
    }
    return row


def ratios(row, gemm):
    """The issue's ratios, from the GPU-time (graph) figures."""
    g = lambda key: row.get(f"{key}_graph_tflops")  # noqa: E731
    ratio = lambda a, b: (a / b) if a and b else None  # noqa: E731
    row["auto_fp8_vs_fa3_fp8_e2e"] = ratio(g("auto_fp8"), g("fa3_fp8_e2e"))
    row["auto_fp8_vs_fa3_bf16"] = ratio(g("auto_fp8"), g("fa3_bf16"))
    row["auto_bf16_vs_fa3_bf16"] = ratio(g("auto_bf16"), g("fa3_bf16"))
    row["ours_fp8_vs_fa3_fp8_e2e"] = ratio(g("ours_fp8"), g("fa3_fp8_e2e"))
    row["ours_fp8_attn_vs_fa3_fp8"] = ratio(g("ours_fp8_attn"), g("fa3_fp8"))
    row["ours_bf16_vs_fa3_bf16"] = ratio(g("ours_bf16"), g("fa3_bf16"))
    row["ours_fp8_of_fp8_gemm"] = ratio(g("ours_fp8_attn"), gemm)
    row["fa3_fp8_of_fp8_gemm"] = ratio(g("fa3_fp8"), gemm)


def main_bench(args):
    device = torch.device("cuda")
    if args.dispatch_out:
        # refused before the run, not after it: a table written under another card's name
        # would steer kernel="auto" on cards this one does not stand for
        from mla_plugins.core import dispatch

        props = torch.cuda.get_device_properties(device)
        expected = dispatch.table_file((props.major, props.minor), props.name)
        if os.path.basename(args.dispatch_out) != expected:
            sys.exit(f"--dispatch-out {args.dispatch_out}: measured on {props.name} (sm_"
                     f"{props.major}{props.minor}), this card's table is "
                     f"{expected or 'none (dispatch.TABLES names no file for it)'}; "
                     f"name that file, or add the card to dispatch.TABLES")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    result = {"env": environment(),
              "command": "PYTHONPATH=. python benchmarks/prefill.py " + " ".join(sys.argv[1:])}
    result["ceilings"] = {
        "fp8_gemm_tflops": fp8_gemm_ceiling(device),
        "bf16_gemm_tflops": bf16_gemm_ceiling(device),
        "copy_tb_s": copy_ceiling(device),
    }
    print(json.dumps(result["ceilings"]), flush=True)
    gemm = result["ceilings"]["fp8_gemm_tflops"]
    rows = []
    for name, lq, lk, heads in _selected_shapes(args):
        row = shape_row(name, lq, lk, heads, device, gemm)
        rows.append(row)
        print(json.dumps(row), flush=True)
        result["shapes"] = rows
        _save(result, args.out)  # what is measured survives a call cut short
        torch.cuda.empty_cache()
    result["shapes"] = rows
    if args.dispatch_out:
        # the table kernel="auto" will read, then the auto columns again with it: what the
        # committed table gives (the first auto figures, with the table the tree had, stay
        # under "auto_before_table")
        write_dispatch(result, args.dispatch_out, os.path.basename(args.out))
        from mla_plugins.core import dispatch

        dispatch._load.cache_clear()
        for row, (name, lq, lk, heads) in zip(rows, _selected_shapes(args),
                                              strict=True):
            again = shape_row(name, lq, lk, heads, device, gemm, only_auto=True)
            row["auto_before_table"] = {k: v for k, v in row.items() if k.startswith("auto_")}
            row.update({k: v for k, v in again.items() if k.startswith(("auto_", "err_auto"))})
            ratios(row, gemm)
            print(json.dumps({"shape": name, "auto_kernel": row.get("auto_kernel"),
                              "auto_fp8_graph_tflops": row.get("auto_fp8_graph_tflops"),
                              "auto_bf16_graph_tflops": row.get("auto_bf16_graph_tflops")}), flush=True)
            torch.cuda.empty_cache()
    _save(result, args.out)
    if not args.no_accuracy:
        from accuracy import accuracy_section

        result["accuracy"] = accuracy_section(device)
        _save(result, args.out)
    if not args.no_serving:
        result["serving"] = _serving()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)


def plain_fp8(row) -> dict:
    """"flash_attn:fp8-plain": the FA3 provider's fp8 without the rotation is the same
    computation as the FA3 FP8 e2e peer (triton_heads.quantize_heads with rotate=False, then
    FA3's fp8 forward): its GPU time, measured in the same run."""
    ms = row.get("fa3_fp8_e2e_graph_ms")
    return {"flash_attn:fp8-plain": ms * 1e3} if ms else {}


def _save(result, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _selected_shapes(args):
    """SHAPES in their order, those named by --shapes where it is given."""
    only = set(args.shapes.split(",")) if args.shapes else None
    return [s for s in SHAPES if only is None or s[0] in only]


def auto_only(args):
    """--auto-only: what a framework gets on this tree with the committed table, beside FA3."""
    device = torch.device("cuda")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mla_plugins.core import dispatch

    result = {"env": environment(), "command": "PYTHONPATH=. python benchmarks/prefill.py "
              + " ".join(sys.argv[1:]), "fp8_rotate_default": _rotate_default(),
              "table": (dispatch.table_for(device) or dispatch.Table("none", "none", ())).source}
    rows = []
    for name, lq, lk, heads in _selected_shapes(args):
        rows.append(shape_row(name, lq, lk, heads, device, None, only_auto=True))
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_ms")}), flush=True)
        result["shapes"] = rows
        _save(result, args.out)
        torch.cuda.empty_cache()
    for r in rows:
        print(f"{r['shape']:>26} {str(r.get('auto_kernel')):>20} "
              + " ".join(f"{k}={r.get(k) or 0:.2f}" for k in (
                  "auto_fp8_vs_fa3_fp8_e2e", "auto_fp8_vs_fa3_bf16", "auto_bf16_vs_fa3_bf16",
                  "err_auto_fp8", "err_auto_bf16")))


def _rotate_default() -> bool:
    from mla_plugins.core.fp8 import rotation_applies

    return rotation_applies(DQK, None)


def write_dispatch(result, path, results_name):
    """The dispatch table kernel='auto' reads (mla_plugins/core/dispatch.py): each shape's
    work, mean query length and the GPU time of every measured (kernel, mode). `results_name`:
    the results file it comes from, as committed under benchmarks/results/."""
    entries = [{"shape": r["shape"], "work": r["work"], "mean_q": r["mean_q"],
                "gpu_us": {**r["dispatch_gpu_us"], **plain_fp8(r)}}
               for r in result["shapes"] if r.get("dispatch_gpu_us")]
    table = {"device": result["env"]["gpu"], "capability": list(torch.cuda.get_device_capability()),
             "source": f"benchmarks/results/{results_name} (benchmarks/prefill.py --dispatch-out)",
             "command": result["command"], "entries": entries}
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    print(f"dispatch table: {len(entries)} shapes -> {path}")


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
    return mla_plugins.plan_prefill(cq, ck, num_heads=heads, causal=True, kernel="triton",
                                    **TritonKernel().plan_params(inputs))


def print_table(r):
    c = r["ceilings"]
    print(f"\n{r['env']['gpu']}  torch {r['env']['torch']}  triton {r['env']['triton']}  cuDNN {r['env']['cudnn']}")
    print(f"ceilings: FP8 GEMM {c['fp8_gemm_tflops']:.0f} TFLOP/s, bf16 GEMM {c['bf16_gemm_tflops']:.0f} TFLOP/s, "
          f"copy {c['copy_tb_s']:.2f} TB/s")
    print("GPU time (CUDA-graph replay), TFLOP/s (causal, bottom-right for k > q; 2*H*(192+128) per visible pair)")
    cols = (("auto", "auto_kernel", None), ("auto f8", "auto_fp8_graph_tflops", 0),
            ("auto b16", "auto_bf16_graph_tflops", 0), ("ours f8", "ours_fp8_graph_tflops", 0),
            ("f8 attn", "ours_fp8_attn_graph_tflops", 0), ("ours b16", "ours_bf16_graph_tflops", 0),
            ("FA3 f8", "fa3_fp8_graph_tflops", 0), ("FA3 f8e2e", "fa3_fp8_e2e_graph_tflops", 0),
            ("FA3 b16", "fa3_bf16_graph_tflops", 0), ("cuDNN b16", "cudnn_bf16_br_graph_tflops", 0),
            ("cuDNN f8", "cudnn_fp8_graph_tflops", 0),
            ("a8/e2e", "auto_fp8_vs_fa3_fp8_e2e", 2), ("a8/FA16", "auto_fp8_vs_fa3_bf16", 2),
            ("a16/FA16", "auto_bf16_vs_fa3_bf16", 2), ("o8/e2e", "ours_fp8_vs_fa3_fp8_e2e", 2),
            ("o16/FA16", "ours_bf16_vs_fa3_bf16", 2), ("err a8", "err_auto_fp8", 4),
            ("err a16", "err_auto_bf16", 4))
    f = lambda x, p: "-" if x is None else (f"{x:.{p}f}" if isinstance(x, float) and p is not None else str(x))  # noqa: E731
    print(" ".join(f"{'shape':>24}") + " " + " ".join(f"{h:>10}" for h, _, _ in cols))
    for row in r["shapes"]:
        print(f"{row['shape'][:24]:>24} " + " ".join(f"{f(row.get(k), p)[:10]:>10}" for _, k, p in cols))
    for row in r["shapes"]:
        for key, val in row.items():
            if key.endswith("_error"):
                print(f"{row['shape']} {key}: {str(val)[:160]}")
    if r.get("accuracy"):
        from accuracy import print_accuracy

        print_accuracy(r["accuracy"])


def _serving() -> list[dict]:
    """The "serving" section: benchmarks/serving.py's 61-call loops (H6)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from serving import run_serving

    return run_serving()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--variant-filter", default="",
                    help="with --variants: comma-separated variant labels to run (default: all)")
    ap.add_argument("--variants", action="store_true",
                    help="fp8 phase-1 variants (Triton, Gluon per ring depth): error and TFLOP/s")
    ap.add_argument("--bf16", action="store_true",
                    help="with --variants: the 16-bit variants, beside FA3 bf16")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--dispatch-out", default="",
                    help="also write the dispatch table kernel='auto' reads, named for the card "
                         "it is measured on (mla_plugins.core.dispatch.TABLES: "
                         "mla_plugins/core/dispatch_h100.json on an H100, dispatch_h200.json on "
                         "an H200)")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the accuracy section")
    ap.add_argument("--auto-only", action="store_true",
                    help="kernel='auto' (fp8, bf16) and the FA3 peers its goals divide by, every "
                         "shape, with the committed dispatch table")
    ap.add_argument("--no-serving", action="store_true", help="skip the serving section")
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
        (sweep if args.sweep else variants if args.variants else auto_only if args.auto_only
         else main_bench)(args)
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()

