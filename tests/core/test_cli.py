"""The CLI as a user runs it: a fresh process, real entry points, exit codes."""

from __future__ import annotations

import os
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
    assert out.count("│ torch ") == 2 and "fp8" in out and "bf16" in out
    assert "AITER is not installed" in out
    assert "every available kernel is inside tolerance" in out


def test_doctor_lists_entry_points():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "mla_plugins.vllm:register" in proc.stdout and "mla_plugins.sglang:register" in proc.stdout
