"""Which phase-1 kernel a batch gets (triton_kernel.batch_config): the Gluon kernel only on
Hopper, in fp8 for batches of long query slices, in 16-bit for every batch; the rule's
arithmetic against brute force."""

from __future__ import annotations

import random

import pytest
import torch

from mla_plugins.core.kernels import triton_kernel as tk


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _brute(lens_q, lens_k, causal, rows=128):
    keys = []
    for q, k in zip(lens_q, lens_k, strict=True):
        for r0 in range(0, q, rows):
            last = min(r0 + rows, q) - 1
            keys.append(max(0, min(k, last + 1 + k - q)) if causal else k)
    return sum(keys) / len(keys) if keys else 0.0


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("causal", [True, False])
def test_mean_keys_per_slice_matches_brute_force(seed, causal):
    rng = random.Random(seed)
    lens_q = [rng.choice([0, 1, 64, 127, 128, 129, rng.randrange(1, 5000)]) for _ in range(rng.randrange(1, 6))]
    # k shorter than q too: early rows that see no key
    lens_k = [max(0, q + rng.randrange(-300, 3000)) for q in lens_q]
    got = tk.mean_keys_per_slice(_cu(lens_q), _cu(lens_k), causal)
    assert got == pytest.approx(_brute(lens_q, lens_k, causal))


def test_cpu_and_flag_keep_the_portable_kernel(monkeypatch):
    cu = _cu([16384])
    cpu = torch.device("cpu")
    assert tk.batch_config(cpu, True, cu, cu, True) == tk.default_config(cpu, True)
    assert tk.gluon_reasons(cpu)
    monkeypatch.setenv("MLA_PLUGINS_GLUON", "0")
    assert tk.gluon_reasons(cpu) == ["MLA_PLUGINS_GLUON is off"]


def test_gluon_only_for_long_slices(monkeypatch):
    """With the device checks passed, the length rule alone decides in fp8; 16-bit takes the
    Gluon kernel one CTA per unit at every length (stop 28's measurement)."""
    monkeypatch.setattr(tk, "gluon_reasons", lambda device: [])
    monkeypatch.setattr(tk, "device_kind", lambda device: "cuda")
    dev = torch.device("cpu")
    long_cu, short_cu = _cu([8192]), _cu([512] * 16)
    assert tk.batch_config(dev, True, long_cu, long_cu, True) is tk.GLUON_FP8_CONFIG
    assert tk.batch_config(dev, True, short_cu, short_cu, True) == tk.FP8_CONFIG
    # one sequence of 1024 (mean keys ~580): short slices; one of 2048 (~1090) or eight: the
    # Gluon kernel, one CTA per unit
    assert tk.batch_config(dev, True, _cu([1024]), _cu([1024]), True) == tk.FP8_CONFIG
    assert tk.batch_config(dev, True, _cu([2048]), _cu([2048]), True) is tk.GLUON_FP8_CONFIG
    assert tk.batch_config(dev, True, _cu([2048] * 8), _cu([2048] * 8), True) is tk.GLUON_FP8_CONFIG
    for cu in (long_cu, short_cu, _cu([2048] * 8), _cu([1])):
        assert tk.batch_config(dev, False, cu, cu, True) is tk.GLUON_BF16_CONFIG
    # a short query over a long cached prefix: long slices
    assert tk.batch_config(dev, True, _cu([512]), _cu([8192]), True) is tk.GLUON_FP8_CONFIG
    # the persistent form only where its threshold is set (as the GPU tests' gluon-persistent
    # does), and only for several sequences
    monkeypatch.setattr(tk, "GLUON_PERSISTENT_MIN_MEAN_KEYS", 0)
    several = tk.batch_config(dev, True, _cu([2048] * 8), _cu([2048] * 8), True)
    assert several.gluon and several.persistent and not several.q_tma
    assert tk.batch_config(dev, True, long_cu, long_cu, True) is tk.GLUON_FP8_CONFIG
