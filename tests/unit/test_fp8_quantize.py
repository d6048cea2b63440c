"""Quantize/dequantize against an independent float64 reference; scales; stochastic rounding; inf/NaN."""
from __future__ import annotations

import pytest
import torch

from megatron.fp8.formats import format_spec
from megatron.fp8.quantize import compute_scale, count_nonfinite, dequantize, quantize
from tests.support.fp8_reference import fp8_grid, reference_quantize


def _probe_values(fmt: str) -> torch.Tensor:
    """Random magnitudes over the whole range (subnormals to beyond max), exact midpoints (ties), specials."""
    g = torch.Generator().manual_seed(0)
    grid = fp8_grid(fmt)
    log_lo, log_hi = -20.0, 18.0
    mags = torch.exp2(torch.empty(20000, dtype=torch.float64).uniform_(log_lo, log_hi, generator=g))
    midpoints = (grid[1:] + grid[:-1]) / 2  # ties: RNE must pick the even code
    vals = torch.cat([mags, midpoints, grid, grid[-1] * torch.tensor([1.01, 1.5, 4.0, 1e6]),
                      torch.tensor([grid[1] / 2, grid[1] / 2 * 1.0001, grid[1] / 4])])
    signs = torch.where(torch.rand(len(vals), generator=g) < 0.5, -1.0, 1.0).double()
    # Every probe must be exactly representable in fp32, the dtype we feed to quantize().
    return (vals * signs).float().double()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_matches_float64_reference(fmt: str) -> None:
    spec = format_spec(fmt)
    x = _probe_values(fmt)
    q = quantize(x.float(), torch.tensor(1.0), spec)
    assert q.dtype == spec.torch_dtype
    got = q.double()
    want = reference_quantize(x, fmt)
    mismatches = (got != want).nonzero().flatten()
    assert len(mismatches) == 0, f"{len(mismatches)} mismatches, e.g. x={x[mismatches[:5]].tolist()} " \
                                 f"got={got[mismatches[:5]].tolist()} want={want[mismatches[:5]].tolist()}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturation_subnormals_and_flush_to_zero(fmt: str) -> None:
    spec = format_spec(fmt)
    one = torch.tensor(1.0)
    x = torch.tensor([spec.max * 4, -spec.max * 4, float("inf"), float("-inf"),
                      spec.min_subnormal * 3, spec.min_subnormal * 0.49, spec.min_subnormal * 0.5,
                      spec.min_subnormal * 0.51, float("nan")])
    got = quantize(x, one, spec).float()
    assert got[:4].tolist() == [spec.max, -spec.max, spec.max, -spec.max]  # clamp, never inf (even E5M2)
    assert got[4] == spec.min_subnormal * 3  # subnormals are kept exactly
    assert got[5] == 0 and got[6] == 0  # below / at half the smallest subnormal: flushed (tie to even 0)
    assert got[7] == spec.min_subnormal
    assert torch.isnan(got[8])  # NaN is not hidden by the clamp


def test_gaudi2_e4m3_saturates_at_240() -> None:
    spec = format_spec("e4m3", "hpu")
    x = torch.tensor([239.0, 300.0, -1e9])
    assert quantize(x, torch.tensor(1.0), spec).float().tolist() == [240.0, 240.0, -240.0]
    want = reference_quantize(x.double(), "e4m3", fp8_max=240.0)
    assert want.tolist() == [240.0, 240.0, -240.0]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scaled_round_trip_matches_reference(fmt: str) -> None:
    spec = format_spec(fmt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * 1e-3
    scale = compute_scale(x.abs().max(), spec.max)
    q = quantize(x, scale, spec)
    want = reference_quantize((x * scale).double(), fmt) / scale.double()
    assert torch.equal(dequantize(q, scale, torch.float64), want.float().double())
    # The scaled amax lands exactly on the format's max: the whole range is used, nothing clips.
    assert q.float().abs().max() == spec.max


def test_compute_scale_margin_power_of_two_and_safe_cases() -> None:
    amax = torch.tensor(3.0)
    assert compute_scale(amax, 448.0).item() == pytest.approx(448 / 3)
    assert compute_scale(amax, 448.0, margin=2).item() == pytest.approx(448 / 3 / 4)
    pow2 = compute_scale(amax, 448.0, power_of_two=True).item()
    assert pow2 == 128.0  # 149.3 rounded *down* to a power of two: amax * scale stays <= 448
    prev = torch.tensor(7.0)
    for bad in (0.0, float("inf"), float("nan")):
        assert compute_scale(torch.tensor(bad), 448.0, previous=prev).item() == 7.0
    assert compute_scale(torch.tensor(0.0), 448.0).item() == 1.0  # no previous scale: 1.0
    tiny = compute_scale(torch.tensor(1e-45), 448.0)
    assert torch.isfinite(tiny) and tiny > 0


@pytest.mark.parametrize("fmt, backend", [("e4m3", "cpu"), ("e5m2", "cpu"), ("e4m3", "gaudi2")])
@pytest.mark.parametrize("stochastic", [False, True])
def test_count_nonfinite_before_the_cast_hides_infinities(fmt: str, backend: str, stochastic: bool) -> None:
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), 2.0, 1e6, -1e6])
    nan, inf = count_nonfinite(x)
    assert (nan.item(), inf.item()) == (1, 2)
    spec = format_spec(fmt, backend)
    q = quantize(x, torch.tensor(1.0), spec, stochastic_rounding=stochastic).float()
    # Both formats saturate (E5M2's own cast would overflow to inf): +-inf and out-of-range values land
    # exactly on +-max, so after the cast only the count remembers the infinities; NaN stays NaN.
    m = spec.max
    assert q[[0, 4]].tolist() == [1.0, 2.0]
    assert q[[1, 2, 5, 6]].tolist() == [m, -m, m, -m], q
    assert torch.isnan(q[3])


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_stochastic_rounding_is_unbiased_and_on_grid(fmt: str) -> None:
    spec = format_spec(fmt)
    grid = fp8_grid(fmt)
    # A normal value between two grid points, a subnormal one, and a negative one.
    values = torch.tensor([1.1, -3.3, spec.min_subnormal * 2.3])
    n = 200_000
    x = values.repeat(n, 1)
    g = torch.Generator().manual_seed(0)
    q = quantize(x, torch.tensor(1.0), spec, stochastic_rounding=True, generator=g).double()
    for j, v in enumerate(values.double().tolist()):
        col = q[:, j]
        hi = torch.searchsorted(grid, torch.tensor(abs(v), dtype=torch.float64))
        neighbours = {grid[hi - 1].item() * (1 if v > 0 else -1), grid[hi].item() * (1 if v > 0 else -1)}
        assert set(col.unique().tolist()) <= neighbours
        step = (grid[hi] - grid[hi - 1]).item()
        sigma = step / 2 / n**0.5  # upper bound of the standard error of the mean
        assert abs(col.mean().item() - v) < 5 * sigma, (v, col.mean().item())
        # Round-to-nearest is biased here: its error is a sizeable fraction of the grid step.
        rne = quantize(values[j:j + 1], torch.tensor(1.0), spec).double().item()
        assert abs(rne - v) > 50 * sigma


def _random_fp32(n: int, seed: int) -> torch.Tensor:
    """n finite, nonzero fp32 values from uniformly random bit patterns: every binade, subnormals included."""
    bits = torch.randint(-2**31, 2**31, (4 * n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    return x[torch.isfinite(x) & (x != 0)][:n]


def test_fp64_division_gives_eager_fp32_bits():
    """What compiled CUDA code computes for a scale (`div_like_eager`): a quotient through fp64 is the correctly
    rounded fp32 quotient eager division gives, and a float over a tensor is eager's reciprocal-times-float."""
    from megatron.fp8.quantize import fp64_division

    a, b = _random_fp32(200_000, 1), _random_fp32(200_000, 2)
    assert torch.equal(fp64_division(a, b), a / b)
    for num in (1.0, 448.0, 57344.0, 448.0 / 2**3, 240.0):
        assert torch.equal(fp64_division(num, b), num / b), num
    assert torch.equal(fp64_division(1.0, b), b.reciprocal())
