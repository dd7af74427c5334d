"""The Gluon attention kernel's PTX without the warpgroup rendezvous Triton puts before each
mbarrier arrive and wait (`TileConfig.lean_sync`).

Triton 3.6 lowers `mbarrier.arrive` to an arrive by one thread of the partition and its
membar pass puts a `bar.sync <id>, 128` (the partition's 128 threads) before it, and one
before the next `mbarrier.try_wait` as well: in the consumer's key loop that is two named
barriers per key block in fp8, three in 16-bit with split_kv (benchmarks/NOTES.md, stops 30
and 44). The stages they release are read only by the warpgroup's own `wgmma`s, which have
completed for the whole warpgroup once a thread's `wgmma.wait_group` returns, and a wait is
each thread's own; CUTLASS's `PipelineTmaAsync::consumer_release`, which FlashAttention-3
calls, arrives from one thread per warpgroup with no barrier before it. `lean_ptx` removes
exactly those barriers: a `bar.sync <id>, 128` whose next memory, synchronization or
control instruction, with only register arithmetic between, is an `mbarrier.arrive` or an
`mbarrier.try_wait`, and whose previous such instruction in its basic block is not a
thread's own shared-memory access (`ld.shared`, `st.shared`, `ldmatrix`, `stmatrix`, atomics:
what a rendezvous does order). Every other barrier stays.

The rewrite runs as a stage of Triton's compile (`knobs.runtime.add_stages_inspection_hook`,
installed by `lean_compile` only around a launch that asked for it, chained to any hook the
process had). The kernel takes `LEAN_SYNC` = `VERSION` as a constexpr, so the rewritten
kernel has a cache entry of its own, and a change of these rules (a new `VERSION`) one more;
Triton releases after 3.6 also call the hook without arguments for a cache key, which it
answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import re

#: the kernel whose PTX is rewritten (`gluon_attention.mla_prefill_gluon_kernel`)
KERNEL_NAME = "mla_prefill_gluon_kernel"
#: the rules' version, the kernel's LEAN_SYNC constexpr when on (0: off)
VERSION = 1
_KEY = f"mla_plugins.gluon_sync.v{VERSION}"

_BAR = re.compile(r"^\s*bar\.sync\s+\d+\s*,\s*128\s*;")
# what a rendezvous may order or what ends the straight line: memory, synchronization, control
_SYNC_OR_MEMORY = re.compile(
    r"\b(ld|st|atom|red|cp|wgmma|fence|bar|barrier|mbarrier|ldmatrix|stmatrix|bra|ret|call|"
    r"exit|trap|tcgen05)\.|\b(bra|ret|exit|trap)\b")
_THREAD_SHARED = re.compile(r"\b(ld|st|atom|red)\.shared\b|\b(ldmatrix|stmatrix)\b")
_RELEASE_OR_WAIT = re.compile(r"\bmbarrier\.(arrive|try_wait)\b")
_BLOCK_LABEL = re.compile(r"^\$L__BB\d+_\d+:")


def _instruction(line: str) -> str:
    """The line without its comment ('' for a comment, a directive or a debug label)."""
    text = line.split("//", 1)[0].strip()
    if not text or text.startswith(".") or text in ("{", "}") or re.match(r"^\$L__tmp\d+:$", text):
        return ""
    return text


def _neighbour(lines: list[str], indices) -> str | None:
    """The first memory, synchronization or control instruction among `lines[indices]`, in
    that order, before a basic block's label (None if there is none)."""
    for j in indices:
        if _BLOCK_LABEL.match(lines[j].strip()):
            return None
        text = _instruction(lines[j])
        if text and _SYNC_OR_MEMORY.search(text):
            return text
    return None


def lean_ptx(ptx: str) -> tuple[str, int]:
    """`ptx` without the barriers the module doc names, and how many were removed."""
    lines = ptx.splitlines(keepends=True)
    drop = []
    for i, line in enumerate(lines):
        if not _BAR.match(line):
            continue
        nxt = _neighbour(lines, range(i + 1, len(lines)))
        if nxt is None or not _RELEASE_OR_WAIT.search(nxt):
            continue
        prev = _neighbour(lines, range(i - 1, -1, -1))
        if prev is None or not _THREAD_SHARED.search(prev):
            drop.append(i)
    for i in drop:
        lines[i] = "\t// warpgroup barrier removed (mla_plugins.core.kernels.gluon_sync)\n"
    return "".join(lines), len(drop)


def _hook(previous):
    def hook(*args):
        if not args:
            # Triton after 3.6 calls the hook without arguments on each launch and compile for
            # a key that sets the kernels compiled under it apart: ours, after any earlier hook's
            key, digest = (previous() if previous is not None else ("", ""))
            return key + _KEY, hashlib.sha256((digest + _KEY).encode()).hexdigest()
        if previous is not None:
            previous(*args)
        stages = args[1]
        make_ptx = stages.get("ptx")
        if make_ptx is None:
            return

        def ptx_stage(src, metadata):
            ptx = make_ptx(src, metadata)
            if metadata.get("name") == KERNEL_NAME:
                ptx, removed = lean_ptx(ptx)
                metadata["mla_plugins_barriers_removed"] = removed
            return ptx

        stages["ptx"] = ptx_stage

    return hook


@contextlib.contextmanager
def lean_compile():
    """Within it, a compile of the Gluon attention kernel (its first launch with a given
    set of constexprs) takes `lean_ptx`; other kernels compile as they would."""
    from triton import knobs

    previous = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = _hook(previous)
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
