"""Faithful fake AMD AITER packages, for machines without a ROCm GPU.

`write_package(dest, variant)` writes an importable `aiter` package (plus its
distribution metadata) under `dest`; put `dest` on sys.path / PYTHONPATH of a fresh
process. Importing it registers `aiter::mla_reduce_v1` with torch.library using the exact
schema of the AITER release it stands for, and a module-level `mla_reduce_v1(*args,
**kwargs)` that forwards to the torch op as AITER's `compile_ops` wrapper does, so a
wrong-convention call fails with AITER's real error text.

The AMD variants also carry the FP8 prefill trio with AITER's signatures:
`get_ps_metadata_info_v1` returns (shape, dtype) pairs sized by AITER's formulas,
`get_ps_metadata_v1` fills the buffers (mla-plugins' planner, AITER's format, reduce_indptr
padded at the end as AITER pads it), and `mla_prefill_ps_asm_fwd` checks fp8 inputs and a
bf16 output, then runs the work items, writing unsplit tiles to `output` and pieces to
`splitData`/`splitLse`, and, like AITER, no lse for unsplit rows.

What the fakes do NOT reproduce (the real kernels add them): the asm and HIP kernels'
numerics, the reduce's LDS sizing (`max(cu_num, num_kv_splits)` splits per tile), its +inf
lse for rows whose pieces are all -inf, the (H, Dv) router that rejects unsupported head
counts, AITER's own tile ordering, and the gfx950-only check of the prefill.

Variants:
    legacy          amd-aiter 0.1.15.post3: 8 arguments (newer than 0.1.16 by date, no #3391)
    num_kv_splits   amd-aiter 0.1.16: 9 arguments, num_kv_splits after max_seqlen_q
    unknown         a hypothetical build whose num_kv_splits moved after final_lse
    async           the unrelated PyPI package `aiter` (async iterators)
    broken          amd-aiter whose import raises, as with a missing ROCm library
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

LEGACY_SCHEMA = (
    "mla_reduce_v1(Tensor partial_output, Tensor partial_lse, Tensor reduce_indptr, "
    "Tensor? reduce_final_map, Tensor reduce_partial_map, SymInt max_seqlen_q, "
    "Tensor final_output, Tensor? final_lse=None) -> ()"
)
NUM_KV_SPLITS_SCHEMA = (
    "mla_reduce_v1(Tensor partial_output, Tensor partial_lse, Tensor reduce_indptr, "
    "Tensor? reduce_final_map, Tensor reduce_partial_map, SymInt max_seqlen_q, "
    "SymInt num_kv_splits, Tensor final_output, Tensor? final_lse=None) -> ()"
)
UNKNOWN_SCHEMA = (
    "mla_reduce_v1(Tensor partial_output, Tensor partial_lse, Tensor reduce_indptr, "
    "Tensor? reduce_final_map, Tensor reduce_partial_map, SymInt max_seqlen_q, "
    "Tensor final_output, Tensor? final_lse, SymInt num_kv_splits) -> ()"
)

VARIANTS = {
    "legacy": ("amd-aiter", "0.1.15.post3", LEGACY_SCHEMA),
    "num_kv_splits": ("amd-aiter", "0.1.16", NUM_KV_SPLITS_SCHEMA),
    "unknown": ("amd-aiter", "0.1.99.dev0", UNKNOWN_SCHEMA),
    "async": ("aiter", "0.13.0", None),
    "broken": ("amd-aiter", "0.1.16", None),
}

BROKEN_ERROR = "libamdhip64.so.6: cannot open shared object file: No such file or directory"

_AMD_INIT = '''\
"""Fake AMD AITER ({dist} {version}) written by tests.fakes.fake_aiter."""
import torch

from mla_plugins.core.reduce import torch_reduce

SCHEMA = {schema!r}
NAMES = {names!r}
_lib = torch.library.Library("aiter", "FRAGMENT")
_lib.define(SCHEMA)


def _impl(partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
          max_seqlen_q, *rest):
    values = dict(zip(NAMES[6:], rest))
    calls.append({{"num_kv_splits": values.get("num_kv_splits"), "nargs": 6 + len(rest)}})
    torch_reduce(partial_output, partial_lse, reduce_indptr, reduce_final_map,
                 reduce_partial_map, int(max_seqlen_q), values["final_output"],
                 values.get("final_lse"))


_lib.impl("mla_reduce_v1", _impl, "CompositeExplicitAutograd")

#: every call that reached the kernel: {{"num_kv_splits": int | None, "nargs": int}}
calls = []


def mla_reduce_v1(*args, **kwargs):
    # aiter's compile_ops wrapper_custom: a (*args, **kwargs) forwarder to the torch op
    return torch.ops.aiter.mla_reduce_v1(*args, **kwargs)


from . import ops  # noqa: E402,F401  (aiter.ops.attention, as the real package)

from tests.fakes.fake_aiter import (  # noqa: E402,F401
    get_ps_metadata_info_v1,
    get_ps_metadata_v1,
    mla_prefill_ps_asm_fwd,
)
'''

_ATTENTION_NEW = '''\
def get_mla_decode_fwd_max_splits(*args, **kwargs):
    """Added by ROCm/aiter#3391 in the same commit as num_kv_splits."""
    raise NotImplementedError("fake")
'''


FAKE_CU_COUNT = 6  # mla_plugins.core.device.CPU_WORKERS: what "the CU count" means on the CPU


def get_ps_metadata_info_v1(batch_size: int, num_head_k: int, max_qlen: int, qlen_granularity: int = 256):
    """AITER's sizing formulas, with the CPU's stand-in CU count."""
    import math

    import torch

    clusters = math.gcd(num_head_k, FAKE_CU_COUNT)
    per_cluster = FAKE_CU_COUNT // clusters
    tiles_per_batch = math.ceil(max_qlen / qlen_granularity)
    tiles = batch_size * tiles_per_batch
    max_works = (batch_size + per_cluster - 1) * tiles_per_batch * num_head_k
    max_partials = min(batch_size + per_cluster - 1, (per_cluster - 1) * 2) * tiles_per_batch
    return (
        (2, torch.uint64),
        (FAKE_CU_COUNT + 1, torch.int32),
        ((max_works, 8), torch.int32),
        (tiles + 1, torch.int32),
        ((tiles, 2), torch.int32),
        (max_partials, torch.int32),
    )


def get_ps_metadata_v1(seqlens_qo_indptr, pages_kv_indptr, context_lens, gqa_ratio, num_heads_k,
                       work_metadata_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map,
                       reduce_partial_map, qhead_granularity=1, qlen_granularity=256,
                       kvlen_granularity=16, block_size=16, is_causal=True):
    from mla_plugins.core.plan import plan_prefill

    if gqa_ratio != 1 or block_size != 1:
        raise NotImplementedError("the fake plans MHA prefill with block_size 1 only")
    plan = plan_prefill(seqlens_qo_indptr.int().cpu(), pages_kv_indptr.int().cpu(), num_heads=num_heads_k,
                        causal=is_causal, tile_q=qlen_granularity, kv_granularity=kvlen_granularity,
                        num_workers=FAKE_CU_COUNT)
    n_items, n_split = plan.num_items, plan.num_split_tiles
    work_indptr.copy_(plan.work_indptr)
    work_info[:n_items].copy_(plan.work_info)
    reduce_indptr.fill_(plan.num_partial_tiles)  # AITER pads the tail with the final count
    reduce_indptr[: n_split + 1].copy_(plan.reduce_indptr)
    reduce_final_map[:n_split].copy_(plan.reduce_final_map)
    reduce_partial_map[: plan.num_partial_tiles].copy_(plan.reduce_partial_map)


def mla_prefill_ps_asm_fwd(Q, K, V, qo_indptr, kv_indptr, kv_page_indices, work_indptr, work_info_set,
                           max_seqlen_q, softmax_scale, is_causal, splitData, splitLse, output,
                           q_scale=None, k_scale=None, v_scale=None):
    import types

    import torch

    from mla_plugins.core.kernels.base import PrefillInputs
    from mla_plugins.core.kernels.torch_kernel import TorchKernel

    fp8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    if Q.dtype not in fp8 or K.dtype not in fp8 or V.dtype not in fp8:
        raise RuntimeError("fp8 mla persistent prefill expects fp8 Q, K, V")
    if output.dtype != torch.bfloat16 or Q.size(1) != K.size(1) or Q.size(2) != 192 or V.size(2) != 128:
        raise RuntimeError("no kernel for these settings (gqa 1, qk 192, v 128, bf16 output only)")
    deq = lambda x, s: x.float() * (1.0 if s is None else s)
    inputs = PrefillInputs(deq(Q, q_scale), deq(K, k_scale), deq(V, v_scale), qo_indptr, kv_indptr,
                           float(softmax_scale), bool(is_causal), False, Q.dtype, int(max_seqlen_q), 0)
    n_items = int(work_indptr[-1])
    plan = types.SimpleNamespace(work_info_cpu=work_info_set[:n_items].cpu(), causal=bool(is_causal))
    TorchKernel().prefill(inputs, plan, output, None, splitData, splitLse)


def schema_names(schema: str) -> list[str]:
    """Argument names of a schema string, in order."""
    body = schema.split("(", 1)[1].rsplit(") ->", 1)[0]
    return [arg.split("=")[0].split()[-1] for arg in body.split(", ")]


def write_package(dest: str | Path, variant: str) -> Path:
    """Write the fake `aiter` for `variant` under `dest` and return `dest`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: found {variant!r}, expected one of {sorted(VARIANTS)}")
    dist, version, schema = VARIANTS[variant]
    dest = Path(dest)
    pkg = dest / "aiter"
    (pkg / "ops").mkdir(parents=True, exist_ok=True)
    if variant == "async":
        init = textwrap.dedent('''\
            """Stand-in for the PyPI `aiter` (async iterator helpers), unrelated to AMD."""
            async def azip(*iterables):
                raise NotImplementedError
            ''')
    elif variant == "broken":
        init = f"raise ImportError({BROKEN_ERROR!r})\n"
    else:
        init = _AMD_INIT.format(dist=dist, version=version, schema=schema, names=schema_names(schema))
    (pkg / "__init__.py").write_text(init)
    (pkg / "ops" / "__init__.py").write_text("from . import attention  # noqa: F401\n")
    (pkg / "ops" / "attention.py").write_text(_ATTENTION_NEW if variant == "num_kv_splits" else "")
    info = dest / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("aiter\n")
    return dest


def install(dest: str | Path, variant: str) -> Path:
    """Write the fake and put it first on sys.path of this process (call before `import aiter`)."""
    path = write_package(dest, variant)
    sys.path.insert(0, str(path))
    return path
