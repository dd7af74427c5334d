"""AITER shim for SGLang's built-in aiter backend (`sglang.srt.layers.attention.aiter_backend`).

That module does `from aiter import (..., get_ps_metadata_v1, ..., mla_reduce_v1, ...)` and
is their only user. Its calls, by release (read from the release wheels):
- `mla_reduce_v1` positionally with 8 arguments through 0.5.14 (`..., tile_q, output,
  final_lse`) and 9 from 0.5.15 (`..., tile_q, 0, output, final_lse`), so each release breaks
  against the AITER on the other side of ROCm/aiter#3391;
- `get_ps_metadata_v1(..., need_lse=need_lse)` from 0.5.22, which every AITER without
  ROCm/aiter#3606 rejects before the reduce runs.
The shim rebinds those two module attributes to `mla_plugins.aiter_mla_reduce_v1` (accepts
both reduce forms and calls the installed AITER in its own) and
`mla_plugins.aiter_get_ps_metadata_v1` (accepts `need_lse` on any AITER). It goes by what
the module holds, never by SGLang's version, and only when the installed AITER's convention
is one mla-plugins knows; otherwise it leaves the module as SGLang made it and one log line
says why.

When: `install_aiter_shim()` (from the plugin's `register()`, which runs in every SGLang
process) imports nothing and probes nothing; it installs an import hook. AITER is probed
only when the aiter backend module is imported, i.e. in a process that runs the model (that
module imports aiter itself), right after the module's own code ran.

Why not SGLang's `HookRegistry` (REPLACE on `...aiter_backend.mla_reduce_v1`): after
patching, it rewrites every module attribute that is the same object, `aiter.mla_reduce_v1`
itself included, so our drop-in (which calls `aiter.mla_reduce_v1`) would call itself; it
also imports the backend module at plugin-load time.

`MLA_PLUGINS_SHIM=0` turns it off. Logged once per process.
"""

from __future__ import annotations

import logging
import sys

import mla_plugins

logger = logging.getLogger("mla_plugins.sglang.shim")

TARGET_MODULE = "sglang.srt.layers.attention.aiter_backend"
REDUCE = "mla_reduce_v1"
METADATA = "get_ps_metadata_v1"
KNOWN_REDUCE = ("legacy", "num_kv_splits")

#: get_ps_metadata_v1's parameters before ROCm/aiter#3606 (v0.1.15 through v0.1.20.post1);
#: #3606 appends `need_lse`.
PS_METADATA_ARGS = (
    "seqlens_qo_indptr", "pages_kv_indptr", "context_lens", "gqa_ratio", "num_heads_k",
    "work_metadata_ptrs", "work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
    "reduce_partial_map", "qhead_granularity", "qlen_granularity", "kvlen_granularity",
    "block_size", "is_causal",
)

_done: dict | None = None  # what the first bind decided, per process


def _metadata_convention(status) -> str | None:
    """"need_lse" / "legacy" if get_ps_metadata_v1's parameters are ones we know, else None."""
    names = tuple(status.metadata_kwargs or ())
    if names == PS_METADATA_ARGS + ("need_lse",):
        return "need_lse"
    if names == PS_METADATA_ARGS:
        return "legacy"
    return None


def _bind(module) -> dict:
    """Rebind the module's AITER names to the drop-ins where that is known to be right.

    Returns {name: "bound" | "already" | why-not} for each of the two names.
    """
    global _done
    status = mla_plugins.probe_aiter()  # here the module has imported aiter itself
    held = vars(module)
    result = {}
    reduce_known = status.usable and status.reduce_convention in KNOWN_REDUCE
    drop_ins = {REDUCE: mla_plugins.aiter_mla_reduce_v1,
                METADATA: getattr(mla_plugins, "aiter_get_ps_metadata_v1", None)}
    for name, drop_in in drop_ins.items():
        if name not in held:
            result[name] = f"the module holds no {name} (its `from aiter import ...` failed)"
        elif held[name] is drop_in:
            result[name] = "already"
        elif not reduce_known:
            # The metadata drop-in fills lse through the reduce: with a reduce we cannot
            # call, SGLang's own calls are the honest ones (they fail with AITER's error).
            result[name] = (f"AITER's convention is not one mla-plugins knows: {status.reason}"
                            if name == REDUCE else "left with mla_reduce_v1")
        elif drop_in is None:
            result[name] = "this mla-plugins has no drop-in for it"
        elif name == METADATA and _metadata_convention(status) is None:
            result[name] = (f"AITER's get_ps_metadata_v1 takes {list(status.metadata_kwargs)}, "
                            f"not {list(PS_METADATA_ARGS)} with or without need_lse")
        else:
            setattr(module, name, drop_in)
            result[name] = "bound"
    if _done is None:
        _done = result
        aiter = f"AITER {status.distribution or '?'} {status.version or '?'}"
        bound = [n for n, r in result.items() if r == "bound"]
        left = {n: r for n, r in result.items() if r not in ("bound", "already")}
        if bound:
            logger.info(
                "mla_plugins: %s.{%s} -> mla_plugins drop-ins (%s: reduce %s, get_ps_metadata_v1 "
                "%s)%s. Set MLA_PLUGINS_SHIM=0 to leave them alone.",
                TARGET_MODULE, ", ".join(bound), aiter, status.reduce_convention,
                _metadata_convention(status) or "unknown",
                "".join(f"; {n} left as is: {r}" for n, r in left.items()),
            )
        elif left:
            log = logger.warning if status.usable or status.reduce_convention else logger.info
            log("mla_plugins: SGLang's aiter backend is left as it is (%s): %s", aiter,
                "; ".join(f"{n}: {r}" for n, r in left.items()))
    return result


def install_aiter_shim() -> str:
    """Install the shim; cheap, and safe to call in every SGLang process.

    Returns "disabled" (MLA_PLUGINS_SHIM=0), "bound" (the module was already imported: bound
    now where it applies, see the log), or "deferred" (binds when the module is imported).
    Neither imports aiter nor touches a GPU unless the aiter backend module is already
    imported (then that module has imported aiter itself).
    """
    if not mla_plugins.shim_enabled():
        logger.info("mla_plugins: MLA_PLUGINS_SHIM=0, SGLang's aiter backend is left as it is")
        return "disabled"
    now = TARGET_MODULE in sys.modules
    mla_plugins.after_import(TARGET_MODULE, _bind, what="binding the AITER shim")
    return "bound" if now else "deferred"
