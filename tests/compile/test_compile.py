"""Every Triton kernel, in every configuration the host code launches, compiles for sm_90,
gfx942 (fp8e4b8) and gfx950 (fp8e4nv) on this CPU, and none spills registers to memory.

Runs without TRITON_INTERPRET (the interpreter bypasses the compiler); `nox -s triton` runs
it in its own pytest invocation. The table of figures: `python -m tests.compile.aot`.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiles for real targets: run without TRITON_INTERPRET"),
]
aot = pytest.importorskip("tests.compile.aot", reason="needs triton")

SPECS = aot.all_specs()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.arch}-{s.name}".replace(" ", "_"))
def test_compiles_without_spills(spec):
    res = aot.compile_spec(spec)
    assert res.regs, f"{spec.name} on {spec.arch}: no register count found in the compiler output"
    if spec.fn.__name__ == "mla_prefill_gluon_kernel" and spec.arch == "sm_90":
        # the Gluon attention at 240 registers a consumer thread: ptxas may park a value of the
        # kernel's shared prologue (the sign-extended high word of an int32 stride) in local
        # memory and reload it once a unit, in the epilogue (the 16-bit 128-key default, stop
        # 43: one 4-byte word; with q loaded by the consumers, three; benchmarks/NOTES.md).
        # Nothing may spill inside the key loops, and no more than four words outside them
        assert res.extra["key_loops"] >= 2, (
            f"{spec.name}: {res.extra['key_loops']} key loops found in its SASS (two consumer "
            "partitions expected): the listing's format changed, key_loop_spills sees nothing")
        assert not res.extra["key_loop_spills"], (
            f"{spec.name} spills inside its key loops: {res.extra['key_loop_spills'][:4]}")
        # Triton's membar pass puts a warpgroup barrier before each mbarrier arrive and wait in
        # the key loops; lean_sync (gluon_sync) removes exactly those. With q stored by the
        # consumers' threads (no q_tma) one a warpgroup stays, before each block's first
        # product: it orders those stores before the tensor cores read q
        if spec.name.endswith(" lean"):
            kept = 0 if " q_tma" in spec.name else 2
            assert res.extra["barriers_removed"] and res.extra["key_loop_bar_sync"] == kept, (
                f"{spec.name}: {res.extra['barriers_removed']} barriers removed from its PTX, "
                f"{res.extra['key_loop_bar_sync']} BAR.SYNC left in its key loops ({kept} "
                "expected)")
        else:
            assert res.extra["key_loop_bar_sync"] and not res.extra["barriers_removed"], (
                f"{spec.name}: no BAR.SYNC in its key loops, or its PTX rewritten: Triton's "
                "lowering changed, gluon_sync's premise (benchmarks/NOTES.md, stop 44) no "
                "longer holds")
        assert res.stack <= 16, (
            f"{spec.name} spills {res.spills} STL, {res.stack} bytes of stack at {res.regs} "
            "registers (16 allowed outside the key loops: prologue words reloaded once a unit)")
    else:
        assert not res.spilled, (
            f"{spec.name} on {spec.arch} spills: {res.spills} spill instructions, {res.stack} "
            f"bytes of stack/scratch at {res.regs} registers; choose another configuration in "
            "triton_attention.ARCH_CONFIGS (or the kernel's launch) for this arch"
        )
    rotating = "rotate" in spec.name and "bound" not in spec.name
    mma_sync = rotating and ("kron" in spec.name or "gluon" in spec.name)
    if spec.arch == "sm_90" and (spec.gluon or rotating) and not mma_sync:
        # the Gluon attention's products, and the dense rotation of q and k, on the tensor cores
        assert res.extra["wgmma"], f"{spec.name}: no wgmma (HGMMA/QGMMA) in its SASS"
    if spec.arch == "sm_90":
        assert not res.extra["f2fp_splat"], (
            f"{spec.name}: {res.extra['f2fp_splat'][:2]}: one value cast into both bytes of a "
            "half word whose other half comes from a register; ptxas 12.8 emits this for an "
            "fp8 constant splat with that register never written: build fp8 constants from "
            "their bit pattern (gluon_attention._fill_ones)")
    if spec.arch == "sm_90" and "sum_mma" in spec.name:
        # the ones buffer of the row sums' products: whole words of e4m3 1.0 (0x38)
        assert res.extra["e4m3_one_words"], f"{spec.name}: no 0x38383838 word in its SASS"
    if spec.arch == "sm_90" and mma_sync:
        # the Kronecker rotation's 16 x 16 products (the Triton kron cast's batched ones, the
        # Gluon cast's mma v2): mma.sync on the tensor cores
        assert res.extra["mma"], f"{spec.name}: no HMMA in its SASS"


GLUON_CASTS = [s for s in SPECS if s.fn.__name__ == "_gluon_cast_kernel"]


@pytest.mark.parametrize("spec", GLUON_CASTS, ids=lambda s: f"{s.arch}-{s.name}".replace(" ", "_"))
def test_gluon_cast_keeps_values_in_registers(spec):
    """The Gluon rotated cast (gluon_rotate) moves no value through shared memory and waits at
    no barrier: no BAR, LDS or STS anywhere in its SASS (its layouts' conversions are
    renamings of registers, asserted trivial at compile time, but for the paired stores' one
    shuffle a group between lanes), and stage 1 is its 12 products
    per step, 12 HMMA per n8 tile of rows a warp holds (ROWS_PER_WARP / 8)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs,
                         attrs=spec.attrs)
    k = triton.compile(src, target=aot.TARGETS[spec.arch], options=spec.options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([aot._tool("nvdisasm"), f.name], capture_output=True, text=True,
                              check=True).stdout
    for op in ("BAR", "LDS", "STS"):
        found = re.findall(rf"\b{op}(?:\.\w+)*\b", sass)
        assert not found, f"{spec.name}: {len(found)} {op} in its SASS"
    # paired stores: one shuffle per output group (12) in each of the fast and the clamped
    # casts of q/k, none otherwise
    paired = spec.constexprs[(spec.fn.arg_names.index("PAIRED"),)]
    shfl = len(re.findall(r"\bSHFL(?:\.\w+)*\b", sass))
    assert shfl == (24 if paired else 0), f"{spec.name}: {shfl} SHFL (paired stores: {paired})"
    assert k.metadata.shared == 0, f"{spec.name}: {k.metadata.shared} bytes of shared memory"
    per_warp = spec.constexprs[(spec.fn.arg_names.index("ROWS_PER_WARP"),)]
    hmma = len(re.findall(r"\bHMMA\b", sass))
    assert hmma == 12 * per_warp // 8, f"{spec.name}: {hmma} HMMA, expected {12 * per_warp // 8}"


@pytest.mark.parametrize("arch", list(aot.TARGETS))
def test_one_variant_per_model(arch):
    """Batches of one model launch the kernels Triton already compiled for the first batch:
    nothing that follows the batch (lengths, tile counts, scale rows) is specialized on, so
    serving never stops mid-traffic for a JIT compile. The one choice that follows the grid's
    size (the dense rotation's q/k/v blocks a program, `triton_quant.rotated_qkv_blocks`) has
    two variants, both recorded (scenarios with and without fill_gpu), and no batch adds one."""
    first = {s.key(): s.name for s in aot.arch_specs(arch)}
    other = {s.key(): s.name for s in aot.arch_specs(arch, batch=aot.OTHER_BATCH)}
    assert other.keys() <= first.keys(), (
        f"{arch}: the second batch compiles {sorted(set(other.values()) - set(first.values()))} "
        f"anew (keys only it has: {sorted(set(other) - set(first))})"
    )
    assert len(first) - len(other) <= 1, (
        f"{arch}: the first batch compiles more than the grid-sized q/k/v variant beyond the "
        f"second's: {sorted(set(first.values()) - set(other.values()))}"
    )


def test_every_kernel_is_covered():
    """Every @triton.jit / @gluon.jit function of the kernel modules that no other one calls
    (a kernel, not a helper) is launched by the host code recorded here, so compiled above."""
    import re

    from mla_plugins.core.kernels import (
        gluon_attention,
        gluon_rotate,
        triton_attention,
        triton_heads,
        triton_quant,
        triton_reduce,
    )

    launched = {s.fn.__name__ for s in SPECS}
    jit = {name: obj for mod in (triton_attention, triton_quant, triton_reduce, gluon_attention,
                                 triton_heads, gluon_rotate)
           for name, obj in vars(mod).items()
           if type(obj).__name__ in ("JITFunction", "GluonJITFunction")}
    sources = {name: fn.src for name, fn in jit.items()}
    for name in jit:
        called = any(re.search(rf"\b{re.escape(name)}\b", src) for other, src in sources.items()
                     if other != name)
        assert called or name in launched, f"{name} is a kernel no recorded launch compiles"
    assert {"mla_prefill_kernel", "mla_prefill_gluon_kernel", "_quant_qkv_kernel",
            "_reduce_kernel", "_head_bound_kernel", "_head_cast_kernel",
            "_gluon_cast_kernel"} <= launched


@pytest.mark.parametrize("arch", list(aot.TARGETS))
def test_v_key_order_follows_the_arch(arch):
    """The fp8 launches recorded for an arch take its vt8 key order (triton_quant.permuted_v):
    permuted on CUDA, natural on ROCm, the quantization and the attention alike."""
    import mla_plugins.core.kernels.triton_kernel as tk

    calls = aot.record(arch, True, tk.default_config(torch.device("cpu"), True))
    orders = {fn.__name__: kwargs.get("PERMUTED", kwargs.get("V_PERM")) for fn, _, kwargs in calls
              if fn.__name__ in ("_quant_qkv_kernel", "mla_prefill_kernel")}
    want = arch.startswith("sm_")
    assert orders == {"_quant_qkv_kernel": want, "mla_prefill_kernel": want}, orders


@pytest.mark.parametrize("warps", [None, 4])
def test_dense_and_gluon_casts_share_pass_one(warps, monkeypatch):
    """The Gluon cast takes its descales from pass 1's partials as the dense cast does (the GPU
    tests hold them equal bit for bit; a row's float32 l1 sum is ordered by the warps): on sm_90
    both launch pass 1 at triton_heads.BOUND_WARPS_ROTATED, which neither cast's own warps
    change."""
    from mla_plugins.core.kernels import triton_heads as th

    if warps is not None:
        monkeypatch.setattr(th, "BOUND_WARPS_ROTATED", warps)

    def launches(rotation):
        calls = aot.record_heads("sm_90", rotate=True, rotation=rotation)
        bound = [kw["num_warps"] for fn, _, kw in calls if fn is th._head_bound_kernel]
        cast = [kw["num_warps"] for fn, _, kw in calls if fn is not th._head_bound_kernel]
        return bound, cast

    (dense, dense_cast), (glu, glu_cast) = launches("dense"), launches("gluon")
    assert dense == glu == [th.BOUND_WARPS_ROTATED], (dense, glu)
    assert dense_cast == [th.WARPS_ROTATED] and glu_cast, (dense_cast, glu_cast)


def test_key_loop_spills_reads_loops_and_skips_retry_stubs():
    """`aot.key_loop_spills` on a listing shaped like nvdisasm's: a local load inside an
    innermost loop that issues HGMMA counts; one before the loop, and the mbarrier retry stub
    after EXIT that branches back into the body, do not."""
    sass = """
        /*0000*/                   LDL R1, [R1] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   LDL R2, [R1+0x4] ;
        /*0030*/              @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   STG.E desc[UR4][R2.64], R3 ;
        /*0050*/                   EXIT ;
.L_x_3:
        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;
        /*0070*/                   LDL R5, [R1+0x8] ;
        /*0080*/                   BRA `(.L_x_1) ;
"""
    loops, spills = aot.key_loop_spills(sass)
    assert loops == 1
    assert spills == ["LDL R2, [R1+0x4] ;"]
    assert aot.key_loop_spills(sass.replace("HGMMA.64x128x16.F32.BF16", "FFMA"))[0] == 0
