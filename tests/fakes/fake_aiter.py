"""Fake AMD AITER packages, written from ROCm/aiter's source, for machines without a ROCm GPU.

`write_package(dest, variant)` writes a self-contained `aiter` package (it imports only
torch; nothing from mla_plugins or tests) plus its distribution metadata under `dest`; put
`dest` first on sys.path / PYTHONPATH of a FRESH process (torch ops register once per
process). `install(dest, variant)` does both for the current process.

What `import aiter` does in the fake, as in AITER (aiter/__init__.py, jit/core.py::compile_ops,
jit/utils/torch_guard.py::torch_compile_guard):
- registers `torch.ops.aiter.mla_reduce_v1`, `.get_ps_metadata_v1` and
  `.mla_prefill_ps_asm_fwd` with the schema `torch.library.infer_schema(...,
  mutates_args="unknown")` gives AITER's own stubs, alias annotations included
  (`Tensor(a0!) partial_output, ...`); `aiter.<op>` is a `(*args, **kwargs)` forwarder to the
  torch op, so a wrong call fails with torch's real error text;
- registers nothing with `AITER_AOT_IMPORT=1`, nor with `AITER_TRITON_ONLY=1` on variants of
  v0.1.16 and later (v0.1.15.x has no such switch and ignores it).

The kernels (tests/fakes/aiter_src/aiter/_kernels.py, which cites file:line):
- `get_ps_metadata_v1` runs v1_2_host.cuh as written: tiles of qlen_granularity rows in
  ping-pong order, items per KV head (q_head_range one head wide for MHA), an equal unit
  quota per CU, `kv_offset` = tokens left after a piece (0 for an item that ends its tile),
  `kv_end` rounded up to kvlen_granularity and clamped to the sequence end, reduce groups
  sorted by (qo_start, qo_end), buffer tails zeroed, `reduce_indptr` padded with the final
  count. Tiles with no visible key after the last unit are emitted to no one (as in AITER).
  With need_lse=True (variant "need_lse") every item gets a partial slot, so unsplit tiles
  are reduced too.
- `mla_reduce_v1` follows reduce.cu: groups of < 2 pieces untouched (their `final_lse` is
  never written), >= 4 pieces the massive path, 2-3 the simple running-max path, +inf lse
  where the pieces' exp-sum is 0 or NaN (every piece -inf: a split row that sees no key; the
  simple path then also writes NaN output), the (heads, Dv) router of the variant's release.
- `mla_prefill_ps_asm_fwd` checks what asm_mla.cu checks (fp8 Q/K, Gqa 1, 192/128, bf16
  out), then computes every work item in float32 over keys [kv_start, kv_end) of its
  heads with the sequence's bottom-right causal mask (AITER's op test reference), writing
  unsplit items to `output` and pieces (normalized output + natural-log lse) to
  `splitData`/`splitLse` at `partial_o_loc + row - qo_start`. Rows of an item that see no
  key: out 0 / lse -inf (the asm is closed source: modelled, see `aiter._kernels`).
- `get_ps_metadata_info_v1`: AITER's sizing formulas with the fake CU count (default 6 =
  mla_plugins' CPU worker count; `FAKE_AITER_CU_COUNT` overrides it at import).

Test hooks on the package (not AITER API): `aiter.calls` (every mla_reduce_v1 call that
reached the kernel: {"op", "nargs", "num_kv_splits", "final_lse", ...}), `aiter.all_calls` (every op call,
in order, each with "op"), `aiter._kernels.EMPTY_ROW_OUT` (what unsplit rows that see no
key get; set it to NaN to check a caller does not depend on the modelled 0).

Variants (release, where its behaviour is read):
    legacy         amd-aiter 0.1.15.post3: 8-argument reduce (no #3391; newer than 0.1.16 by
                   date), no AITER_TRITON_ONLY switch, router of v0.1.15/16
    num_kv_splits  amd-aiter 0.1.16: #3391 (num_kv_splits at index 6, no default),
                   get_mla_decode_fwd_max_splits present, router of v0.1.16
    need_lse       amd-aiter 0.1.22.post1: #3391 + #3606, `need_lse: bool = False` last in
                   get_ps_metadata_v1, router with 48/96 heads (v0.1.20+). #3606's exact
                   signature is NOT verified (the newest snapshot read, v0.1.20.post1,
                   predates it): keyword, default False, after is_causal is the most
                   likely form (SGLang 0.5.23 passes it by keyword); unsplit tiles get a
                   partial slot and single-piece groups are merged (modelled)
    unknown        a hypothetical build whose num_kv_splits moved after final_lse
    no_metadata    amd-aiter 0.1.16 from a source tree: the same package, no dist-info
    triton_only    amd-aiter 0.1.16 with AITER_TRITON_ONLY defaulting to 1 (no ops)
    async          the unrelated PyPI package `aiter` (async iterators)
    broken         amd-aiter whose import raises ImportError (a missing ROCm library)
    systemexit     a package whose import raises SystemExit (as a failed build step that
                   calls sys.exit would): not a specific AITER release
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent / "aiter_src" / "aiter"

LEGACY_SCHEMA = (
    "aiter::mla_reduce_v1(Tensor(a0!) partial_output, Tensor(a1!) partial_lse, "
    "Tensor(a2!) reduce_indptr, Tensor(a3!)? reduce_final_map, Tensor(a4!) reduce_partial_map, "
    "SymInt max_seqlen_q, Tensor(a6!) final_output, Tensor(a7!)? final_lse=None) -> ()"
)
NUM_KV_SPLITS_SCHEMA = (
    "aiter::mla_reduce_v1(Tensor(a0!) partial_output, Tensor(a1!) partial_lse, "
    "Tensor(a2!) reduce_indptr, Tensor(a3!)? reduce_final_map, Tensor(a4!) reduce_partial_map, "
    "SymInt max_seqlen_q, SymInt num_kv_splits, Tensor(a7!) final_output, "
    "Tensor(a8!)? final_lse=None) -> ()"
)
UNKNOWN_SCHEMA = (
    "aiter::mla_reduce_v1(Tensor(a0!) partial_output, Tensor(a1!) partial_lse, "
    "Tensor(a2!) reduce_indptr, Tensor(a3!)? reduce_final_map, Tensor(a4!) reduce_partial_map, "
    "SymInt max_seqlen_q, Tensor(a6!) final_output, Tensor(a7!)? final_lse, "
    "SymInt num_kv_splits) -> ()"
)

#: heads mla_reduce_v1's router takes, by value head dim (reduce.cu MLA_REDUCE_ROUTER)
ROUTER_V0116 = {
    128: (1, 2, 4, 8, 10, 16, 32, 40, 64, 128),
    512: (8, 16, 32, 48, 64, 80, 96, 112, 128),
}
ROUTER_V0120 = {
    64: (64,),
    128: (1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128),
    512: (8, 16, 24, 32, 48, 64, 80, 96, 112, 128),
}

BROKEN_ERROR = "libamdhip64.so.6: cannot open shared object file: No such file or directory"
SYSTEMEXIT_MESSAGE = "aiter: JIT build failed, exiting"

_AMD = dict(import_raises=None, message="", triton_switch=True, triton_default="0",
            need_lse=False, decode_max_splits=True, router=ROUTER_V0116, dist_info=True)
VARIANTS = {
    "legacy": dict(_AMD, dist="amd-aiter", version="0.1.15.post3", reduce="legacy",
                   triton_switch=False, decode_max_splits=False),
    "num_kv_splits": dict(_AMD, dist="amd-aiter", version="0.1.16", reduce="num_kv_splits"),
    "need_lse": dict(_AMD, dist="amd-aiter", version="0.1.22.post1", reduce="num_kv_splits",
                     need_lse=True, router=ROUTER_V0120),
    "unknown": dict(_AMD, dist="amd-aiter", version="0.1.99.dev0", reduce="unknown"),
    "no_metadata": dict(_AMD, dist="amd-aiter", version="0.1.16", reduce="num_kv_splits",
                        dist_info=False),
    "triton_only": dict(_AMD, dist="amd-aiter", version="0.1.16", reduce="num_kv_splits",
                        triton_default="1"),
    "broken": dict(_AMD, dist="amd-aiter", version="0.1.16", reduce="num_kv_splits",
                   import_raises="ImportError", message=BROKEN_ERROR),
    "systemexit": dict(_AMD, dist="amd-aiter", version="0.1.16", reduce="num_kv_splits",
                       import_raises="SystemExit", message=SYSTEMEXIT_MESSAGE),
    "async": dict(dist="aiter", version="0.13.0"),
}

_ASYNC_INIT = '''\
"""Stand-in for the PyPI `aiter` (async iterator helpers), unrelated to AMD."""


async def azip(*iterables):
    raise NotImplementedError
'''

_CONFIG = '''\
"""Written by tests/fakes/fake_aiter.py: which AITER release this fake stands for."""
import os

VARIANT = {variant!r}
DISTRIBUTION = {dist!r}
VERSION = {version!r}
REDUCE_CONVENTION = {reduce!r}
NEED_LSE = {need_lse!r}
HAS_DECODE_MAX_SPLITS = {decode_max_splits!r}
HAS_TRITON_ONLY_SWITCH = {triton_switch!r}
TRITON_ONLY_DEFAULT = {triton_default!r}
IMPORT_RAISES = {import_raises!r}
IMPORT_MESSAGE = {message!r}
ROUTER = {router!r}
CU_COUNT = int(os.environ.get("FAKE_AITER_CU_COUNT", "6"))
'''


def write_package(dest: str | Path, variant: str) -> Path:
    """Write the fake `aiter` for `variant` under `dest` and return `dest`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: found {variant!r}, expected one of {sorted(VARIANTS)}")
    spec = VARIANTS[variant]
    dest = Path(dest)
    pkg = dest / "aiter"
    if pkg.exists():
        shutil.rmtree(pkg)
    for old in dest.glob("*aiter*.dist-info"):
        shutil.rmtree(old)
    if variant == "async":
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(_ASYNC_INIT)
    else:
        shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))
        (pkg / "_fake_config.py").write_text(_CONFIG.format(variant=variant, **spec))
    if spec.get("dist_info", True):
        info = dest / f"{spec['dist'].replace('-', '_')}-{spec['version']}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {spec['dist']}\nVersion: {spec['version']}\n")
        (info / "top_level.txt").write_text("aiter\n")
        (info / "RECORD").write_text("aiter/__init__.py,,\n")
    return dest


def install(dest: str | Path, variant: str) -> Path:
    """Write the fake and put it first on sys.path of this process (call before `import aiter`)."""
    path = write_package(dest, variant)
    sys.path.insert(0, str(path))
    return path
