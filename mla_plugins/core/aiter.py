"""Binding AITER by what it registered, never by its version string.

`import aiter` registers `torch.ops.aiter.mla_reduce_v1`; `aiter.mla_reduce_v1` is a
`(*args, **kwargs)` forwarder, so only the op schema tells the conventions apart:
- legacy (before ROCm/aiter#3391, every v0.1.15.x included): 8 arguments;
- num_kv_splits (v0.1.16 and later): a required `SymInt num_kv_splits` after `max_seqlen_q`.
Version strings cannot tell them apart (v0.1.15.post3 is newer than v0.1.16 and lacks the
argument), so `probe_aiter` reads the schema, and `aiter_mla_reduce_v1` forwards whatever
a framework call site passes in the convention the installed AITER has.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import threading
from dataclasses import dataclass, field

import torch

from .device import default_num_workers, gcn_arch

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
    arch: str | None = None
    import_error: str | None = None
    reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.is_amd_aiter and self.reduce_convention in (LEGACY, NEW)

    def action(self) -> str:
        """What mla-plugins does with this AITER, for `doctor` and the adapters' log line."""
        if self.reduce_convention == NEW:
            return "forwards framework reduce calls with num_kv_splits (9 arguments)"
        if self.reduce_convention == LEGACY:
            return "forwards framework reduce calls without num_kv_splits (8 arguments)"
        if self.reduce_convention == UNKNOWN:
            return "leaves AITER unused: its mla_reduce_v1 schema is not one mla-plugins knows"
        return "uses its Triton/torch kernels; no AITER call sites to shim"


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


def _metadata_kwargs(aiter_module) -> tuple[str, ...]:
    schema = _op_schema("get_ps_metadata_v1")
    if schema is not None:
        return tuple(a.name for a in schema.arguments)
    fn = getattr(aiter_module, "get_ps_metadata_v1", None)
    if fn is None:
        return ()
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def _probe() -> AiterStatus:
    if importlib.util.find_spec("aiter") is None:
        return AiterStatus(
            installed=False,
            reason="AITER is not installed; mla-plugins runs its Triton or torch kernels instead.",
        )
    dist, version = _distribution_of("aiter")
    try:
        module = importlib.import_module("aiter")
    except Exception as exc:  # an ABI mismatch or a missing ROCm library: report it, verbatim
        text = f"{type(exc).__name__}: {exc}"
        return AiterStatus(
            installed=True,
            distribution=dist,
            version=version,
            import_error=text,
            reason=f"`import aiter` failed ({text}); fix or reinstall amd-aiter for this torch/ROCm, "
            "or uninstall it. mla-plugins runs its other kernels meanwhile.",
        )
    has_ops = hasattr(module, "mla_reduce_v1") or _op_schema("mla_reduce_v1") is not None
    if not has_ops and dist != "amd-aiter":
        return AiterStatus(
            installed=True,
            distribution=dist,
            version=version,
            reason=f"the installed `aiter` ({dist or 'unknown distribution'} {version or ''}".rstrip()
            + ") is the PyPI async-iterator package, not AMD's AITER (amd-aiter); it is ignored.",
        )
    common = dict(
        installed=True,
        is_amd_aiter=True,
        distribution=dist,
        version=version,
        prefill_op=hasattr(module, "mla_prefill_ps_asm_fwd"),
        metadata_kwargs=_metadata_kwargs(module),
        arch=gcn_arch(),
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
    bound = dict(zip(names, args, strict=False))  # fewer args than names: rest by keyword
    for key, value in kwargs.items():
        if key not in NUM_KV_SPLITS_ARGS:
            raise TypeError(f"mla_reduce_v1: unexpected keyword argument {key!r}")
        if key in bound:
            raise TypeError(f"mla_reduce_v1: got multiple values for argument {key!r}")
        bound[key] = value
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
