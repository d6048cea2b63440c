"""megatron/fp8/grid.py: FP8 rounding in float32 arithmetic equals torch's cast, bit for bit.

Around every rounding decision of each format: for each float32 exponent from below the smallest subnormal up to
the format's largest value, the grid points, the midpoints between them (the ties, where round-to-nearest-even
decides) and their float32 neighbours, plus random mantissas; with both signs, zeros and NaN. The arithmetic is
correctly rounded IEEE float32 adds and multiplies, so what holds here holds on any machine (the module docstring
names the exhaustive check). tests/unit/test_fp8_fused.py compares the compiled quantization, which uses it.
"""
from __future__ import annotations

import pytest
import torch

from megatron.fp8.grid import fp8_grid, has_grid

FORMATS = {torch.float8_e4m3fn: (3, 448.0), torch.float8_e5m2: (2, 57344.0)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _around_every_decision(dtype: torch.dtype) -> torch.Tensor:
    mantissa_bits, top = FORMATS[dtype]
    g = torch.Generator().manual_seed(0)
    values = []
    for exponent in range(-30, 17):
        base = 2.0**exponent
        steps = torch.arange(2 ** (mantissa_bits + 1) + 1, dtype=torch.float64) / 2 ** (mantissa_bits + 1)
        points = (base * (1 + steps)).float()  # grid points and the ties between them
        below, above = torch.nextafter(points, torch.zeros_like(points)), torch.nextafter(points, points * 2)
        noise = (base * (1 + torch.rand(256, generator=g, dtype=torch.float64))).float()
        values += [points, below, above, noise]
    x = torch.cat(values)
    x = x[x <= top]
    return torch.cat([x, -x, torch.tensor([0.0, -0.0, top, -top, float("nan")])])


@pytest.mark.parametrize("dtype", list(FORMATS), ids=["e4m3", "e5m2"])
def test_the_float32_rounding_is_the_cast_bit_for_bit(dtype) -> None:
    assert has_grid(dtype)
    y = _around_every_decision(dtype)
    want = y.to(dtype).float()
    got = fp8_grid(y, dtype)
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(got))
    different = _bits(got)[~nan] != _bits(want)[~nan]
    assert not different.any(), list(zip(y[~nan][different][:5].tolist(), got[~nan][different][:5].tolist(),
                                         want[~nan][different][:5].tolist()))


def test_other_formats_have_no_grid() -> None:
    assert not has_grid(torch.float8_e4m3fnuz) and not has_grid(torch.bfloat16)
