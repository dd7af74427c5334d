"""Lets PyPI's torchvision import next to the CPU torch of the test environment.

SGLang 0.5.23 imports `torchvision.transforms` on every path we test
(`attention_registry` -> `sglang.srt.configs` -> `internvl_utils`). No torchvision CPU build
for torch 2.13 is reachable here: PyPI's `torchvision==0.28.0` links `libtorch_cuda.so`, so
its `_C` ops never load, and its `_meta_registrations` then fails on
`register_fake("torchvision::nms")` ("operator torchvision::nms does not exist").
Declaring those ops' schemas (no kernel) before torchvision imports lets its pure-Python
modules load; nothing here calls a torchvision op. The nox session puts this folder on
PYTHONPATH, so every process it starts (pytest, SGLang's spawned schedulers) gets it.
"""

import importlib.abc
import sys


class _DeclareTorchvisionNms(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision._meta_registrations":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = None
        for name, schema in _SCHEMAS.items():
            try:
                getattr(torch.ops.torchvision, name).default  # noqa: B018 (a real build has it)
            except (AttributeError, RuntimeError):
                lib = lib or torch.library.Library("torchvision", "FRAGMENT")
                lib.define(schema)
        if lib is not None:
            _keep.append(lib)
        return None


_keep = []
# The two ops `_meta_registrations` registers fakes for unconditionally (torchvision 0.28).
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
sys.meta_path.insert(0, _DeclareTorchvisionNms())


def _log_plans() -> None:
    """MLA_PLUGINS_TEST_PLAN_LOG=<file>: every plan our SGLang backend builds, one JSON line
    (pid and the debug record's arguments: batch number, forward method, call, kernel),
    from whichever process builds it (SGLang's spawned scheduler included)."""
    import os

    path = os.environ.get("MLA_PLUGINS_TEST_PLAN_LOG")
    if not path:
        return
    import json
    import logging

    class _Lines(logging.Handler):
        def emit(self, record):
            if not str(record.msg).startswith("mla_plugins plan:"):
                return
            line = json.dumps({"pid": os.getpid(), "args": [str(a) for a in record.args]}) + "\n"
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    log = logging.getLogger("mla_plugins.sglang.backend")
    log.setLevel(logging.DEBUG)
    log.addHandler(_Lines(logging.DEBUG))
    log.propagate = False  # SGLang's root handler would print every debug line


_log_plans()
