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
