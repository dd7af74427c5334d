"""Ahead-of-time compilation of every Triton kernel for sm_90, gfx942 and gfx950, on a CPU.

`triton.compile(ASTSource(...), target=GPUTarget(...))` runs the whole backend (ttgir, llir,
then ptxas or the AMDGPU backend) without a GPU. Resource figures come from what it emits:
- CUDA: `cuobjdump --dump-resource-usage` on the cubin (REG, STACK) and `nvdisasm`'s count
  of local-memory stores (STL): a spill is a nonzero stack or any STL;
- AMD: the `.vgpr_count`, `.vgpr_spill_count`, `.sgpr_spill_count`, `ScratchSize` and
  `Occupancy` lines of the amdgcn text: a spill is a nonzero VGPR spill count or scratch
  (SGPR spills go to VGPR lanes, not memory, and are reported but allowed).

`python -m tests.compile.aot` prints the table recorded in benchmarks/NOTES.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_plugins.core.kernels import triton_attention as ta
from mla_plugins.core.kernels import triton_quant as tq
from mla_plugins.core.kernels import triton_reduce as tr

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}
#: fp8 format each arch computes in (core/device.py's fp8_dtype_for)
FP8 = {"sm_90": ("fp8e4nv", tl.float8e4nv, 448.0), "gfx942": ("fp8e4b8", tl.float8e4b8, 240.0),
       "gfx950": ("fp8e4nv", tl.float8e4nv, 448.0)}


@dataclass
class Spec:
    """One kernel in one configuration the host code can launch on `arch`."""

    name: str
    arch: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int = 2
    notes: str = ""
    #: `ASTSource` attrs: argument index -> [["tt.divisibility", 16]] (what a launch specializes)
    attrs: dict | None = None
    gluon: bool = False
    maxnreg: int | None = None
    #: warps a CTA holds when warp-specialized partitions add their own (in warpgroups of 4)
    total_warps: int | None = None


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


def _sig(fn, types: dict, default: str) -> dict:
    return {n: types.get(n, "constexpr" if p.is_constexpr else default)
            for n, p in zip(fn.arg_names, fn.params, strict=True)}


def _ints(*names):
    return dict.fromkeys(names, "i32")


def attention_specs(arch: str) -> list[Spec]:
    fn = ta.mla_prefill_kernel
    fp8_name, fp8_tl, fp8_max = FP8[arch]
    cuda = arch.startswith("sm_")
    family = "cuda" if cuda else arch
    specs = []
    for fp8 in (True, False):
        bm, bn, warps, stages = ta.arch_config(family, fp8)
        # TMA only on CUDA sm_90+; bf16 falls back to pointer loads for strided views
        tma_modes = ([True, False] if not fp8 else [True]) if cuda else [False]
        for tma in tma_modes:
            kt = fp8_name if fp8 else "bf16"
            types = {
                "WorkInfo": "*i32", "Out": "*bf16", "Q": "*bf16", "Lse": "*fp32", "PartO": "*fp32",
                "PartLse": "*fp32", "Scales": "*fp32", "Amax": "*fp32", "qk_scale": "fp32",
                **_ints("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "vt_stride", "so_t", "so_h",
                        "sl_t", "sl_h", "spo_t", "spo_h", "spl_t", "spl_h", "ss_w", "num_sub",
                        "causal", "has_lse"),
            }
            if tma:
                types["K"] = f"tensordesc<{kt}[{bn}, 128]>"
                types["Kr"] = f"tensordesc<{kt}[{bn}, 64]>"
                types["V"] = f"tensordesc<{kt}[128, {bn}]>" if fp8 else f"tensordesc<{kt}[{bn}, 128]>"
            else:
                types["K"] = types["Kr"] = types["V"] = f"*{kt}"
            const = {"FP8": fp8, "FP8_MAX": fp8_max, "KV_DTYPE": fp8_tl if fp8 else None,
                     "P_SHIFT": 8.0 if fp8 else 0.0, "USE_TMA": tma, "V_TMA": tma,
                     "WARP_SPEC": False, "BLOCK_M": bm, "BLOCK_N": bn}
            const = {k: v for k, v in const.items() if k in fn.arg_names}
            specs.append(Spec(
                f"attention {'fp8' if fp8 else 'bf16'} {bm}x{bn} w{warps} s{stages}"
                + (" tma" if tma else ""), arch, fn, _sig(fn, types, "*bf16"), const, warps, stages))
    return specs


def quant_specs(arch: str) -> list[Spec]:
    fp8_name, _, fp8_max = FP8[arch]
    specs = []
    # pointer arguments of each quantization kernel (the rest are i32 or constexpr)
    for name, ptrs, const, divisible in tq.COMPILE_SPECS:
        fn = getattr(tq, name)
        types = {n: t.replace("FP8", fp8_name) for n, t in ptrs.items()}
        const = {k: (fp8_max if v == "FP8_MAX" else v) for k, v in const.items()}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        specs.append(Spec(name.strip("_").replace("_kernel", ""), arch, fn, _sig(fn, types, "i32"),
                          const, tq.NUM_WARPS, attrs=attrs))
    return specs


def gluon_specs(arch: str) -> list[Spec]:
    """The Gluon fp8 kernel (Hopper only: wgmma and TMA), at every ring depth the host takes."""
    if arch != "sm_90":
        return []
    from triton.experimental.gluon import language as gl

    from mla_plugins.core.kernels import gluon_attention as ga
    from mla_plugins.core.kernels.triton_kernel import GLUON_FP8_CONFIG

    fn, bn = ga.mla_prefill_fp8_kernel, GLUON_FP8_CONFIG.block_n
    f8 = gl.float8e4nv
    lay = {n: gl.NVMMASharedLayout.get_default_for(s, f8)
           for n, s in (("KN", [bn, 128]), ("KR", [bn, 64]), ("VT", [128, bn]))}
    types = {"Q": "*bf16", "Out": "*bf16", "Lse": "*fp32", "PartO": "*fp32", "PartLse": "*fp32",
             "WorkInfo": "*i32", "Scales": "*fp32", "qk_scale": "fp32",
             "KN": f"tensordesc<fp8e4nv[{bn}, 128],{lay['KN']!r}>",
             "KR": f"tensordesc<fp8e4nv[{bn}, 64],{lay['KR']!r}>",
             "VT": f"tensordesc<fp8e4nv[128, {bn}],{lay['VT']!r}>"}
    specs = []
    cfg = GLUON_FP8_CONFIG
    # the default, then the variants a TileConfig can ask for (benchmarks/prefill.py --variants)
    variants = [(cfg.num_stages, cfg.pingpong, cfg.persistent), (4, False, False),
                (3, True, False), (3, False, True)]
    for stages, pingpong, persistent in variants:
        const = {"FP8_MAX": 448.0, "KV_DTYPE": f8, "P_SHIFT": 8.0, "BLOCK_M": cfg.block_m,
                 "BLOCK_N": bn, "NUM_STAGES": stages, "CONSUMER_REGS": ga.CONSUMER_REGS,
                 "PRODUCER_REGS": ga.PRODUCER_REGS, "PINGPONG": pingpong, "PERSISTENT": persistent}
        name = (f"gluon attention fp8 {cfg.block_m}x{bn} s{stages} ws"
                + (" pingpong" if pingpong else "") + (" persistent" if persistent else ""))
        specs.append(Spec(name, arch, fn, _sig(fn, types, "i32"), const, ga.NUM_WARPS, gluon=True,
                          maxnreg=ga.MAXNREG, total_warps=ga.TOTAL_WARPS))
    return specs


def reduce_specs(arch: str) -> list[Spec]:
    fn = tr._reduce_kernel
    types = {"PartO": "*fp32", "PartLse": "*fp32", "Indptr": "*i32", "FinalMap": "*i32",
             "PartialMap": "*i32", "Out": "*bf16", "FinalLse": "*fp32"}
    specs = []
    for final_map in (True, False):
        const = {"HAS_FINAL_MAP": final_map, "HAS_FINAL_LSE": True, "DV": 128, "BLOCK_E": 16}
        specs.append(Spec(f"reduce final_map={int(final_map)}", arch, fn, _sig(fn, types, "i32"),
                          const, 4))
    return specs


def all_specs(archs=tuple(TARGETS)) -> list[Spec]:
    return [s for a in archs
            for s in attention_specs(a) + quant_specs(a) + reduce_specs(a) + gluon_specs(a)]


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


def compile_spec(spec: Spec) -> Result:
    if spec.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    src = source(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=spec.attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.maxnreg:
        options["maxnreg"] = spec.maxnreg
    k = triton.compile(src, target=TARGETS[spec.arch], options=options)
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
        res.occupancy = _cuda_occupancy(res.regs, (spec.total_warps or spec.num_warps) * 32,
                                        res.shared)
    return res


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
