"""gluon_sync.lean_ptx on PTX shaped like Triton 3.6's: it removes the warpgroup barrier
before an mbarrier arrive or wait and keeps every barrier that orders a thread's own
shared-memory access, precedes other work or crosses a basic block (its stage hook:
tests/compile/test_gluon_sync.py, where Triton is installed)."""

from __future__ import annotations

from mla_plugins.core.kernels import gluon_sync as gs

PTX = """\
$L__BB0_12:                             // loop header
\tld.global.b32 \t%r1, [%rd1];
\tmov.b32 \t%r2, 1;
\t.loc\t1 483 39
\tbar.sync \t2, 128;
\t// begin inline asm
{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r3], %r4;
\t@!complete bra.uni waitLoop;
}
\t// end inline asm
\twgmma.wait_group.sync.aligned 0;
\tadd.s32 \t%r5, %r6, 189888;
$L__tmp7:
\tbar.sync \t2, 128;
\t@%p1 mbarrier.arrive.shared::cta.b64 _, [%r5];
\tst.shared.v4.b32 \t[%r7], {%r1, %r1, %r1, %r1};
\tfence.proxy.async.shared::cta;
\tbar.sync \t2, 128;
\twgmma.fence.sync.aligned;
\tst.shared.b32 \t[%r8], %r1;
\tbar.sync \t2, 128;
\t@%p1 mbarrier.arrive.shared::cta.b64 _, [%r9];
\tbar.sync \t2, 128;
$L__BB0_13:
\t@%p1 mbarrier.arrive.shared::cta.b64 _, [%r9];
\tbar.sync \t1, 256;
\t@%p1 mbarrier.arrive.shared::cta.b64 _, [%r9];
"""


def test_lean_ptx_removes_only_the_barriers_before_arrives_and_waits():
    lean, removed = gs.lean_ptx(PTX)
    before, after = PTX.splitlines(), lean.splitlines()
    assert len(before) == len(after)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    # the one before the wait (a directive and a register move between) and the one before
    # the arrive (a debug label between); not the one before a product, the one after a
    # thread's own shared store, the one before a new basic block, nor a 256-thread one
    assert removed == 2
    assert [before[i].strip() for i in changed] == ["bar.sync \t2, 128;"] * 2
    assert changed == [4, 16]
    assert all("bar.sync" not in after[i] for i in changed)
    assert lean.count("bar.sync") == PTX.count("bar.sync") - 2


def test_lean_ptx_leaves_ptx_without_those_barriers_unchanged():
    text = PTX.replace("mbarrier.arrive", "st.global").replace("mbarrier.try_wait", "ld.global")
    assert gs.lean_ptx(text) == (text, 0)
