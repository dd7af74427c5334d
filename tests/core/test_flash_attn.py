"""The FlashAttention-3 provider (kernel "flash_attn") against fake FA3 builds, on the CPU.

No Hopper GPU here. tests/fakes/fa3 holds the four FA3 builds the provider looks for, as the
module structure it imports, each registering its forward op with the schema copied verbatim
from the real build and a CPU body computing what FA3's mha_fwd computes (its checks and
messages, its edge values, its math in float64): fa3-fwd 0.0.3, FA3's own hopper/ build,
sglang-kernel 0.4.10, and vLLM 0.32's vllm_flash_attn (the real Python, a stand-in vllm
package around it; the real vLLM is tested in tests/vllm/test_flash_attn_vllm.py).

What the real kernel adds and these tests cannot see (tests/gpu/test_flash_attn_gpu.py on an
H200 does): CUDA and Hopper only, tile scheduling, float32 accumulation and fp8 P in the PV
product, the Triton quantization the provider uses on a GPU (here: core/fp8.py's
head_quantize, the torch statement of the same rule), CUDA-graph capture, no device sync.

The provider is Hopper-only for real: runs here monkeypatch `FlashAttnKernel.devices` to
include "cpu" and `device_reasons` to answer [].
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import mla_plugins
from mla_plugins.core.kernels import flash_attn
from mla_plugins.core.kernels.flash_attn import FlashAttnKernel
from mla_plugins.core.reference import reference_attention, relative_error
from tests.fakes import fa3
from tests.fakes.fa3 import kernel as fake
from tests.fakes.fa3 import schemas
from tests.fakes.fa3.harness import (
    NAMESPACE,
    NEG_INF,
    PLAIN,
    POSITIONS,
    SCHEMA,
    batch,
    by_name,
    check,
    compare_with_vllm_call,
    run,
    schema_has_defaults,
    schema_names,
    usable,
)

E4M3 = torch.float8_e4m3fn

# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def builds(monkeypatch):
    """`builds("fa3_fwd", ...)`: put those fake builds on sys.path (and import the framework
    package of "vllm" / "sgl_kernel", which the provider's gates need), forget the provider's
    bindings. Afterwards: fake ops destroyed, their modules forgotten, sys.path restored."""
    def use(*names, import_framework=True, capability=None):
        for name in names:
            monkeypatch.syspath_prepend(fa3.site(name))
        if import_framework and "vllm" in names:
            import vllm.platforms

            monkeypatch.setattr(vllm.platforms, "CAPABILITY", capability)
        if import_framework and "sgl_kernel" in names:
            import sgl_kernel  # noqa: F401
        flash_attn.reset()

    before = set(sys.modules)
    flash_attn.reset()
    yield use
    fa3.cleanup()
    leaked = [m for m in set(sys.modules) - before
              if m.split(".")[0] in ("vllm", "sgl_kernel", "fa3_fwd", "fa3_fwd_interface",
                                     "flash_attn_3", "flash_attn_interface")]
    for m in leaked:
        del sys.modules[m]
    flash_attn.reset()


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the Hopper-only provider run on the CPU (where the fakes run)."""
    monkeypatch.setattr(FlashAttnKernel, "devices", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(FlashAttnKernel, "device_reasons", lambda self, device: [])


#: every edge at once: a normal sequence, q_len 0, k_len 0 with q_len > 0, a cached prefix
#: (k > q), rows that see no key (k < q, bottom-right causal), one row
LENS = [(5, 5), (0, 7), (4, 0), (3, 9), (6, 2), (1, 1)]


# -- binding: one per build, by its real schema -----------------------------------------


@pytest.mark.parametrize("name", ["fa3_fwd", "flash_attn_3", "sgl_kernel", "vllm"])
def test_binds_each_build_by_its_schema(builds, name):
    builds(name, capability=(9, 0))
    b = usable(name)
    names = schema_names(SCHEMA[name])
    assert b.schema.startswith(f"{NAMESPACE[name]}::fwd("), b.schema
    # num_splits sits where each build's schema puts it (FA3 has attention_chunk before it)
    assert b.positions.get("num_splits") == names.index("num_splits"), (name, b.positions)
    fixed = {k: v for k, v in b.positions.items() if k != "num_splits"}
    assert fixed == POSITIONS, f"{name}: slot positions {fixed}, expected {POSITIONS}"
    for slot, i in POSITIONS.items():
        assert names[i] == slot, f"{name}: schema argument {i} is {names[i]!r}, not {slot!r}"
    # a value for every argument, so a schema without defaults (vLLM, sgl_kernel) is called whole
    assert len(b.template) == len(names), (
        f"{name}: template has {len(b.template)} values for {len(names)} schema arguments")
    slots = set(POSITIONS.values()) | {names.index("num_splits")}
    for i, (arg, value) in enumerate(zip(names, b.template, strict=True)):
        if i in slots:
            continue
        allowed = PLAIN.get(arg, {None})
        assert value in allowed and type(value) in {type(a) for a in allowed}, (
            f"{name}: argument {i} {arg!r} gets {value!r}, expected one of {allowed} "
            "(a plain varlen forward)")


def test_sgl_kernel_arguments_without_defaults_are_passed(builds):
    builds("sgl_kernel")
    b = usable("sgl_kernel")
    names = schema_names(schemas.SGL_KERNEL_0_4_10)
    assert not any(schema_has_defaults(schemas.SGL_KERNEL_0_4_10)), "sgl_kernel's fwd has no defaults"
    tail = dict(zip(names[-3:], b.template[-3:], strict=True))
    assert tail == {"sinks": None, "sparse_mask_fine": None, "only_qv": False}, tail


def test_vllm_arguments_without_defaults_are_passed(builds):
    builds("vllm", capability=(9, 0))
    b = usable("vllm")
    names = schema_names(schemas.VLLM_FA3)
    tail = dict(zip(names[-4:], b.template[-4:], strict=True))
    assert tail == {"s_aux": None, "cp_world_size": 1, "cp_rank": 0, "cp_tot_seqused_k": None}, tail
    assert "attention_chunk" not in names  # vLLM's fork has none: bound by name, not position


def test_order_framework_builds_first_when_imported(builds):
    builds("fa3_fwd", "flash_attn_3", "sgl_kernel", import_framework=False)
    assert usable("flash_attn_3").name == "flash_attn_3"  # sgl_kernel not imported: passed over
    assert by_name("sgl_kernel").reasons == [
        "sgl_kernel or sglang not imported in this process (its FA3 is used inside that "
        "framework's own processes; mla-plugins never imports a framework to find it)"]
    import sgl_kernel  # noqa: F401  a framework imported after the first look

    assert usable("sgl_kernel").name == "sgl_kernel", "an sgl_kernel imported later is looked at again"


def test_lse_is_the_second_result_in_fa3_layout(builds):
    builds("fa3_fwd")
    b = usable("fa3_fwd")
    q, k, v, cq, ck = batch([(3, 4), (2, 2)], 2, seed=1)
    out = torch.empty(q.shape[0], 2, 128, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
    lse = flash_attn._call(b, q, k, v, out, cu_q, cu_k, 3, 4, None, 0.1, True)
    full = torch.ops.fa3_fwd.fwd.default(q, k, v, None, None, None, None, cu_q, cu_k, None, None,
                                        None, 3, 4, softmax_scale=0.1, is_causal=True)
    assert lse.shape == (2, q.shape[0]) and lse.dtype == torch.float32, "FA3's lse is [H, total_q] fp32"
    torch.testing.assert_close(lse, full[1], rtol=0, atol=0)
    torch.testing.assert_close(out, full[0], rtol=0, atol=0)


# -- capability reasons from the build ---------------------------------------------------


def test_fa3_fwd_build_flags(builds, on_cpu):
    """fa3-fwd 0.0.3 is built with FLASHATTENTION_DISABLE_FP16 (its fa3_fwd_config.CONFIG)."""
    builds("fa3_fwd")
    b = usable("fa3_fwd")
    assert b.build_flags["FLASHATTENTION_DISABLE_FP16"] is True
    assert b.supports_fp8 and not b.supports_fp16
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="has fp16 disabled"):
        mla_plugins.plan_prefill([0, 4], [0, 4], num_heads=2, device="cpu", dtype=torch.float16,
                                 fp8=False, kernel="flash_attn")
    # and the build itself refuses fp16 as the real one does
    q, k, v, cq, ck = batch([(4, 4)], 2, dtype=torch.float16, seed=2)
    with pytest.raises(RuntimeError, match=re.escape("This flash attention build does not support FP16.")):
        torch.ops.fa3_fwd.fwd(q, k, v, cu_seqlens_q=torch.tensor(cq, dtype=torch.int32),
                              cu_seqlens_k=torch.tensor(ck, dtype=torch.int32), max_seqlen_q=4,
                              max_seqlen_k=4)


def test_flash_attn_3_default_build_reasons(builds, on_cpu):
    builds("flash_attn_3")
    b = usable("flash_attn_3")
    assert b.supports_fp8 and b.supports_fp16
    assert b.head_dims_reason(192, 128) is None
    assert b.head_dims_reason(128, 128) is None
    assert "head dims 192/64" in b.head_dims_reason(192, 64)
    assert "head dims 264/264" in b.head_dims_reason(264, 264)
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="needs bf16 inputs"):
        mla_plugins.plan_prefill([0, 4], [0, 4], num_heads=2, device="cpu", dtype=torch.float16,
                                 fp8=True, kernel="flash_attn")
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="192/128 heads only"):
        mla_plugins.plan_prefill([0, 4], [0, 4], num_heads=2, device="cpu", fp8=True,
                                 head_dim_qk=128, head_dim_v=128, kernel="flash_attn")


def test_build_flags_disable_fp8_and_hdimdiff(builds, monkeypatch):
    builds("flash_attn_3")
    import flash_attn_config

    flags = dict(flash_attn_config.CONFIG["build_flags"], FLASHATTENTION_DISABLE_FP8=True,
                 FLASH_ATTENTION_DISABLE_HDIMDIFF192=True)
    monkeypatch.setitem(flash_attn_config.CONFIG, "build_flags", flags)
    flash_attn.reset()
    b = usable("flash_attn_3")
    assert not b.supports_fp8
    assert "192/128 head-dim kernels disabled" in b.head_dims_reason(192, 128)


def test_not_installed(builds):
    builds()
    assert flash_attn.binding() is None
    assert by_name("fa3_fwd").reasons == ["not installed"]
    assert by_name("flash_attn_3").reasons == ["not installed"]
    (why,) = FlashAttnKernel().environment_reasons()
    assert why.startswith("no FlashAttention-3 found (") and "fa3_fwd: not installed" in why, why


def test_import_raising(builds, tmp_path, monkeypatch):
    """An extension that does not load (a torch ABI mismatch) is a reason, not a crash."""
    (tmp_path / "fa3_fwd_interface.py").write_text(
        "raise ImportError('/site-packages/fa3_fwd/_C.abi3.so: undefined symbol: "
        "_ZN3c106detail23torchInternalAssertFailEPKcS2_jS2_RKSs')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    builds()
    (reason,) = by_name("fa3_fwd").reasons
    assert reason.startswith("import failed (ImportError: ") and "undefined symbol" in reason, reason
    assert flash_attn.binding() is None


def test_unknown_schema_is_refused_with_the_schema(builds, on_cpu):
    builds("unknown")
    b = by_name("fa3_fwd")
    assert not b.usable and flash_attn.binding() is None
    (reason,) = b.reasons
    assert "unknown FA3 forward schema" in reason and "num_kv_splits" in reason, reason
    assert "fa3_fwd::fwd(Tensor q, Tensor k, Tensor v, int num_kv_splits" in reason, reason
    with pytest.raises(mla_plugins.KernelNotSupportedError, match="num_kv_splits"):
        mla_plugins.plan_prefill([0, 4], [0, 4], num_heads=2, device="cpu", fp8=False,
                                 kernel="flash_attn")


def test_vllm_gate_not_imported(builds):
    builds("vllm", import_framework=False)
    assert "vllm" not in sys.modules
    assert by_name("vllm").reasons == [
        "vllm not imported in this process (its FA3 is used inside that framework's own "
        "processes; mla-plugins never imports a framework to find it)"]
    assert "vllm" not in sys.modules, "the provider must not import vLLM to look for its FA3"


def test_vllm_cpu_platform_reason_verbatim(builds):
    """vLLM 0.32's own answer on a platform without compute capability 9.x, word for word."""
    builds("vllm", capability=None)
    from vllm.vllm_flash_attn import fa_version_unsupported_reason

    assert fa_version_unsupported_reason(3) == "FA3 is only supported on devices with compute capability 9.x"
    assert by_name("vllm").reasons == [
        "vLLM says FA3 is unsupported: FA3 is only supported on devices with compute capability 9.x"]


# -- runs through the public API against float64 ----------------------------------------


@pytest.mark.parametrize("name", ["fa3_fwd", "flash_attn_3", "sgl_kernel", "vllm"])
def test_bf16_each_build(builds, on_cpu, name):
    builds(name, capability=(9, 0))
    usable(name)
    q, k, v, cq, ck = batch(LENS, 3, seed=10)
    out, lse = run(q, k, v, cq, ck, fp8=False, namespace=NAMESPACE[name])
    ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck))
    check(out, lse, ref_out, ref_lse, 1e-2, f"{name} bf16")


@pytest.mark.parametrize("heads", [1, 3, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_heads_and_masks(builds, on_cpu, heads, causal):
    builds("fa3_fwd")
    q, k, v, cq, ck = batch(LENS, heads, seed=20 + heads + 7 * causal)
    out, lse = run(q, k, v, cq, ck, fp8=False, causal=causal, scale=0.07, namespace="fa3_fwd")
    ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck),
                                           softmax_scale=0.07, causal=causal)
    check(out, lse, ref_out, ref_lse, 1e-2, f"bf16 H={heads} causal={causal}")


def test_fp16_where_the_build_has_it(builds, on_cpu):
    builds("flash_attn_3")
    q, k, v, cq, ck = batch(LENS, 2, dtype=torch.float16, seed=30)
    out, lse = run(q, k, v, cq, ck, fp8=False, namespace="flash_attn_3")
    assert out.dtype == torch.float16
    ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck))
    check(out, lse, ref_out, ref_lse, 5e-3, "fp16")


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_fp8(builds, on_cpu, rotate, heads):
    builds("fa3_fwd")
    q, k, v, cq, ck = batch(LENS, heads, seed=40 + heads + rotate)
    out, lse = run(q, k, v, cq, ck, fp8=True, rotate=rotate, namespace="fa3_fwd")
    assert out.dtype == torch.bfloat16
    cu_q, cu_k = torch.tensor(cq), torch.tensor(ck)
    # against the same quantization in float64: only the bf16 output rounding differs
    ref8_out, ref8_lse = reference_attention(q, k, v, cu_q, cu_k, fp8_dtype=E4M3, fp8_rotate=rotate,
                                             fp8_per_sequence=True)
    check(out, lse, ref8_out, ref8_lse, 5e-3, f"fp8 rotate={rotate} vs quantized float64")
    # against the unquantized inputs
    ref_out, ref_lse = reference_attention(q, k, v, cu_q, cu_k)
    check_fp8 = relative_error(out, ref_out)
    assert check_fp8 <= 6e-2, f"fp8 rotate={rotate}: relative error {check_fp8:.3e} > 6e-2 vs float64"


def test_fp8_call_passes_e4m3_and_per_sequence_descales(builds, on_cpu):
    """What reaches FA3: e4m3 q/k/v, descales [batch, heads] float32 at the schema's
    q_descale/k_descale/v_descale, bf16 out, the plan's offsets and maxima."""
    builds("flash_attn_3")
    lens = [(5, 5), (0, 7), (3, 9)]
    q, k, v, cq, ck = batch(lens, 4, seed=50)
    run(q, k, v, cq, ck, fp8=True, rotate=False, scale=0.05, namespace="flash_attn_3")
    args = fake.CALLS["flash_attn_3"][-1]
    names = schema_names(schemas.FA3_HEAD)
    a = dict(zip(names, args, strict=True))
    assert (a["q"].dtype, a["k"].dtype, a["v"].dtype) == (E4M3, E4M3, E4M3)
    assert a["out"].dtype == torch.bfloat16
    for d in ("q_descale", "k_descale", "v_descale"):
        assert a[d].shape == (3, 4) and a[d].dtype == torch.float32, f"{d}: {a[d].shape} {a[d].dtype}"
        assert torch.isfinite(a[d]).all() and (a[d] > 0).all(), f"{d}: {a[d]}"
    assert a["cu_seqlens_q"].tolist() == cq and a["cu_seqlens_k"].tolist() == ck
    assert a["cu_seqlens_q"].dtype == torch.int32
    assert (a["max_seqlen_q"], a["max_seqlen_k"]) == (5, 9)
    assert a["softmax_scale"] == pytest.approx(0.05) and a["is_causal"] is True
    # the empty sequence's scales are 1; a real sequence's scale is its (head) amax / 448
    assert (a["q_descale"][1] == 1).all()
    amax = v[ck[2]:ck[3]].float().abs().amax(dim=(0, 2))
    torch.testing.assert_close(a["v_descale"][2], amax / 448.0)


def test_edges_and_poisoned_out(builds, on_cpu):
    """Rows that see no key (k_len 0, k < q causal) give 0 and -inf; nothing left NaN."""
    builds("fa3_fwd")
    for fp8 in (False, True):
        q, k, v, cq, ck = batch([(4, 0), (6, 2), (0, 3), (2, 5)], 2, seed=60 + fp8)
        out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=True if fp8 else None, namespace="fa3_fwd")
        rows = [0, 1, 2, 3, 4, 5, 6, 7]  # seq 0 (k_len 0) and seq 1's first 4 rows (k 2 < q 6)
        assert (out[rows] == 0).all() and (lse[rows] == NEG_INF).all(), f"fp8={fp8}: {lse[rows]}"
        assert torch.isfinite(lse[8:]).all() and torch.isfinite(out).all(), f"fp8={fp8}"


@pytest.mark.parametrize("fp8", [False, True])
def test_batches_without_queries_or_keys(builds, on_cpu, fp8):
    """total_k == 0: FA3 itself would write lse +inf (flash_api.cpp 1193); the provider answers
    0 and -inf without calling it. total_q == 0: nothing to write."""
    builds("fa3_fwd")
    usable("fa3_fwd")
    q, k, v, cq, ck = batch([(3, 0), (2, 0)], 2, seed=70)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None)
    assert (out == 0).all() and (lse == NEG_INF).all(), lse
    q, k, v, cq, ck = batch([(0, 3), (0, 2)], 2, seed=71)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None)
    assert out.shape[0] == 0 and lse.shape[0] == 0
    assert fake.CALLS["fa3_fwd"] == [], "nothing to compute: FA3 must not be called"


def test_legacy_plus_inf_lse_becomes_minus_inf(builds, on_cpu):
    """FA3 before 2025-01-07 wrote +inf for rows without a key: the provider maps it to -inf."""
    builds("fa3_fwd")
    import fa3_fwd._C

    fa3_fwd._C.BUILD.legacy_empty_lse = True
    q, k, v, cq, ck = batch([(4, 0), (6, 2), (3, 3)], 2, seed=80)
    # the fake really writes +inf there (so this test can fail)
    raw = torch.ops.fa3_fwd.fwd(q, k, v, cu_seqlens_q=torch.tensor(cq, dtype=torch.int32),
                                cu_seqlens_k=torch.tensor(ck, dtype=torch.int32), max_seqlen_q=6,
                                max_seqlen_k=3, is_causal=True)[1]
    assert (raw[:, :8] == float("inf")).all(), raw[:, :8]
    for fp8 in (False, True):
        out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None, namespace="fa3_fwd")
        ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck))
        if not fp8:
            check(out, lse, ref_out, ref_lse, 1e-2, "legacy FA3")
        assert (lse[:8] == NEG_INF).all(), f"fp8={fp8}: lse {lse[:8]}"
        assert (out[:8] == 0).all()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("poison", ["inf", "nan", "1e30"])
def test_isolation(builds, on_cpu, fp8, where, poison):
    """An inf, a NaN or 1e30 in one sequence leaves every other sequence's out and lse
    bit-identical to that sequence run alone. Sequence 0's last key block (7 keys of 128)
    covers sequence 1's first rows, where the poison sits: FA3's tile reads them
    (tests/fakes/fa3/kernel.py `_tile_reads`, as measured on an H200)."""
    builds("fa3_fwd")
    lens = [(5, 7), (4, 4), (3, 6)]
    q, k, v, cq, ck = batch(lens, 3, seed=90)
    x, start = {"q": (q, cq[1]), "k": (k, ck[1]), "v": (v, ck[1])}[where]
    x[start + 1, 1, 5] = float(poison)
    rotate = True if fp8 else None
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=rotate, namespace="fa3_fwd")
    # FA3's documented limit in bf16 (README, "FlashAttention-3"): it multiplies the zero
    # weights of a sequence's last, partial key tile by the next sequence's first value rows,
    # so a non-finite value there turns that tile's query rows NaN in that head (lse intact);
    # in fp8 the quantization stores it as 0 and it travels in its own sequence's descale
    leaks = not fp8 and where == "v" and poison in ("inf", "nan")
    for b in (0, 2):
        qs, ks, vs = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        alone_out, alone_lse = run(qs, ks, vs, [0, lens[b][0]], [0, lens[b][1]], fp8=fp8,
                                   rotate=rotate, namespace="fa3_fwd")
        if leaks and b == 0:
            got = out[cq[b]:cq[b + 1]]
            same = (got == alone_out) | (got.isnan() & ~alone_out.isnan())
            assert same.all() and not got[:, [0, 2]].isnan().any(), (
                "the bf16 leak reaches beyond the poisoned head of the preceding sequence's tile")
            assert torch.equal(lse[cq[b]:cq[b + 1]], alone_lse)
            continue
        assert torch.equal(out[cq[b]:cq[b + 1]], alone_out), (
            f"sequence {b}'s output changed by {poison} in sequence 1's {where} "
            f"({'fp8' if fp8 else 'bf16'}): {int(out[cq[b]:cq[b + 1]].isnan().sum())} NaN")
        assert torch.equal(lse[cq[b]:cq[b + 1]], alone_lse), (
            f"sequence {b}'s lse changed by {poison} in sequence 1's {where} ({'fp8' if fp8 else 'bf16'})")


@pytest.mark.parametrize("fp8", [False, True])
def test_strided_views_as_vllm_passes_them(builds, on_cpu, fp8):
    """vLLM's prefill hands q as a [nope | rope] concatenation and v as the second half of
    kv_b_proj's [T, H, 256] output: views with unit last stride (what FA3 requires) and head
    strides other than the width."""
    builds("fa3_fwd")
    q, k, v, cq, ck = batch(LENS, 2, seed=150 + fp8)
    wide_v = torch.cat((torch.randn_like(v), v), dim=-1)[..., 128:]
    wide_k = torch.cat((k, torch.randn_like(k)), dim=-1)[..., :192]
    assert wide_v.stride() == (512, 256, 1) and torch.equal(wide_v, v) and torch.equal(wide_k, k)
    out, lse = run(q, wide_k, wide_v, cq, ck, fp8=fp8, rotate=True if fp8 else None,
                   namespace="fa3_fwd")
    ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck),
                                           fp8_dtype=E4M3 if fp8 else None, fp8_rotate=fp8,
                                           fp8_per_sequence=True)
    check(out, lse, ref_out, ref_lse, 5e-3 if fp8 else 1e-2, f"strided views fp8={fp8}")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_lse_is_fa3s_own_tensor_seen_transposed(builds, on_cpu, monkeypatch, fp8):
    """return_lse=True hands back FA3's [H, T] lse as a [T, H] view (no copy: 15-26 µs of host
    per call on the H200), right in value; Kernel.run with a caller's lse buffer still copies
    into it. A copy in the view path (a new tensor) fails the storage check."""
    builds("fa3_fwd")
    q, k, v, cq, ck = batch(LENS, 3, seed=150 + fp8)
    returned = []
    b = flash_attn.binding()
    op = b.op

    def spy(*args):
        result = op(*args)
        returned.append(result[1])
        return result

    monkeypatch.setattr(b, "op", spy)
    out, lse = run(q, k, v, cq, ck, fp8=fp8, rotate=False if fp8 else None)
    assert lse.shape == (q.shape[0], 3) and lse.t().is_contiguous()
    assert lse.data_ptr() == returned[-1].data_ptr(), "lse must be FA3's own tensor, not a copy"
    ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck),
                                           fp8_dtype=E4M3 if fp8 else None, fp8_per_sequence=True)
    check(out, lse, ref_out, ref_lse, 5e-3 if fp8 else 1e-2, f"view lse, fp8={fp8}")
    # the copying path (a caller's buffer), on the same plan
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=3, device="cpu", fp8=fp8, kernel="flash_attn")
    assert mla_plugins.lse_heads_first(plan), "the public flag must say FA3's lse is heads-first"
    inputs = mla_plugins.core.api._prefill_inputs(q, k, v, None, None, None, True, fp8, plan, False)
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full((q.shape[0], 3), float("nan"))
    FlashAttnKernel().run(inputs, plan, out2, lse2)
    assert lse2.is_contiguous() and torch.equal(lse2, lse) and torch.equal(out2, out)


def test_plan_for_either_mode(builds, on_cpu):
    """plan_prefill(fp8=None) plans for both: the same plan runs a bf16 and an fp8 call."""
    builds("fa3_fwd")
    q, k, v, cq, ck = batch(LENS, 2, seed=160)
    plan = mla_plugins.plan_prefill(cq, ck, num_heads=2, device="cpu", kernel="flash_attn")
    cu_q, cu_k = torch.tensor(cq), torch.tensor(ck)
    for fp8 in (False, True, False):
        out = torch.full((q.shape[0], 2, 128), float("nan"), dtype=torch.bfloat16)
        _, lse = mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=fp8,
                                         fp8_rotate=False if fp8 else None, out=out,
                                         return_lse=True)
        ref_out, ref_lse = reference_attention(q, k, v, cu_q, cu_k, fp8_dtype=E4M3 if fp8 else None,
                                               fp8_per_sequence=True)
        check(out, lse, ref_out, ref_lse, 5e-3 if fp8 else 1e-2, f"plan for either mode, fp8={fp8}")


def test_planned_call_repeats(builds, on_cpu):
    """A plan reused by several layers: each call computes its own inputs (fresh values)."""
    builds("fa3_fwd")
    lens = [(5, 5), (3, 9)]
    plan = mla_plugins.plan_prefill([0, 5, 8], [0, 5, 14], num_heads=2, device="cpu", fp8=True,
                                    kernel="flash_attn")
    for layer in range(3):
        q, k, v, cq, ck = batch(lens, 2, seed=110 + layer)
        out = torch.full((8, 2, 128), float("nan"), dtype=torch.bfloat16)
        mla_plugins.mla_prefill(q, k, v, plan=plan, kernel="flash_attn", fp8=True, fp8_rotate=True,
                                out=out)
        ref, _ = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck), fp8_dtype=E4M3,
                                     fp8_rotate=True, fp8_per_sequence=True)
        assert relative_error(out, ref) <= 5e-3, f"layer {layer}"


# -- the fakes themselves: the real checks and messages ---------------------------------


def _raw(q, k, v, cq, ck, **kw):
    args = dict(cu_seqlens_q=torch.tensor(cq, dtype=torch.int32),
                cu_seqlens_k=torch.tensor(ck, dtype=torch.int32),
                max_seqlen_q=max(b - a for a, b in zip(cq, cq[1:], strict=False)),
                max_seqlen_k=max(b - a for a, b in zip(ck, ck[1:], strict=False)))
    args.update(kw)
    return torch.ops.flash_attn_3.fwd(q, k, v, **args)


def test_fake_checks_carry_the_real_messages(builds):
    builds("flash_attn_3")
    import flash_attn_interface  # noqa: F401  registers flash_attn_3::fwd
    q, k, v, cq, ck = batch([(3, 4)], 2, seed=120)
    with pytest.raises(RuntimeError, match="^max_seqlen_q must be provided if cu_seqlens_q is provided$"):
        _raw(q, k, v, cq, ck, max_seqlen_q=None)
    with pytest.raises(RuntimeError, match="^FlashAttention only supports fp16, bf16, and fp8_e4m3 data type$"):
        _raw(q.float(), k.float(), v.float(), cq, ck)
    with pytest.raises(RuntimeError, match="^If V headdim is different from Q/K dim"):
        _raw(q, k, v[..., :64], cq, ck)
    with pytest.raises(RuntimeError, match="^FlashAttention forward only supports head dimension at most 256$"):
        big = torch.randn(3, 2, 264).to(torch.bfloat16)
        _raw(big, torch.randn(4, 2, 264).to(torch.bfloat16), torch.randn(4, 2, 264).to(torch.bfloat16), cq, ck)
    with pytest.raises(RuntimeError, match=re.escape("For FP16/BF16 input, output must have the same dtype")):
        _raw(q, k, v, cq, ck, out=torch.empty(3, 2, 128, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="^Output tensor must have contiguous last dimension$"):
        _raw(q, k, v, cq, ck, out=torch.empty(3, 2, 256, dtype=torch.bfloat16)[..., ::2])
    with pytest.raises(RuntimeError, match="^cu_seqlens_q must have dtype torch.int32$"):
        _raw(q, k, v, cq, ck, cu_seqlens_q=torch.tensor(cq))
    q8, k8, v8 = q.to(E4M3), k.to(E4M3), v.to(E4M3)
    one = torch.ones(1, 2)
    with pytest.raises(RuntimeError, match=re.escape("q_descale must have shape (batch_size, num_heads_k)")):
        _raw(q8, k8, v8, cq, ck, q_descale=torch.ones(2), k_descale=one, v_descale=one)
    with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
        _raw(q8, k8, v8, cq, ck, q_descale=one.bfloat16(), k_descale=one, v_descale=one)
    out, lse, out_accum, lse_accum = _raw(q8, k8, v8, cq, ck, q_descale=one, k_descale=one, v_descale=one)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 3) and out_accum is None and lse_accum is None


def test_fake_math_and_edge_values(builds):
    """The fake against the float64 definition: bottom-right causal, descales, -inf rows,
    and FA3's +inf for a batch with no key at all (flash_api.cpp 1190-1194)."""
    builds("flash_attn_3")
    import flash_attn_interface  # noqa: F401  registers flash_attn_3::fwd
    q, k, v, cq, ck = batch([(6, 2), (3, 3)], 2, seed=130)
    out = torch.full((9, 2, 128), float("nan"), dtype=torch.bfloat16)
    res = _raw(q, k, v, cq, ck, out=out, softmax_scale=0.1, is_causal=True)
    assert res[0] is out
    ref_out, ref_lse = reference_attention(q, k, v, torch.tensor(cq), torch.tensor(ck), softmax_scale=0.1)
    assert relative_error(out, ref_out) <= 1e-2
    torch.testing.assert_close(res[1].t().double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert (res[1][:, :4] == NEG_INF).all() and (out[:4] == 0).all()
    # descales multiply the e4m3 values, per (sequence, kv head)
    q8, k8, v8 = q.to(E4M3), k.to(E4M3), v.to(E4M3)
    dq, dk, dv = (torch.rand(2, 2) + 0.5 for _ in range(3))
    res8 = _raw(q8, k8, v8, cq, ck, q_descale=dq, k_descale=dk, v_descale=dv, softmax_scale=0.1, is_causal=True)
    rows_q = torch.repeat_interleave(torch.tensor([6, 3]), 1)
    sq = torch.repeat_interleave(dq, rows_q, dim=0)[..., None]
    sk = torch.repeat_interleave(dk, torch.tensor([2, 3]), dim=0)[..., None]
    sv = torch.repeat_interleave(dv, torch.tensor([2, 3]), dim=0)[..., None]
    ref8, _ = reference_attention(q8.double() * sq, k8.double() * sk, v8.double() * sv,
                                  torch.tensor(cq), torch.tensor(ck), softmax_scale=0.1)
    assert relative_error(res8[0], ref8) <= 1e-2
    # no key anywhere in the batch: not run, lse +inf (what the provider must not pass through)
    q, k, v, cq, ck = batch([(3, 0)], 2, seed=131)
    res = _raw(q, k, v, cq, [0, 0], max_seqlen_k=0)
    assert (res[0] == 0).all() and (res[1] == float("inf")).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_vllm_call_matches_vllms_own_call(builds, on_cpu, fp8):
    """The raw-op call equals what vLLM 0.32's own flash_attn_varlen_func(fa_version=3) passes
    (the verbatim vLLM Python of the stand-in; tests/vllm runs the same on the real vLLM)."""
    builds("vllm", capability=(9, 0))
    usable("vllm")
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    compare_with_vllm_call(flash_attn_varlen_func, fp8=fp8, seed=140 + fp8)


#: measured on an H200 with fa3-fwd 0.0.3 (bf16, 192/128, causal unless said): (q_len, k_len of
#: sequence 0, causal) -> rows of sequence 0 made NaN by an inf in sequence 1's v, 3 rows in
H200_TILE_READS = {(300, 300, True): (256, 299), (300, 300, False): (0, 299),
                   (300, 100, True): (128, 299), (200, 200, True): (128, 199),
                   (129, 129, True): (128, 128), (257, 300, True): (128, 256),
                   (256, 256, True): None}


@pytest.mark.parametrize("case", list(H200_TILE_READS), ids=str)
def test_fake_reads_past_the_sequence_end_as_fa3_does(builds, case):
    """FA3's 128x128 tiles multiply P = 0 by the V rows past a sequence's end: the fake makes
    exactly the rows NaN that the real kernel did on the H200 (the lse stays as it was)."""
    builds("flash_attn_3")
    import flash_attn_interface  # noqa: F401  registers flash_attn_3::fwd

    q_len, k_len, causal = case
    q, k, v, cq, ck = batch([(q_len, k_len), (50, 300)], 2, seed=170)
    v[k_len + 3, 1, 5] = float("inf")
    out, lse, _, _ = _raw(q, k, v, cq, ck, is_causal=causal)
    bad = out[:q_len].isnan().any(-1).any(-1).nonzero().flatten().tolist()
    span = H200_TILE_READS[case]
    assert (bad[0], bad[-1], len(bad)) == (span[0], span[1], span[1] - span[0] + 1) if span else not bad, bad
    assert not out[:q_len, 0].isnan().any(), "only the poisoned head"
    ref_lse = reference_attention(q[:q_len], k[:k_len], v[:k_len], torch.tensor([0, q_len]),
                                  torch.tensor([0, k_len]), causal=causal)[1]
    torch.testing.assert_close(lse[:, :q_len].t().double(), ref_lse, rtol=1e-5, atol=1e-5)
