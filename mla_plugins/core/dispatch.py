"""Which of the kernels that can run a batch is fastest for it: a dispatch table measured on
the device, committed with the benchmark that measured it.

`kernel="auto"` asks the registry for every kernel that can run the inputs; where a table
exists for the device (today: Hopper, `dispatch_h100.json` for H100s and `dispatch_h200.json`
for every other sm_90 GPU, each written by `benchmarks/prefill.py --dispatch-out` on that
card), the choice is the variant that measured fastest on
the measured shape nearest to the batch, nearest in log2 of its work (visible (query, key)
pairs times heads, the quantity every kernel's time grows with) and then in its mean query
length. A variant is (kernel, mode), fp8 measured with and without the rotation of q and k
(`fp8`, `fp8-plain`): an fp8 request may run in bf16 where bf16 measured
faster (short batches, where quantizing costs more than it saves; bf16 is more accurate
too); a bf16 request never runs in fp8. Without a table, or where the table measured none of
the candidates, the order is the kernels' priority. A pinned kernel never comes here.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from importlib import resources

import torch

logger = logging.getLogger("mla_plugins.dispatch")

#: compute capability -> ((device-name substring, table file in this package), ...): the first
#: whose substring the device's name holds; "" matches any card of that capability. The H100
#: and the H200 share sm_90 but not memory bandwidth (3.0 against 4.3 TB/s measured), which
#: moves the quantization's share of a batch, so a table measured on one is kept for it; each
#: file's "device" names the card it was measured on (tests/core/test_dispatch.py holds them to it).
TABLES = {(9, 0): (("H100", "dispatch_h100.json"), ("", "dispatch_h200.json"))}


@dataclass(frozen=True)
class Entry:
    shape: str
    work: float
    mean_q: float
    #: "kernel:mode" -> GPU microseconds (CUDA-graph replay)
    gpu_us: dict


@dataclass(frozen=True)
class Table:
    device: str
    source: str
    entries: tuple[Entry, ...]

    def nearest(self, work: float, mean_q: float) -> Entry | None:
        if not self.entries or work <= 0:
            return None
        lw, lq = math.log2(work), math.log2(max(mean_q, 1.0))
        return min(self.entries, key=lambda e: (abs(math.log2(e.work) - lw),
                                                abs(math.log2(max(e.mean_q, 1.0)) - lq)))


def parse_table(data: dict) -> Table:
    """A table from its JSON form (`benchmarks/prefill.py --dispatch-out`); raises ValueError
    naming what is malformed."""
    try:
        entries = tuple(
            Entry(str(e["shape"]), float(e["work"]), float(e["mean_q"]),
                  {str(k): float(v) for k, v in e["gpu_us"].items()})
            for e in data["entries"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"dispatch table: malformed entry ({type(exc).__name__}: {exc})") from exc
    if any(e.work <= 0 for e in entries):
        raise ValueError("dispatch table: an entry with work <= 0")
    return Table(str(data.get("device", "?")), str(data.get("source", "?")), entries)


@functools.lru_cache(maxsize=8)
def _load(filename: str) -> Table | None:
    try:
        text = resources.files("mla_plugins.core").joinpath(filename).read_text()
        return parse_table(json.loads(text))
    except (OSError, ValueError) as exc:  # a broken install: priority order, said once
        logger.warning("mla-plugins: dispatch table %s unreadable (%s); kernel='auto' takes the "
                       "kernels in priority order", filename, exc)
        return None


def table_file(capability: tuple[int, int], device_name: str) -> str | None:
    """The table file for a card of this capability and name (`TABLES`), or None."""
    for needle, filename in TABLES.get(tuple(capability), ()):
        if needle in device_name:
            return filename
    return None


@functools.lru_cache(maxsize=16)
def _file_for_index(index: int) -> str | None:
    props = torch.cuda.get_device_properties(index)
    return table_file((props.major, props.minor), props.name)


def table_for(device: torch.device) -> Table | None:
    """The committed table for this device, or None (CPU, ROCm, other GPUs)."""
    if device.type != "cuda" or torch.version.hip or not torch.cuda.is_available():
        return None
    name = _file_for_index(device.index if device.index is not None else torch.cuda.current_device())
    return _load(name) if name else None


def batch_work(cu_q, cu_k, heads: int, causal: bool) -> tuple[float, float]:
    """(visible (query, key) pairs * heads, mean query length) of a batch: bottom-right causal."""
    pairs = rows = seqs = 0
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
        q, k = q1 - q0, k1 - k0
        if q == 0:
            continue
        seqs += 1
        rows += q
        if not causal:
            pairs += q * k
            continue
        # row i sees min(k, max(0, i + 1 + k - q)) keys
        d = k - q
        first = max(0, -d)  # rows before this one see nothing
        if first >= q:
            continue
        lo, hi = first + 1 + d, q + d  # keys seen by the first and last such row (<= k)
        pairs += (lo + hi) * (q - first) // 2
    return float(pairs * heads), (rows / seqs if seqs else 0.0)


def mode_keys(fp8: bool, rotate: bool) -> tuple[str, ...]:
    """The table's keys for a mode, best first: "bf16"; fp8 with the rotation "fp8"; fp8
    without it "fp8-plain", else "fp8" (the rotated time bounds the plain one from above)."""
    if not fp8:
        return ("bf16",)
    return ("fp8",) if rotate else ("fp8-plain", "fp8")


def rank(table: Table | None, cu_q, cu_k, heads: int, causal: bool,
         variants: list[tuple[str, bool]], rotate: bool = True) -> list[tuple[str, bool]]:
    """`variants` [(kernel name, fp8)] fastest first by the table's nearest entry; the given
    order (priority) where the table has nothing to say. Variants the entry did not measure
    keep their priority order after the measured ones. `rotate`: fp8 rotates q and k (its
    own measured time)."""
    if table is None or len(variants) < 2:
        return variants
    work, mean_q = batch_work(cu_q, cu_k, heads, causal)
    entry = table.nearest(work, mean_q)
    if entry is None:
        return variants
    def key(item):
        index, (name, fp8) = item
        t = next((entry.gpu_us[f"{name}:{m}"] for m in mode_keys(fp8, rotate)
                  if f"{name}:{m}" in entry.gpu_us), None)
        return (0, t, index) if t is not None else (1, 0.0, index)
    ranked = [v for _, v in sorted(enumerate(variants), key=key)]
    return ranked


__all__ = ["TABLES", "Entry", "Table", "batch_work", "parse_table", "rank", "table_file", "table_for"]
