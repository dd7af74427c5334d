"""Ahead-of-time compilation of every Triton kernel for sm_90, gfx942 and gfx950, on a CPU.

`triton.compile(ASTSource(...), target=GPUTarget(...))` runs the whole backend (ttgir, llir,
then ptxas or the AMDGPU backend) without a GPU. Resource figures come from what it emits:
- CUDA: `cuobjdump --dump-resource-usage` on the cubin (REG, STACK) and `nvdisasm`'s count
  of local-memory stores (STL): a spill is a nonzero stack or any STL; for the Gluon
  attention kernel also the local loads and stores inside its key loops (`key_loop_spills`);
- AMD: the `.vgpr_count`, `.vgpr_spill_count`, `.sgpr_spill_count`, `ScratchSize` and
  `Occupancy` lines of the amdgcn text: a spill is a nonzero VGPR spill count or scratch
  (SGPR spills go to VGPR lanes, not memory, and are reported but allowed).

What is compiled is what a launch compiles: the provider's own host code runs a planned
call on CPU tensors shaped as on the device (`record`) with each kernel's module attribute
replaced by a recorder, and Triton's own binder turns each recorded call into the
signature, constexprs and specialization (16-divisible ints and 16-aligned pointers)
its launcher would compile (`spec_of`). So a stride the host passes is specialized here
exactly as on the GPU, and a configuration the host never launches is not compiled.

`python -m tests.compile.aot` prints the table recorded in benchmarks/NOTES.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from mla_plugins.core.kernels import gluon_sync as gs
from mla_plugins.core.kernels import triton_attention as ta
from mla_plugins.core.kernels import triton_heads as th
from mla_plugins.core.kernels import triton_kernel as tk
from mla_plugins.core.kernels import triton_quant as tq
from mla_plugins.core.kernels import triton_reduce as tr

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}
#: fp8 format each arch computes in (core/device.py's fp8_dtype_for)
FP8_DTYPE = {"sm_90": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz,
             "gfx950": torch.float8_e4m3fn}
#: the batches launches are recorded from: heads, q lengths = k lengths (causal)
BATCH = (16, [300, 517, 64])
#: SMs of the GPU the recorded launches are sized for
H200_SMS = 132
#: another batch of the same model, for the one-variant-per-model check
OTHER_BATCH = (16, [1, 4096, 333, 77, 129])


@dataclass
class Spec:
    """One kernel as the host code launches it on `arch`: what `triton.compile` gets."""

    name: str
    arch: str
    fn: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    gluon: bool = False
    #: warps a CTA holds when warp-specialized partitions add their own (in warpgroups of 4)
    total_warps: int | None = None

    def key(self) -> tuple:
        """What Triton's kernel cache keys a launch by (signature, specialization, options)."""
        opts = {k: self.options.get(k) for k in ("num_warps", "num_stages", "maxnreg")}
        return (self.arch, self.fn.__name__, repr(self.signature), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), repr(opts))


@dataclass
class Result:
    spec: Spec
    regs: int | None = None  # CUDA registers per thread, AMD VGPRs (arch + acc) per lane
    spills: int = 0  # CUDA: STL instructions; AMD: VGPR spill count
    stack: int = 0  # CUDA stack frame / AMD scratch bytes
    sgpr_spills: int = 0
    shared: int = 0
    occupancy: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def spilled(self) -> bool:
        return self.spills > 0 or self.stack > 0


class _Recorder:
    """Stands in for a JIT kernel in its module: `kernel[grid](...)` notes the call."""

    def __init__(self, fn, calls: list) -> None:
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


@contextlib.contextmanager
def _recording(calls: list, tma: bool, permuted: bool):
    """Every kernel launch of the host code goes to `calls` instead of a GPU; `tma` is what
    the host code's TMA check answers (sm_90: yes; Ampere, Ada, ROCm: no), `permuted` what
    `triton_quant.permuted_v` answers (CUDA: yes; ROCm: no), and `triton_quant.quant_warps`
    and `triton_quant.on_rocm` answer as on CUDA (permuted) or on ROCm."""
    from mla_plugins.core.kernels import gluon_attention as ga

    rocm = not permuted
    answers = {"_can_tma": lambda device: tma, "permuted_v": lambda device: permuted,
               "on_rocm": lambda device: rocm,
               "quant_warps": lambda device, rotate, rotation=tq.ROTATION: tq.warps_for(
                   rocm, rotate, rotation)}
    patched = [(ta, "mla_prefill_kernel"), (tq, "_quant_qkv_kernel"), (tr, "_reduce_kernel"),
               (tq, "_outlier_side_kernel"),
               (ga, "mla_prefill_gluon_kernel"), (th, "_head_bound_kernel"),
               (th, "_head_cast_kernel"), (th, "_gluon_cast_kernel"), (tk, "_can_tma"),
               (tq, "permuted_v"), (tq, "quant_warps"), (tq, "on_rocm")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in patched]
    try:
        for mod, name, fn in saved:
            setattr(mod, name, answers[name] if name in answers else _Recorder(fn, calls))
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def record(arch: str, fp8: bool, config, *, layout: str = "packed", batch=BATCH,
           split: bool = False, tma: bool | None = None, rotate: bool = False,
           rotation: str = tq.ROTATION, fill_gpu: bool = False, outliers: bool = False,
           gluon_outliers: bool = False) -> list:
    """The launches (fn, args, kwargs) of one planned call through the Triton provider's own
    host code (`TritonKernel._run_ordinary`: the workspace views, the quantization (q and k
    rotated with `rotate`, by `rotation`: the provider passes none, so another one than the
    default is passed by wrapping `triton_quant.quantize_qkv` for the call), phase 1 with
    `config`, the reduce of a split plan), on CPU tensors shaped as on the device; `fill_gpu`: the
    SM count taken as 0, so that the dense rotation's q/k/v launch takes ROTATED_QKV_BLOCKS, as
    a batch that fills the GPU does (`triton_quant.rotated_qkv_blocks`); `outliers`: fp8 with
    the outlier features' corrections (the quantization's maxima, the side tiles' launch);
    `gluon_outliers`: triton_kernel.GLUON_OUTLIERS on for the call (the Gluon kernel takes
    them)"""
    from mla_plugins.core.api import plan_prefill
    from mla_plugins.core.kernels.base import PrefillInputs
    from tests.core.helpers import random_batch, vllm_v_view

    heads, lens = batch
    q, k, v, cq, ck = random_batch(lens, lens, heads)
    if layout == "vllm":  # k a packed cat of k_nope and k_pe, v a view (vllm_v_view)
        v = vllm_v_view(v)
    inputs = PrefillInputs(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, softmax_scale=0.07,
                           causal=True, fp8=fp8, fp8_dtype=FP8_DTYPE[arch],
                           max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                           fp8_rotate=fp8 and rotate, fp8_outliers=fp8 and outliers)
    plan = plan_prefill(cq, ck, num_heads=heads, causal=True, tile_q=config.block_m,
                        num_workers=heads * 4 if split else 1)
    plan.memo[("phase1_config", fp8)] = config  # what batch_config picks on the device
    kernel = tk.TritonKernel()
    scratch, _ = kernel.scratch_entry(inputs, plan, None)
    out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype)
    lse = torch.empty(q.shape[0], heads)
    calls: list = []
    cuda = arch.startswith("sm_")
    quantize_qkv = tq.quantize_qkv
    workers = tk.default_num_workers
    gluon_outliers_saved = tk.GLUON_OUTLIERS
    try:
        tk.GLUON_OUTLIERS = gluon_outliers
        # the SM count the provider sizes the rotated q/k/v grid by: an H200's (132, so the
        # small recorded batch takes the fewest blocks a program), or none (the most)
        tk.default_num_workers = lambda device: 0 if fill_gpu else H200_SMS
        if rotation != tq.ROTATION:
            tq.quantize_qkv = functools.partial(quantize_qkv, rotation=rotation)
        with _recording(calls, cuda if tma is None else tma, cuda):
            kernel._run_ordinary(inputs, plan, out, lse, scratch)
            if split:  # AITER's reduce signature without a final map (mla_reduce's other one)
                kernel.reduce(tk.ReduceInputs(
                    partial_out=scratch["partial_out"], partial_lse=scratch["partial_lse"],
                    reduce_indptr=plan.reduce_indptr, reduce_final_map=None,
                    reduce_partial_map=plan.reduce_partial_map, tile_q=plan.tile_q,
                    num_kv_splits=0, out=out, final_lse=lse))
    finally:
        tq.quantize_qkv = quantize_qkv
        tk.default_num_workers = workers
        tk.GLUON_OUTLIERS = gluon_outliers_saved
    return calls


def record_heads(arch: str, *, rotate: bool, batch=BATCH, layout: str = "vllm",
                 rotation: str = tq.ROTATION) -> list:
    """The two launches of `triton_heads.quantize_heads` (the FA3 provider's quantization,
    which no host code of this package runs), on CPU tensors shaped as on the device: v as
    vLLM passes it (a view of a wider tensor) by default. `rotation="gluon"` (the Gluon cast,
    `gluon_rotate`): on sm_90, where `triton_heads.gluon_reasons` is answered as on the GPU
    (nothing stops it); nothing on ROCm, where the selection refuses it."""
    from tests.core.helpers import random_batch, vllm_v_view

    cuda = arch.startswith("sm_")
    if rotate and rotation == "gluon" and not cuda:
        return []
    heads, lens = batch
    q, k, v, cq, ck = random_batch(lens, lens, heads)
    if layout == "vllm":
        v = vllm_v_view(v)
    splits = th.head_splits(max(lens), len(lens), heads, 132)
    calls: list = []
    reasons, pdl = th.gluon_reasons, th._pdl_capable
    try:
        # answered as on the GPU: the Gluon cast runs on sm_90, and so does PDL (Hopper)
        th.gluon_reasons = lambda device: []
        th._pdl_capable = lambda device: cuda
        with _recording(calls, cuda, cuda):
            th.quantize_heads(q, k, v, cq, ck, len(lens), max(lens), max(lens), splits,
                              FP8_DTYPE[arch], rotate=rotate, rotation=rotation)
    finally:
        th.gluon_reasons, th._pdl_capable = reasons, pdl
    return calls


def spec_of(arch: str, fn, args, kwargs, name: str, total_warps: int | None = None) -> Spec:
    """The compile job Triton's launcher would make of this call for `arch`: its own binder
    and argument packing (specialization of ints and pointers included)."""
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(TARGETS[arch])
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                          options)
    gluon = type(fn).__name__ == "GluonJITFunction"
    return Spec(name, arch, fn, signature, constexprs, attrs, dict(options.__dict__), gluon,
                total_warps)


def _rotation(c) -> str:
    """A quantization kernel's rotation in its name: " rotate" (dense), " rotate kron", or
    "" (not rotated)."""
    return (" rotate" + (" kron" if c.get("KRON") else "")) if c["ROTATE"] else ""


def _name(fn, kwargs, config=None, tma=False) -> str:
    c = kwargs
    if fn.__name__ == "mla_prefill_kernel":
        return (f"attention {'fp8' if c['FP8'] else 'bf16'} {c['BLOCK_M']}x{c['BLOCK_N']} "
                f"w{c['num_warps']} s{c['num_stages']}" + (" tma" if c["USE_TMA"] else "")
                + (" outliers" if c.get("OUTLIERS") else ""))
    if fn.__name__ == "_outlier_side_kernel":
        return f"outliers side w{c['num_warps']}"
    if fn.__name__ == "mla_prefill_gluon_kernel":
        return (f"gluon attention {'fp8' if c['FP8'] else 'bf16'} {c['BLOCK_M']}x{c['BLOCK_N']} "
                f"s{c['NUM_STAGES']} ws"
                + (" pingpong" if c["PINGPONG"] else "") + (" persistent" if c["PERSISTENT"] else "")
                + (" q_tma" if c["Q_TMA"] else "") + (" late" if c["RESCALE_LATE"] else "")
                + (" sum_mma" if c["SUM_MMA"] else "") + (" split_kv" if c["SPLIT_KV"] else "")
                + (" lean" if c["LEAN_SYNC"] else "") + (" outliers" if c.get("OUTLIERS") else ""))
    pdl = " pdl" if c.get("PDL") else ""
    if fn.__name__ == "_gluon_cast_kernel":
        return f"heads cast rotate gluon w{c['num_warps']}" + pdl
    if fn.__name__ in ("_head_bound_kernel", "_head_cast_kernel"):
        part = "bound" if fn.__name__ == "_head_bound_kernel" else "cast"
        return f"heads {part}" + _rotation(c) + f" w{c['num_warps']}" + pdl
    if fn.__name__ == "_quant_qkv_kernel":
        blocks = f" kv{c['KV_BLOCKS']}" if c.get("KV_BLOCKS", 1) > 1 else ""
        return ("quant_qkv" + _rotation(c) + blocks + (" outliers" if c.get("OUTLIERS") else "")
                + f" w{c['num_warps']}")
    return f"reduce final_map={int(c['HAS_FINAL_MAP'])}"


def scenarios(arch: str) -> list[dict]:
    """Every configuration the host code launches on `arch` (record's keyword arguments)."""
    if arch.startswith("sm_"):
        from dataclasses import replace

        g = tk.GLUON_FP8_CONFIG
        runs = [dict(fp8=True, config=tk.FP8_CONFIG, split=True),
                dict(fp8=True, config=tk.FP8_CONFIG, rotate=True),
                dict(fp8=True, config=tk.FP8_CONFIG, rotate=True, fill_gpu=True),
                dict(fp8=True, config=tk.FP8_CONFIG, rotate=True, rotation="kron"),
                # the outlier features' corrections (fp8_outliers; not with the rotation)
                dict(fp8=True, config=tk.FP8_CONFIG, outliers=True, split=True),
                dict(fp8=False, config=tk.BF16_CONFIG, split=True),
                dict(fp8=False, config=tk.BF16_CONFIG, layout="vllm"),
                # Ampere / Ada, or a layout TMA cannot take: pointer loads
                dict(fp8=False, config=replace(tk.BF16_CONFIG, use_tma=False), tma=False),
                # the Gluon kernel, and what a TileConfig can ask of it (prefill.py --variants)
                dict(fp8=True, config=g), dict(fp8=True, config=replace(g, num_stages=3)),
                # the Gluon kernel's corrections product (fp8_outliers, GLUON_OUTLIERS)
                dict(fp8=True, config=g, outliers=True, gluon_outliers=True),
                dict(fp8=True, config=replace(g, pingpong=True)),
                dict(fp8=True, config=tk.GLUON_FP8_PERSISTENT_CONFIG),
                # the Gluon kernel on 16-bit inputs: packed, vLLM's v view, persistent
                dict(fp8=False, config=tk.GLUON_BF16_CONFIG, split=True),
                dict(fp8=False, config=tk.GLUON_BF16_CONFIG, layout="vllm"),
                dict(fp8=False, config=tk.GLUON_BF16_PERSISTENT_CONFIG),
                # q loaded by the consumers (TileConfig.q_tma off, prefill.py --variants)
                dict(fp8=True, config=replace(g, q_tma=False)),
                dict(fp8=False, config=replace(tk.GLUON_BF16_CONFIG, q_tma=False), layout="vllm"),
                # the accumulator's rescale in the other place (TileConfig.rescale_late)
                dict(fp8=True, config=replace(g, rescale_late=False)),
                dict(fp8=False, config=replace(tk.GLUON_BF16_CONFIG,
                                               rescale_late=not tk.GLUON_BF16_CONFIG.rescale_late)),
                # the row sums the other way from the default (TileConfig.sum_mma, fp8 only)
                dict(fp8=True, config=replace(g, sum_mma=not g.sum_mma)),
                dict(fp8=True, config=replace(g, sum_mma=not g.sum_mma, rescale_late=False)),
                # k and v on barriers of their own the other way from each default
                # (TileConfig.split_kv), and 16-bit's other step (stop 28's default: 64 keys
                # over four stages, pingpong)
                dict(fp8=True, config=replace(g, split_kv=not g.split_kv)),
                dict(fp8=False, config=replace(tk.GLUON_BF16_CONFIG,
                                               split_kv=not tk.GLUON_BF16_CONFIG.split_kv)),
                dict(fp8=False, config=replace(tk.GLUON_BF16_CONFIG, block_n=64, num_stages=4,
                                               pingpong=True, split_kv=False, rescale_late=False,
                                               lean_sync=False)),
                # the PTX's warpgroup barriers before mbarrier arrives and waits (TileConfig.
                # lean_sync, gluon_sync) the other way from each default (16-bit with q stored
                # by the consumers, lean: the scenario above without q_tma)
                dict(fp8=True, config=replace(g, lean_sync=not g.lean_sync)),
                dict(fp8=False, config=replace(tk.GLUON_BF16_CONFIG,
                                               lean_sync=not tk.GLUON_BF16_CONFIG.lean_sync))]
    else:
        runs = []
        for fp8 in (True, False):
            bm, bn, warps, stages = ta.arch_config(arch, fp8)
            config = tk.TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                                   use_tma=False)
            runs.append(dict(fp8=fp8, config=config, split=True))
        runs.append(dict(runs[0], rotate=True))
        runs.append(dict(runs[0], rotate=True, fill_gpu=True))
        runs.append(dict(runs[0], rotate=True, rotation="kron"))
        runs.append(dict(runs[0], outliers=True))
    return runs


def arch_specs(arch: str, batch=BATCH) -> list[Spec]:
    """The distinct compile jobs of every launch the host code makes on `arch` (one per
    Triton cache entry), recorded from `batch`, and of the per-head quantization
    (`record_heads`: not rotated, and rotated by each of `triton_quant.ROTATIONS`)."""
    if arch.startswith("sm_") and importlib.util.find_spec("triton.experimental.gluon") is None:
        raise RuntimeError("this Triton has no gluon: the sm_90 fp8 kernel cannot be compiled")
    from mla_plugins.core.kernels import gluon_attention as ga

    specs: dict[tuple, Spec] = {}
    launches = [call for run in scenarios(arch) for call in record(arch, batch=batch, **run)]
    heads = [dict(rotate=False)] + [dict(rotate=True, rotation=r) for r in tq.ROTATIONS]
    launches += [call for run in heads for call in record_heads(arch, batch=batch, **run)]
    for fn, args, kwargs in launches:
        gluon = fn.__name__ == "mla_prefill_gluon_kernel"
        spec = spec_of(arch, fn, args, kwargs, _name(fn, kwargs), ga.TOTAL_WARPS if gluon else None)
        specs.setdefault(spec.key(), spec)
    return list(specs.values())


def all_specs(archs=tuple(TARGETS)) -> list[Spec]:
    return [s for a in archs for s in arch_specs(a)]


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuda_occupancy(regs: int, threads: int, shared: int) -> str:
    """CTAs per SM on sm_90: 64K registers (allocated per warp in units of 256), 228 KB shared
    memory (1 KB reserved per CTA), 64 warps."""
    warps = threads // 32
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = (233472 // (shared + 1024)) if shared else 32
    ctas = max(0, min(by_regs, by_smem, 64 // warps, 32))
    return f"{ctas} CTA/SM ({ctas * warps} warps)"


def _constexpr(spec: Spec, name: str):
    """The value of the kernel's constexpr parameter `name` in `spec` (None if absent)."""
    names = spec.fn.arg_names
    return spec.constexprs.get((names.index(name),)) if name in names else None


_GLUON_COMPILE = threading.Lock()


def compile_spec(spec: Spec) -> Result:
    if spec.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    src = source(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=spec.attrs)
    # TileConfig.lean_sync: the launch compiles the Gluon kernel within gluon_sync.lean_compile
    lean = spec.gluon and _constexpr(spec, "LEAN_SYNC")
    # one Gluon compile at a time: lean_compile's hook is process-wide, so a kernel compiled
    # in another thread meanwhile would be rewritten too, and cached so (__main__'s JOBS
    # threads did that to a non-lean spec in stop 46)
    with _GLUON_COMPILE if spec.gluon else contextlib.nullcontext(), \
            gs.lean_compile() if lean else contextlib.nullcontext():
        k = triton.compile(src, target=TARGETS[spec.arch], options=spec.options)
    res = Result(spec, shared=int(getattr(k.metadata, "shared", 0) or 0))
    if "amdgcn" in k.asm:
        text = k.asm["amdgcn"]

        def field_(key):
            m = re.search(rf"{re.escape(key)}\s*:?\s*(\d+)", text)
            return int(m.group(1)) if m else 0

        res.regs = field_(".vgpr_count:")
        res.spills = field_(".vgpr_spill_count:")
        res.sgpr_spills = field_(".sgpr_spill_count:")
        res.stack = field_("; ScratchSize:")
        res.extra["agpr"] = field_(".agpr_count:")
        res.occupancy = f"{field_('; Occupancy:')} waves/SIMD"
    else:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([_tool("nvdisasm"), f.name], capture_output=True, text=True,
                                  check=True).stdout
        res.regs = int(re.search(r"REG:(\d+)", usage).group(1))
        res.stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        res.spills = len(re.findall(r"\bSTL(?:\.\w+)*\b", sass))
        res.extra["wgmma"] = len(re.findall(r"\b[HQ]GMMA\b", sass))
        # one float32 value cast into both bytes of a 16-bit half, the word's other half taken
        # from a register (not RZ): what ptxas 12.8 made of an fp8 constant splat, the other
        # half never written (stop 40, benchmarks/NOTES.md)
        res.extra["f2fp_splat"] = [m.group(0) for m in re.finditer(
            r"F2FP\S* (R\d+), (R\d+), (R\d+), (R\d+)", sass) if m.group(2) == m.group(3)]
        res.extra["e4m3_one_words"] = sass.count("0x38383838")
        res.extra["mma"] = len(re.findall(r"\bHMMA\b", sass))
        res.extra["key_loops"], res.extra["key_loop_spills"] = key_loop_spills(sass)
        # named-barrier rendezvous (gluon_sync removes those before mbarrier arrives and waits)
        res.extra["bar_sync"] = len(re.findall(r"\bBAR\.SYNC", sass))
        res.extra["key_loop_bar_sync"] = sum(
            bool(re.search(r"\bBAR\.SYNC", t)) for t in key_loop_instructions(sass)[1])
        res.extra["barriers_removed"] = getattr(k.metadata, "mla_plugins_barriers_removed", 0)
        warps = spec.total_warps or spec.options["num_warps"]
        res.occupancy = _cuda_occupancy(res.regs, warps * 32, res.shared)
    return res


def key_loop_spills(sass: str) -> tuple[int, list[str]]:
    """(key loops found, local loads and stores inside them) of an nvdisasm listing: a key
    loop is an innermost loop that issues tensor-core products (HGMMA/QGMMA), a loop a
    backward branch from the function's body (the out-of-line mbarrier retry stubs after its
    last EXIT branch back without looping, so they are left out)."""
    loops, body = key_loop_instructions(sass)
    return loops, [t for t in body if re.search(r"\b(STL|LDL)\b", t)]


def key_loop_instructions(sass: str) -> tuple[int, list[str]]:
    """(key loops found, the instructions inside them) of an nvdisasm listing (key loops as
    `key_loop_spills` finds them)."""
    insts, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            a = int(m.group(1), 16)
            labels.update((label, a) for label in pending)
            pending = []
            insts.append((a, m.group(2)))
    exits = [a for a, t in insts if re.search(r"\bEXIT\b", t)]
    body_end = max(exits) if exits else (insts[-1][0] if insts else 0)
    loops = [(labels[m.group(1)], a) for a, t in insts if a <= body_end
             for m in [re.search(r"\bBRA\s+`\((\.L_x_\d+)\)", t)]
             if m and labels.get(m.group(1), a + 1) <= a]
    mma = [(lo, hi) for lo, hi in loops
           if any(lo <= a <= hi and re.search(r"\b[HQ]GMMA\b", t) for a, t in insts)]
    inner = [(lo, hi) for lo, hi in mma
             if not any((l2, h2) != (lo, hi) and lo <= l2 and h2 <= hi for l2, h2 in mma)]
    return len(inner), [t for a, t in insts if any(lo <= a <= hi for lo, hi in inner)]


def table(results: list[Result]) -> str:
    rows = ["| arch | kernel | regs (CUDA) / VGPRs (AMD) | spills | stack/scratch B | SGPR spills | "
            "shared B | occupancy |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.spec.arch} | {r.spec.name} | {r.regs} | {r.spills} | {r.stack} | "
                    f"{r.sgpr_spills if r.spec.arch != 'sm_90' else '-'} | {r.shared} | {r.occupancy} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import concurrent.futures as cf
    import sys

    specs = all_specs(tuple(sys.argv[1:]) or tuple(TARGETS))
    with cf.ThreadPoolExecutor(max_workers=int(os.environ.get("JOBS", "2"))) as pool:
        print(table(list(pool.map(compile_spec, specs))))
