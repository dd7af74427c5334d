"""pytest plugin: run part I of N of the collected tests, `MLA_TEST_PART=I/N` (1-based, in
collection order), so that the GPU suite, which outlasts one device call on a cold machine
(Triton compiles), runs whole over N calls. Without the variable it does nothing.

    MLA_TEST_PART=2/2 PYTHONPATH=.:benchmarks python -m pytest -p pytest_part tests/gpu ...
"""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items):
    part = os.environ.get("MLA_TEST_PART")
    if not part:
        return
    try:
        i, n = (int(x) for x in part.split("/"))
        if not 1 <= i <= n:
            raise ValueError
    except ValueError:
        raise ValueError(f"MLA_TEST_PART: found {part!r}, expected I/N with 1 <= I <= N") from None
    lo, hi = len(items) * (i - 1) // n, len(items) * i // n
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]
