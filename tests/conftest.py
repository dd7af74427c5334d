"""Capability markers, turned into skips in one place.

    @pytest.mark.gpu     needs a CUDA or ROCm device
    @pytest.mark.fp8     needs float8 matmul support on that device (CUDA cc >= 8.9, or ROCm)
    @pytest.mark.triton  needs triton importable
"""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _has_gpu() -> bool:
    return torch.cuda.is_available()


def _has_fp8() -> bool:
    if not _has_gpu():
        return False
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability() >= (8, 9)


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


CAPABILITIES = {
    "gpu": (_has_gpu, "needs a CUDA or ROCm device"),
    "fp8": (_has_fp8, "needs fp8 support (CUDA compute capability >= 8.9, or ROCm)"),
    "triton": (_has_triton, "needs triton"),
}


def pytest_configure(config):
    for name, (_, why) in CAPABILITIES.items():
        config.addinivalue_line("markers", f"{name}: {why}")


def pytest_collection_modifyitems(config, items):
    verdicts = {}
    for item in items:
        for name, (probe, why) in CAPABILITIES.items():
            if name in item.keywords:
                if name not in verdicts:
                    verdicts[name] = probe()
                if not verdicts[name]:
                    item.add_marker(pytest.mark.skip(reason=why))
