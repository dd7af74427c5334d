"""The CLI as a user runs it: a fresh process, real entry points, exit codes."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def run_cli(*args):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "mla_plugins.cli", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_check_runs_every_available_kernel():
    proc = run_cli("check", "--heads", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "split tiles" in out and "kernels against float64" in out
    # one result row per mode (rows of the results table start "│ torch │ cpu"; the rejected
    # table's wrapped reasons may hold the word too)
    rows = re.findall(r"^│ torch\s+│ cpu\s+│ (fp8|bf16) ", out, flags=re.M)
    assert sorted(rows) == ["bf16", "fp8"], out
    assert "AITER is not installed" in out
    assert "every available kernel is inside tolerance" in out


def test_doctor_lists_entry_points():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "mla_plugins.vllm:register" in proc.stdout and "mla_plugins.sglang:register" in proc.stdout


def one_line_usage_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_check_bad_heads_is_one_line():
    one_line_usage_error(run_cli("check", "--heads", "0"), "--heads: found 0", "--heads 16")
    one_line_usage_error(run_cli("check", "--heads", "-4"), "--heads: found -4")


def test_check_unusable_devices_are_one_line():
    one_line_usage_error(run_cli("check", "--device", "meta"), "--device: found 'meta'", "pass --device cpu")
    one_line_usage_error(run_cli("check", "--device", "garbage"), "--device: found 'garbage'", "--device cpu")


def test_check_absent_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a GPU")
    one_line_usage_error(run_cli("check", "--device", "cuda"), "no CUDA or ROCm device", "pass --device cpu")


def test_reasons_keep_their_brackets(monkeypatch, capsys):
    """Rich markup must not eat "[triton]" out of a reason (issue 14)."""
    from mla_plugins import cli
    from mla_plugins.core.kernels.base import KernelInfo

    fake = [KernelInfo("torch", True), KernelInfo("triton", False, ["pip install 'mla-plugins[triton]'"])]
    monkeypatch.setattr(cli, "available_kernels", lambda device=None: fake)
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["doctor"]) == 0
    assert "mla-plugins[triton]" in capsys.readouterr().out


def test_triton_advice_per_platform(monkeypatch):
    import torch

    from mla_plugins.core import advice

    monkeypatch.setattr(torch.version, "hip", "6.4.43484", raising=False)
    hint = advice.triton_install_hint()
    assert "pytorch-triton-rocm" in hint and "rocm6.4" in hint and "not 'mla-plugins[triton]'" in hint
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)
    assert "bring a matching triton" in advice.triton_install_hint()
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)
    assert "CPU build" in advice.triton_install_hint()
