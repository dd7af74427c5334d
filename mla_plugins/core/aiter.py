"""Binding AITER by what it registered, never by its version string.

`import aiter` registers `torch.ops.aiter.mla_reduce_v1`; `aiter.mla_reduce_v1` is a
`(*args, **kwargs)` forwarder, so only the op schema tells the conventions apart:
- legacy (before ROCm/aiter#3391, every v0.1.15.x included): 8 arguments;
- num_kv_splits (v0.1.16 and later): a required `SymInt num_kv_splits` after `max_seqlen_q`.
Version strings cannot tell them apart (v0.1.15.post3 is newer than v0.1.16 and lacks the
argument), so `probe_aiter` reads the schema, and `aiter_mla_reduce_v1` forwards whatever
a framework call site passes in the convention the installed AITER has.

`get_ps_metadata_v1` gained `need_lse` with ROCm/aiter#3606 (SGLang >= 0.5.22 passes it):
the probe reads that schema too, and `aiter_get_ps_metadata_v1` accepts the keyword on every
AITER (see its docstring for what it does where AITER lacks it).

Nothing here creates a GPU context: the probe imports aiter (which registers its ops; the
C++ is built at the first call) and reads the arch from KFD sysfs only.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import re
import threading
import weakref
from dataclasses import dataclass, field

import torch

from .device import default_num_workers, gcn_arch_no_context

try:
    import importlib_metadata
except ImportError:  # pragma: no cover
    import importlib.metadata as importlib_metadata

logger = logging.getLogger("mla_plugins.aiter")

LEGACY_ARGS = (
    "partial_output",
    "partial_lse",
    "reduce_indptr",
    "reduce_final_map",
    "reduce_partial_map",
    "max_seqlen_q",
    "final_output",
    "final_lse",
)
NUM_KV_SPLITS_ARGS = LEGACY_ARGS[:6] + ("num_kv_splits",) + LEGACY_ARGS[6:]
#: (H, Dv) pairs `mla_reduce_v1` supports with Dv = 128 (MLA_REDUCE_ROUTER at v0.1.16).
REDUCE_HEADS_DV128 = (1, 2, 4, 8, 10, 16, 32, 40, 64, 128)
#: MLA_REDUCE_ROUTER by value head dim: v0.1.16 (reduce.cu:870-889) and v0.1.20 on, which
#: adds 48 and 96 heads at Dv 128 (AITER #4727), 24 at 512 and 64 at Dv 64.
REDUCE_ROUTER_V0116 = {128: REDUCE_HEADS_DV128, 512: (8, 16, 32, 48, 64, 80, 96, 112, 128)}
REDUCE_ROUTER_V0120 = {
    64: (64,),
    128: (1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128),
    512: (8, 16, 24, 32, 48, 64, 80, 96, 112, 128),
}
METADATA_ARGS = (
    "seqlens_qo_indptr",
    "pages_kv_indptr",
    "context_lens",
    "gqa_ratio",
    "num_heads_k",
    "work_metadata_ptrs",
    "work_indptr",
    "work_info",
    "reduce_indptr",
    "reduce_final_map",
    "reduce_partial_map",
    "qhead_granularity",
    "qlen_granularity",
    "kvlen_granularity",
    "block_size",
    "is_causal",
)
#: the first amd-aiter release with ROCm/aiter#3606 (need_lse), as vLLM #57923 names it
NEED_LSE_RELEASE = "0.1.22.post1"

LEGACY = "legacy"
NEW = "num_kv_splits"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class AiterStatus:
    """What `import aiter` gave this process.

    reduce_convention: "legacy" (8 arguments), "num_kv_splits" (9), "unknown", or None
    when there is no usable AMD AITER. `reason` is one sentence a user can act on.
    """

    installed: bool
    is_amd_aiter: bool = False
    distribution: str | None = None
    version: str | None = None
    reduce_convention: str | None = None
    schema: str | None = None
    prefill_op: bool = False
    metadata_kwargs: tuple[str, ...] = ()
    metadata_schema: str | None = None
    arch: str | None = None
    import_error: str | None = None
    reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.is_amd_aiter and self.reduce_convention in (LEGACY, NEW)

    @property
    def metadata_need_lse(self) -> bool:
        """Whether get_ps_metadata_v1 takes `need_lse` (ROCm/aiter#3606)."""
        return "need_lse" in self.metadata_kwargs

    def reduce_router(self) -> dict[int, tuple[int, ...]]:
        """Heads per value head dim that this AITER's mla_reduce_v1 takes (by release; an
        unreadable version gets the v0.1.16 set, the smaller one)."""
        parts = _release(self.version)
        return REDUCE_ROUTER_V0120 if parts is not None and parts >= (0, 1, 20) else REDUCE_ROUTER_V0116

    def action(self) -> str:
        """What mla-plugins does with this AITER, for `doctor` and the adapters' log line."""
        lse = ("; get_ps_metadata_v1 takes need_lse" if self.metadata_need_lse else
               "; need_lse (ROCm/aiter#3606) absent: aiter_get_ps_metadata_v1 routes unsplit tiles "
               "through the reduce")
        if self.reduce_convention == NEW:
            return "forwards framework reduce calls with num_kv_splits (9 arguments)" + lse
        if self.reduce_convention == LEGACY:
            return "forwards framework reduce calls without num_kv_splits (8 arguments)" + lse
        if self.reduce_convention == UNKNOWN:
            return "leaves AITER unused: its mla_reduce_v1 schema is not one mla-plugins knows"
        return "uses its Triton/torch kernels; no AITER call sites to shim"


def _release(version: str | None) -> tuple[int, int, int] | None:
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(x) for x in m.groups()) if m else None


def _distribution_of(module_name: str) -> tuple[str | None, str | None]:
    try:
        names = importlib_metadata.packages_distributions().get(module_name) or []
    except Exception:  # metadata of unrelated broken packages must not break the probe
        names = []
    for name in names:
        try:
            return name, importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return (names[0] if names else None), None


def _op_schema(name: str):
    """The registered schema of torch.ops.aiter.<name>.default, or None."""
    try:
        packet = getattr(torch.ops.aiter, name)
        return packet.default._schema
    except (AttributeError, RuntimeError):
        return None


def classify_schema(schema) -> tuple[str, str]:
    """(convention, why) from a torch FunctionSchema of aiter::mla_reduce_v1."""
    args = list(schema.arguments)
    names = tuple(a.name for a in args)
    for convention, expected in ((NEW, NUM_KV_SPLITS_ARGS), (LEGACY, LEGACY_ARGS)):
        extra = args[len(expected) :]
        if names[: len(expected)] == expected and all(a.has_default_value() for a in extra):
            if convention == LEGACY and "num_kv_splits" in names:
                break
            note = f" (plus optional {', '.join(a.name for a in extra)})" if extra else ""
            return convention, f"{len(expected)} arguments{note}"
    return UNKNOWN, f"arguments {list(names)} match neither the legacy nor the num_kv_splits order"


def _metadata_kwargs(aiter_module) -> tuple[tuple[str, ...], str | None]:
    """(argument names, schema text) of get_ps_metadata_v1: the registered op's schema, or
    the Python signature where no op is registered."""
    schema = _op_schema("get_ps_metadata_v1")
    if schema is not None:
        return tuple(a.name for a in schema.arguments), str(schema)
    fn = getattr(aiter_module, "get_ps_metadata_v1", None)
    if fn is None:
        return (), None
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return (), None
    names = tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return names, None


def _looks_like_amd_aiter(module) -> bool:
    """Decided by what the module holds, not by its distribution name (a source checkout of
    AMD's AITER has no metadata): its ops, its import-mode switches or its JIT package."""
    if _op_schema("mla_reduce_v1") is not None or hasattr(module, "mla_reduce_v1"):
        return True
    if any(hasattr(module, name) for name in ("AITER_AOT_IMPORT", "AITER_TRITON_ONLY")):
        return True
    try:
        return importlib.util.find_spec("aiter.jit") is not None
    except (ImportError, ValueError):
        return False


def _no_ops_cause(module) -> str | None:
    """Why `import aiter` registered no C++/HIP op, when AITER's own switch says so."""
    for name in ("AITER_TRITON_ONLY", "AITER_AOT_IMPORT"):
        flag = getattr(module, name, None)
        if flag is True or (flag is None and os.environ.get(name) == "1"):
            return name
    return None


def _probe() -> AiterStatus:
    try:
        found = importlib.util.find_spec("aiter") is not None
    except (ImportError, ValueError):  # a broken sys.modules entry: let the import report it
        found = True
    if not found:
        return AiterStatus(
            installed=False,
            reason="AITER is not installed; mla-plugins runs its Triton or torch kernels instead.",
        )
    dist, version = _distribution_of("aiter")
    try:
        module = importlib.import_module("aiter")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001  an ABI mismatch, a missing ROCm library, or
        # a package that calls sys.exit while importing: report it, never end the process
        text = f"{type(exc).__name__}: {exc}"
        return AiterStatus(
            installed=True,
            distribution=dist,
            version=version,
            import_error=text,
            reason=f"`import aiter` failed ({text}); fix or reinstall amd-aiter for this torch/ROCm, "
            "or uninstall it. mla-plugins runs its other kernels meanwhile.",
        )
    if not _looks_like_amd_aiter(module):
        where = getattr(module, "__file__", None) or "a namespace package"
        if dist == "aiter":
            what = (f"the PyPI async-iterator package (aiter {version or ''}".rstrip() + ")")
        else:
            what = f"a module that is not AMD's AITER ({dist or 'no distribution metadata'}, {where})"
        return AiterStatus(
            installed=True,
            distribution=dist,
            version=version,
            reason=f"the installed `aiter` is {what}, not AMD's AITER (amd-aiter); it is ignored.",
        )
    names, metadata_schema = _metadata_kwargs(module)
    common = dict(
        installed=True,
        is_amd_aiter=True,
        distribution=dist,
        version=version,
        prefill_op=hasattr(module, "mla_prefill_ps_asm_fwd"),
        metadata_kwargs=names,
        metadata_schema=metadata_schema,
        arch=gcn_arch_no_context(),
    )
    schema = _op_schema("mla_reduce_v1")
    if schema is not None:
        convention, why = classify_schema(schema)
        text = str(schema)
        if convention == UNKNOWN:
            reason = (
                f"AITER's mla_reduce_v1 has a schema mla-plugins does not know ({why}): {text}. "
                "Its AITER kernel is disabled; report this schema to mla-plugins."
            )
        else:
            reason = f"AITER mla_reduce_v1 uses the {convention} convention: {why}."
        return AiterStatus(reduce_convention=convention, schema=text, reason=reason, **common)
    cause = _no_ops_cause(module)
    if cause is not None and not hasattr(module, "mla_reduce_v1"):
        return AiterStatus(
            reason=f"{cause}=1 is set, so `import aiter` registered none of AITER's C++/HIP ops "
            "(mla_reduce_v1, get_ps_metadata_v1, mla_prefill_ps_asm_fwd); unset it in the "
            "process that runs the model to use AITER's FP8 prefill. mla-plugins runs its other "
            "kernels meanwhile.",
            **common,
        )
    if not hasattr(module, "mla_reduce_v1"):
        return AiterStatus(
            reason="this AITER has no mla_reduce_v1 (too old for FP8 MLA prefill); "
            "mla-plugins runs its other kernels.",
            **common,
        )
    # The op is not registered (an unusual build): #3391 added this helper in the same commit.
    attention = getattr(getattr(module, "ops", None), "attention", None)
    convention = NEW if hasattr(attention, "get_mla_decode_fwd_max_splits") else LEGACY
    return AiterStatus(
        reduce_convention=convention,
        reason=f"torch.ops.aiter.mla_reduce_v1 is not registered; {convention} convention inferred "
        "from aiter.ops.attention.get_mla_decode_fwd_max_splits "
        + ("being present." if convention == NEW else "being absent."),
        **common,
    )


_status: AiterStatus | None = None
_lock = threading.Lock()


def probe_aiter(*, refresh: bool = False) -> AiterStatus:
    """Detect AITER once per process (thread-safe, no GPU work); `refresh=True` probes again."""
    global _status
    with _lock:
        if _status is None or refresh:
            _status = _probe()
            logger.debug("AITER probe: %s", _status)
        return _status


def _is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _bind_args(op: str, names, keywords, args, kwargs) -> dict:
    """Positional `args` onto `names` (the rest may come by keyword), then `kwargs`, which
    must be among `keywords` and not given twice: Python's own rules, with the op named."""
    bound = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        if key not in keywords:
            raise TypeError(f"{op}: unexpected keyword argument {key!r}")
        if key in bound:
            raise TypeError(f"{op}: got multiple values for argument {key!r}")
        bound[key] = value
    return bound


def normalize_reduce_args(args: tuple, kwargs: dict) -> dict:
    """Map any accepted call form to the 9 canonical names (num_kv_splits 0 if absent)."""
    if len(args) > len(NUM_KV_SPLITS_ARGS):
        raise TypeError(f"mla_reduce_v1: found {len(args)} positional arguments, expected at most 9")
    if len(args) > 6:
        sixth = args[6]
        if _is_int(sixth):
            names = NUM_KV_SPLITS_ARGS
        elif sixth is None or isinstance(sixth, torch.Tensor):
            names = LEGACY_ARGS
        else:
            raise TypeError(
                f"mla_reduce_v1: argument 6 found {type(sixth).__name__}, expected an int "
                "(num_kv_splits, AITER >= v0.1.16) or a Tensor (final_output, the 8-argument form)"
            )
        if names is LEGACY_ARGS and len(args) > len(LEGACY_ARGS):
            raise TypeError("mla_reduce_v1: found 9 positional arguments with a Tensor at position 6, "
                            "expected an int num_kv_splits there")
    else:
        names = NUM_KV_SPLITS_ARGS
    bound = _bind_args("mla_reduce_v1", names, NUM_KV_SPLITS_ARGS, args, kwargs)
    bound.setdefault("num_kv_splits", 0)
    bound.setdefault("final_lse", None)
    missing = [n for n in NUM_KV_SPLITS_ARGS if n not in bound]
    if missing:
        raise TypeError(f"mla_reduce_v1: missing required argument(s) {missing}")
    if not _is_int(bound["num_kv_splits"]) or bound["num_kv_splits"] < 0:
        raise ValueError(f"num_kv_splits: found {bound['num_kv_splits']!r}, expected an int >= 0")
    return bound




def aiter_mla_reduce_v1(*args, **kwargs) -> None:
    """Drop-in for `aiter.mla_reduce_v1` at framework call sites.

    Accepts the legacy 8-argument form (..., max_seqlen_q, final_output, final_lse) and the
    num_kv_splits 9-argument form (..., max_seqlen_q, num_kv_splits, final_output,
    final_lse), positionally or by keyword, told apart by argument 6 (int vs Tensor), and
    calls the installed AITER in its own convention.
    """
    bound = normalize_reduce_args(args, kwargs)
    status = probe_aiter()
    if not status.usable:
        raise RuntimeError(f"aiter_mla_reduce_v1: no usable AMD AITER here: {status.reason}")
    import aiter

    common = [bound[n] for n in LEGACY_ARGS[:6]]
    tail = [bound["final_output"], bound["final_lse"]]
    if status.reduce_convention == NEW:
        aiter.mla_reduce_v1(*common, bound["num_kv_splits"], *tail)
        _complete_single_pieces(bound)
        return
    splits = bound["num_kv_splits"]
    if splits:
        units = default_num_workers(bound["final_output"].device)  # the CU count on ROCm
        if splits > units:
            raise ValueError(
                f"num_kv_splits: found {splits}, but the installed AITER's mla_reduce_v1 predates "
                f"ROCm/aiter#3391 and sizes its split state to the CU count ({units}); upgrade AITER "
                "to v0.1.16 or later, or pass 0"
            )
    aiter.mla_reduce_v1(*common, *tail)
    _complete_single_pieces(bound)


# -- need_lse (ROCm/aiter#3606) on every AITER ---------------------------------------------


@dataclass(frozen=True)
class SinglePieces:
    """Tiles an AITER without #3606 would write straight to the output, routed through the
    partial buffers instead (one piece each), and where the reduce drop-in copies them:
    output row `out_rows[i]` <- partial row `partial_rows[i]` (int64, on the maps' device)."""

    out_rows: torch.Tensor
    partial_rows: torch.Tensor
    num_partial_tiles: int


#: id(reduce_indptr) -> (weak reference to it, its single pieces), set by
#: aiter_get_ps_metadata_v1(need_lse=True) on an AITER without need_lse and read by
#: aiter_mla_reduce_v1 (so both must be installed). Tensors compare elementwise, hence ids.
_single_pieces: dict[int, tuple[weakref.ref, SinglePieces]] = {}
_pieces_lock = threading.Lock()


def register_single_pieces(reduce_indptr: torch.Tensor, pieces: SinglePieces | None) -> None:
    key = id(reduce_indptr)
    with _pieces_lock:
        if pieces is None:
            _single_pieces.pop(key, None)
            return

        def forget(_ref, key=key):
            with _pieces_lock:
                entry = _single_pieces.get(key)
                if entry is not None and entry[0] is _ref:
                    del _single_pieces[key]

        _single_pieces[key] = (weakref.ref(reduce_indptr, forget), pieces)


def single_pieces(reduce_indptr: torch.Tensor) -> SinglePieces | None:
    entry = _single_pieces.get(id(reduce_indptr))
    return entry[1] if entry is not None and entry[0]() is reduce_indptr else None


def _complete_single_pieces(bound: dict) -> None:
    pieces = single_pieces(bound["reduce_indptr"])
    if pieces is None or pieces.out_rows.numel() == 0:
        return
    out, lse = bound["final_output"], bound["final_lse"]
    heads, dv = out.shape[-2], out.shape[-1]
    po = bound["partial_output"].reshape(-1, heads, dv)
    out.index_copy_(0, pieces.out_rows, po.index_select(0, pieces.partial_rows).to(out.dtype))
    if lse is not None:
        pl = bound["partial_lse"].reshape(-1, heads)
        lse.index_copy_(0, pieces.out_rows, pl.index_select(0, pieces.partial_rows).to(lse.dtype))


class NeedLseUnavailable(RuntimeError):
    """need_lse=True asked of an AITER without ROCm/aiter#3606, where it cannot be emulated."""


def route_unsplit_through_reduce(
    work_indptr: torch.Tensor,
    work_info: torch.Tensor,
    tile_q: int,
    capacity: tuple[int, int, int] | None = None,
):
    """What need_lse=True makes AITER's planner emit, from an older planner's output (host).

    Every item with `partial_o_loc == -1` (a tile one workgroup finishes, written straight
    to the output by the asm kernel) gets a partial slot of its own (`tile_q * index`, after
    the existing pieces; the same slot for every head of the tile, as AITER numbers pieces),
    and the reduce maps are rebuilt as AITER's generate_reduce_info builds them (groups
    sorted by (qo_start, qo_end), each group's slots sorted). Such an item has the shape of
    the last piece of a split tile (kv_offset 0), which the kernel already writes to the
    partial buffers. Returns (work_info, reduce_indptr, reduce_final_map,
    reduce_partial_map, out_rows, partial_rows) as host tensors, the maps unpadded, where
    (out_rows, partial_rows) are the rows a reduce must copy for the one-piece groups.
    `capacity` = (reduce_indptr, reduce_final_map rows, reduce_partial_map) sizes: a plan
    that does not fit raises NeedLseUnavailable.
    """
    n_items = int(work_indptr[-1])
    info = work_info.reshape(-1, 8)[:n_items].clone()
    if n_items == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return (info, torch.zeros(1, dtype=torch.int32), torch.zeros((0, 2), dtype=torch.int32),
                torch.zeros(0, dtype=torch.int32), empty, empty)
    loc = info[:, 1]
    pieces_before = torch.unique(loc[loc != -1]).numel()
    unsplit = loc == -1
    if bool(unsplit.any()):
        keys, inverse = torch.unique(info[unsplit][:, 2:4], dim=0, return_inverse=True)
        info[unsplit, 1] = (tile_q * (pieces_before + inverse)).to(torch.int32)
    triples = torch.unique(info[:, [2, 3, 1]], dim=0)  # sorted by (qo_start, qo_end, slot)
    groups, counts = torch.unique_consecutive(triples[:, :2], dim=0, return_counts=True)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    partial_map = triples[:, 2].contiguous()
    if capacity is not None:
        n_indptr, n_final, n_partial = capacity
        if indptr.numel() > n_indptr or groups.shape[0] > n_final or partial_map.numel() > n_partial:
            raise NeedLseUnavailable(
                f"{partial_map.numel()} partial tiles in {groups.shape[0]} groups, where the "
                f"buffers hold {n_partial} tiles and {min(n_indptr - 1, n_final)} groups"
            )
    single = counts == 1
    first = indptr[:-1].long()[single]
    q0, q1 = groups[single, 0].long(), groups[single, 1].long()
    lengths = (q1 - q0).clamp(min=0)
    offset = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    out_rows = torch.repeat_interleave(q0, lengths) + offset
    partial_rows = torch.repeat_interleave(partial_map[first].long(), lengths) + offset
    return info, indptr, groups.to(torch.int32), partial_map, out_rows, partial_rows


def aiter_get_ps_metadata_v1(*args, **kwargs) -> None:
    """Drop-in for `aiter.get_ps_metadata_v1` that takes `need_lse` on every AITER.

    - AITER with ROCm/aiter#3606 (its schema has need_lse): forwarded as given.
    - Older AITER, need_lse absent or False: forwarded without the keyword (the same plan).
    - Older AITER, need_lse=True (SGLang >= 0.5.22's chunked-prefix passes, which merge the
      final_lse of every row): the plan is made without it, then every tile the old planner
      writes straight to the output gets a partial slot of its own and a one-piece reduce
      group (`route_unsplit_through_reduce`); `aiter_mla_reduce_v1` copies those pieces, lse
      included, after AITER's reduce (which skips groups of one). So the caller's reduce
      call MUST go through `aiter_mla_reduce_v1` too. `reduce_indptr[-1]` counts the new
      pieces, so partial buffers sized from it (as SGLang does for need_lse) fit. Where the
      caller's buffers (sized by this AITER's get_ps_metadata_info_v1) cannot hold the extra
      pieces, it raises NeedLseUnavailable naming both releases and what to upgrade.
    The metadata is read back to the host for that rewrite (one sync, like the planner's own).
    """
    args = list(args)
    need_lse = kwargs.pop("need_lse", None)
    if len(args) > len(METADATA_ARGS):
        if need_lse is not None or len(args) > len(METADATA_ARGS) + 1:
            raise TypeError(f"get_ps_metadata_v1: found {len(args)} positional arguments, "
                            f"expected at most {len(METADATA_ARGS) + 1}")
        need_lse = args.pop()
    if need_lse is not None and not isinstance(need_lse, bool):
        raise TypeError(f"need_lse: found {type(need_lse).__name__}, expected bool")
    bound = _bind_args("get_ps_metadata_v1", METADATA_ARGS, METADATA_ARGS, args, kwargs)
    missing = [n for n in METADATA_ARGS[:11] if n not in bound]
    if missing:
        raise TypeError(f"get_ps_metadata_v1: missing required argument(s) {missing}")
    status = probe_aiter()
    if not status.is_amd_aiter or not status.metadata_kwargs:
        raise RuntimeError(f"aiter_get_ps_metadata_v1: no usable AMD AITER here: {status.reason}")
    import aiter

    register_single_pieces(bound["reduce_indptr"], None)
    if status.metadata_need_lse:
        if need_lse is not None:
            kwargs["need_lse"] = need_lse
        aiter.get_ps_metadata_v1(*args, **kwargs)
        return
    aiter.get_ps_metadata_v1(*args, **kwargs)
    if not need_lse:
        return
    qlen_granularity = int(bound.get("qlen_granularity", 256))
    host = {n: bound[n].cpu() for n in ("work_indptr", "work_info")}
    sizes = (bound["reduce_indptr"].numel(), bound["reduce_final_map"].numel() // 2,
             bound["reduce_partial_map"].numel())
    try:
        info, indptr, final, partial, out_rows, partial_rows = route_unsplit_through_reduce(
            host["work_indptr"], host["work_info"], qlen_granularity, sizes)
    except NeedLseUnavailable as exc:
        raise NeedLseUnavailable(
            f"get_ps_metadata_v1(need_lse=True): the installed {status.distribution or 'aiter'} "
            f"{status.version or '(version unknown)'} predates ROCm/aiter#3606 (first in "
            f"amd-aiter {NEED_LSE_RELEASE}), so mla-plugins routes the unsplit tiles through the "
            f"reduce itself, but this batch needs more than its planner's buffers hold ({exc}). "
            f"Upgrade amd-aiter to {NEED_LSE_RELEASE} or later, or use an SGLang release before "
            "0.5.22 (the first that passes need_lse)."
        ) from None
    n_items = int(host["work_indptr"][-1])
    work_info = bound["work_info"]
    work_info.view(-1, 8)[:n_items].copy_(info.to(work_info.device))
    padded = torch.full((sizes[0],), int(indptr[-1]), dtype=torch.int32)
    padded[: indptr.numel()] = indptr
    final_full = torch.zeros((sizes[1], 2), dtype=torch.int32)
    final_full[: final.shape[0]] = final
    partial_full = torch.zeros((sizes[2],), dtype=torch.int32)
    partial_full[: partial.numel()] = partial
    for name, value in (("reduce_indptr", padded), ("reduce_final_map", final_full),
                        ("reduce_partial_map", partial_full)):
        bound[name].copy_(value.view(bound[name].shape))
    device = bound["reduce_indptr"].device
    register_single_pieces(bound["reduce_indptr"], SinglePieces(
        out_rows.to(device), partial_rows.to(device), int(indptr[-1])))
