"""gluon_sync.lean_compile: its stage hook installed for the duration only, chained to the
process's own hook, rewriting the Gluon attention kernel's PTX and no other kernel's, and
answering the argument-free call for a cache key that Triton releases after 3.6 make."""

from __future__ import annotations

import pytest

from mla_plugins.core.kernels import gluon_sync as gs
from tests.core.test_gluon_sync import PTX

pytestmark = pytest.mark.triton


def test_lean_compile_installs_its_hook_for_the_duration_chained():
    from triton import knobs

    calls = []
    old = knobs.runtime.add_stages_inspection_hook

    def previous(*args):
        calls.append("previous")
        return ("theirs", "abc") if not args else None

    knobs.runtime.add_stages_inspection_hook = previous
    try:
        with gs.lean_compile():
            hook = knobs.runtime.add_stages_inspection_hook
            assert hook is not previous
            stages = {"ptx": lambda src, metadata: (metadata.update(name=src), PTX)[1]}
            hook(None, stages, None, None, 90)
            assert calls == ["previous"]
            meta = {}
            assert stages["ptx"](gs.KERNEL_NAME, meta) == gs.lean_ptx(PTX)[0]
            assert meta["mla_plugins_barriers_removed"] == 2
            other = {}
            assert stages["ptx"]("another_kernel", other) == PTX
            assert "mla_plugins_barriers_removed" not in other
            # Triton after 3.6 asks the hook for a cache key with no arguments
            key, digest = hook()
            assert key.startswith("theirs") and gs._KEY in key and digest != "abc"
        assert knobs.runtime.add_stages_inspection_hook is previous
        assert gs._hook(None)()[0] == gs._KEY  # no earlier hook: its key alone
    finally:
        knobs.runtime.add_stages_inspection_hook = old
