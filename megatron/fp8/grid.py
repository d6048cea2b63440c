"""FP8 rounding in float32 arithmetic: `y.to(fp8).float()` without the FP8 conversion, for compiled kernels.

Inductor's CPU code converts float32 to E5M2 and back through slow paths (2048 x 1408, 2 cores of an Intel Xeon with
AMX, torch 2.13: 4.9 ms for scale, clamp, E5M2 and back to bf16, against 0.54 ms for the same without the
rounding; E4M3 1.43 ms). The FP8 *values* an emulated GEMM multiplies need no FP8 tensor: rounding y to the
format's grid in float32 gives them, in vectorized adds and multiplies only (1.2 ms and 0.9 ms there).

For |y| at or above the smallest normal, Veltkamp's splitting with the constant 2^s + 1, s = 23 - (mantissa bits),
keeps the leading mantissa bits + 1 significant bits of y, rounded to nearest, ties to even:
    c = |y| (2^s + 1);  r = c - (c - |y|)
Below it, the format's subnormals are multiples of 2^-k; adding and subtracting 2^(23 - k) rounds to them (the sum
lies where float32's spacing is 2^-k; the subtraction is exact). The sign is copied back (so -0 stays -0). Only
correctly rounded float32 adds and multiplies are used (inductor's C++ is built with -ffp-contract=off and without
unsafe math: no fused multiply-add, no reassociation), so the result is the same on every IEEE machine; code that
may contract a multiply and an add into one FMA (Triton's) must not use it (fused.py uses it on CPU only). Checked
against torch's cast for every float32 of magnitude up to the format's largest value: the non-negative ones
eagerly, both signs compiled by inductor on CPU (about 2^31 values per format; `tests/unit/test_fp8_grid.py`
checks a sweep of every exponent's ties on each run). NaN stays NaN; the caller clamps to the format's range first,
as the cast path does (E4M3 has no infinity).
"""
from __future__ import annotations

import torch

# dtype: (s = 23 - mantissa bits, smallest normal, 2^(23 - k) for subnormals 2^-k apart)
_GRIDS = {
    torch.float8_e4m3fn: (20, 2.0**-6, 2.0**14),
    torch.float8_e5m2: (21, 2.0**-14, 2.0**7),
}


def has_grid(dtype: torch.dtype) -> bool:
    """Whether `fp8_grid` rounds to `dtype`'s values (E4M3 FN and E5M2)."""
    return dtype in _GRIDS


def fp8_grid(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`y.to(dtype).float()` for float32 `y` within `dtype`'s range, bitwise (module docstring)."""
    split, min_normal, subnormal_shift = _GRIDS[dtype]
    a = y.abs()
    c = a * (2.0**split + 1.0)
    rounded = torch.where(a < min_normal, (a + subnormal_shift) - subnormal_shift, c - (c - a))
    # copysign(where(...), y): the shape partition.py (`_grid_values`) finds these values by in a compiled graph.
    return torch.copysign(rounded, y)
