"""The emulated FP8 GEMM rounds its bf16 output once, as the hardware does (fp32 accumulator x scales -> bf16).

The check is exact and order-free: for every output whose float64 value lies farther from a bf16 rounding
boundary than the worst-case error of *any* fp32 accumulation order (gamma_K * sum |a_k b_k|, the classic
summation bound) plus the scale arithmetic, a correctly rounded result is determined, so the backend must
produce exactly bf16(float64 value). Outputs inside that band are skipped. This holds on every CPU and ISA
(the summation order does not matter), and a GEMM rounded to bf16 before the scales are divided out fails it
on about a quarter of the outputs.
"""
from __future__ import annotations

import pytest
import torch

from megatron.fp8.backends import EmulatedBackend
from megatron.fp8.formats import format_spec
from megatron.fp8.quantize import quantize

U32 = 2.0**-24  # unit roundoff of fp32


def _bf16_boundary_distance(r: torch.Tensor) -> torch.Tensor:
    """Distance (float64) from r to the nearest point where rounding to bf16 changes (a midpoint)."""
    lo = r.to(torch.bfloat16).double()
    # The two bf16 neighbours around r: the rounded value and the next one away from it on r's side.
    step_up = torch.nextafter(lo.to(torch.bfloat16), torch.full_like(lo, float("inf")).to(torch.bfloat16)).double()
    step_dn = torch.nextafter(lo.to(torch.bfloat16), torch.full_like(lo, float("-inf")).to(torch.bfloat16)).double()
    return torch.minimum((r - (lo + step_up) / 2).abs(), (r - (lo + step_dn) / 2).abs())


def _operands(scale_a: float, scale_b: float, m: int = 128, k: int = 64, n: int = 96):
    g = torch.Generator().manual_seed(7)
    e4m3 = format_spec("e4m3", "cpu")
    a = torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g) * 0.05
    sa, sb = torch.tensor(scale_a), torch.tensor(scale_b)
    return quantize(a, sa, e4m3), sa, quantize(b, sb, e4m3), sb


@pytest.mark.parametrize("scales,pow2", [((37.3, 811.7), False), ((32.0, 1024.0), True), ((32.0, 1024.0), False)],
                         ids=["arbitrary", "pow2-bf16-gemm", "pow2-fp32-gemm"])
def test_bf16_output_is_rounded_once(scales: tuple[float, float], pow2: bool) -> None:
    qa, sa, qb, sb = _operands(*scales)
    out = EmulatedBackend().gemm_nt(qa, sa, qb, sb, torch.bfloat16, pow2_scales=pow2)
    a64, b64 = qa.double() / sa.double(), qb.double() / sb.double()
    exact = a64 @ b64.t()
    k = qa.shape[1]
    gamma = k * U32 / (1 - k * U32)
    # Accumulation (any order) + product of the two fp32 scales + the division: each a relative error <= U32.
    err = gamma * (a64.abs() @ b64.abs().t()) + 3 * U32 * exact.abs()
    determined = _bf16_boundary_distance(exact) > err
    assert determined.float().mean() > 0.9  # the band is thin at K = 64: nearly every output is checked
    wrong = (out.double() != exact.to(torch.bfloat16).double()) & determined
    assert int(wrong.sum()) == 0, f"{int(wrong.sum())} of {int(determined.sum())} outputs rounded twice"


def test_double_rounding_is_what_the_check_catches() -> None:
    """Negative control: bf16 GEMM, then divide and cast again, at non-power-of-two scales."""
    qa, sa, qb, sb = _operands(37.3, 811.7)
    twice = ((qa.to(torch.bfloat16) @ qb.to(torch.bfloat16).t()).float() / (sa * sb)).to(torch.bfloat16)
    a64, b64 = qa.double() / sa.double(), qb.double() / sb.double()
    exact = a64 @ b64.t()
    assert (twice.double() != exact.to(torch.bfloat16).double()).float().mean() > 0.05
