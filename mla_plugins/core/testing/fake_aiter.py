"""Faithful fake AMD AITER packages, for machines without a ROCm GPU.

`write_package(dest, variant)` writes an importable `aiter` package (plus its
distribution metadata) under `dest`; put `dest` on sys.path / PYTHONPATH of a fresh
process. Importing it registers `aiter::mla_reduce_v1` with torch.library using the exact
schema of the AITER release it stands for, and a module-level `mla_reduce_v1(*args,
**kwargs)` that forwards to the torch op as AITER's `compile_ops` wrapper does, so a
wrong-convention call fails with AITER's real error text.

What the fakes do NOT reproduce (the real kernel adds them): the HIP reduce's numerics,
its LDS sizing (`max(cu_num, num_kv_splits)` splits per tile), its +inf lse for rows whose
pieces are all -inf, and the (H, Dv) router that rejects unsupported head counts. The body
runs mla-plugins' torch reduce.

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
"""Fake AMD AITER ({dist} {version}) written by mla_plugins.core.testing.fake_aiter."""
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
'''

_ATTENTION_NEW = '''\
def get_mla_decode_fwd_max_splits(*args, **kwargs):
    """Added by ROCm/aiter#3391 in the same commit as num_kv_splits."""
    raise NotImplementedError("fake")
'''


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
