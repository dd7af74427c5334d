"""The PTX of the Gluon fp8 softmax's exponential on the FMA pipe (`gluon_attention.exp2_asm`),
read line by line and carried out here in float32 by a small interpreter of the seven PTX
instructions it uses (their rounding written from the PTX ISA: .rn to nearest, .rm toward
-inf, .ftz flushing subnormal inputs and results of ex2), so a wrong constant, operand order
or magic number in the text fails here, on the CPU, before a GPU runs it."""

from __future__ import annotations

import math
import re
import struct

import pytest
import torch

from mla_plugins.core.kernels import gluon_attention as ga


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def _round_down(v: float) -> float:
    """v (exact in float64 here) rounded to float32 toward -inf."""
    r = _f32(v)
    if r > v:
        r = float(torch.nextafter(torch.tensor(r, dtype=torch.float32),
                                  torch.tensor(-math.inf, dtype=torch.float32)))
    return r


def _literal(tok: str, regs: dict):
    tok = tok.strip()
    if tok.startswith("0f"):
        return _from_bits(int(tok[2:], 16))
    if re.fullmatch(r"-?\d+", tok):
        return int(tok)
    return regs[tok]


def run_asm(text: str, inputs: list[float]) -> list[float]:
    """Carry out `text` with $n.. bound to `inputs` (float32); returns $0..$(n-1)."""
    n = len(inputs)
    regs: dict = {f"${n + i}": _f32(x) for i, x in enumerate(inputs)}
    for line in text.split("\n"):
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        m = re.fullmatch(r"([\w.]+)\s+(.*);", line)
        assert m, f"unparsed PTX line: {line!r}"
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        dst, src = args[0], [_literal(a, regs) for a in args[1:]]
        if op == "ex2.approx.ftz.f32":
            x = src[0]
            v = 0.0 if x == -math.inf else _f32(2.0 ** x) if x < 128 else math.inf
            regs[dst] = 0.0 if abs(v) < 2.0 ** -126 else v  # ftz: a subnormal result is 0
        elif op == "max.f32":
            a, b = src
            regs[dst] = b if math.isnan(a) else a if math.isnan(b) else max(a, b)
        elif op == "add.rm.f32":
            regs[dst] = _round_down(src[0] + src[1])
        elif op == "sub.f32":
            regs[dst] = _f32(src[0] - src[1])
        elif op == "fma.rn.f32":
            regs[dst] = _f32(src[0] * src[1] + src[2])
        elif op == "mov.b32":
            v = src[0]
            regs[dst] = _bits(v) if isinstance(v, float) and not dst.startswith("$") else v
            if dst.startswith("$") and isinstance(v, int):
                regs[dst] = _from_bits(v)
        elif op == "mad.lo.u32":
            regs[dst] = (src[0] * src[1] + src[2]) & 0xFFFFFFFF
        else:
            raise AssertionError(f"exp2_asm uses an instruction this test does not know: {op}")
    return [regs[f"${i}"] for i in range(n)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_first_values_by_mufu_last_by_polynomial(n):
    text = ga.exp2_asm(n)
    mufu = re.findall(r"ex2\.approx\.ftz\.f32 \$(\d+), \$(\d+);", text)
    assert [(int(o), int(i)) for o, i in mufu] == [(i, n + i) for i in range(n - 1)]
    gen = torch.Generator().manual_seed(n)
    xs = (torch.rand(n, generator=gen) * -20).tolist()
    out = run_asm(text, xs)
    for i, x in enumerate(xs):
        assert out[i] == pytest.approx(2.0 ** _f32(x), rel=1e-6 if i < n - 1 else 1e-4)


def test_polynomial_against_float64_over_the_softmax_range():
    """Fresh random exponents over what the softmax hands it (P_SHIFT above the row max down
    to far below it), integers and their neighbours (the floor's edges), -inf."""
    gen = torch.Generator().manual_seed(36)
    xs = (torch.rand(3000, generator=gen, dtype=torch.float64) * 160 - 150).float().tolist()
    edges = [float(k) + d for k in range(-130, 9) for d in (0.0, -2 ** -20, 2 ** -20)]
    worst = 0.0
    for x in xs + edges:
        x = _f32(x)
        got = run_asm(ga.exp2_asm(2), [0.0, x])[1]
        want = 2.0 ** x
        if x >= -126:
            worst = max(worst, abs(got / want - 1))
        else:  # below the normal range: a value no larger than the smallest normal
            assert 0.0 <= got <= 2.0 ** -126, (x, got)
    assert worst < 1e-4, worst


def test_minus_inf_gives_exactly_zero_and_nan_gives_zero():
    """A masked score (-inf) must add exactly nothing; a NaN gives 0 by design (the module's
    docstring: NaN reaches fp8 scores only through a scale, which a MUFU value carries)."""
    out = run_asm(ga.exp2_asm(2), [-math.inf, -math.inf])
    assert out[0] == 0.0 and _bits(out[1]) == 0
    assert run_asm(ga.exp2_asm(2), [0.0, math.nan])[1] == 0.0


def test_pack_of_one_refused():
    with pytest.raises(ValueError, match="exp2_asm: found n=1"):
        ga.exp2_asm(1)
