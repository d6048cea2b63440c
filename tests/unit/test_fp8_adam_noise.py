"""Fp8AdamW's stochastic-rounding noise (`counter_uniform`): exact integer arithmetic, the published hash bit for bit,
uniform, and unbiased rounding with it.

Gaudi's bridge computes int64 tensors in int32 unless PT_ENABLE_INT64_SUPPORT=1, so there the noise is computed in
int32 tensors whose every value stays in [0, 2**31) (the halves path, which these tests force on the CPU as Gaudi
takes it). The first test records every op under a dispatch mode and recomputes each one in int64 to show that no
value left that range; the Gaudi itself is only in tests/unit/test_gaudi.py. The CPU and CUDA compute the same hash in
int64, where no value reaches 2**63; both paths give the same bits.
Statistical bounds are set far in the tail (probability ~1e-9 for uniform random values), so they do not depend on
the machine: the noise is a function of integers, the same bits on every CPU.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.fp8.quantize import stochastic_round
from megatron.optimizer import fp8_state_quant
from megatron.optimizer.fp8_adam import Fp8AdamW
from megatron.optimizer.fp8_state_quant import counter_uniform, moment_format, u32_halves

CPU = torch.device("cpu")
N = 1 << 20
TAIL = 1e-9  # the probability a bound below leaves to uniform random values


class _IntegerAudit(TorchDispatchMode):
    """Records the dtype of every tensor an op takes or makes; for each op that makes an int32 tensor, recomputes it
    with its int32 inputs widened to int64 and records whether the results differ (an overflow) and the range; the
    least int64 value made."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()
        self.overflows: list[str] = []
        self.low, self.high = 0, 0
        self.low64 = 0  # the least int64 value made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        tensors = [t for t in (*args, *kwargs.values(), *outs) if isinstance(t, torch.Tensor)]
        self.dtypes.update(t.dtype for t in tensors)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.numel():
                wide = func(*[a.long() if isinstance(a, torch.Tensor) and a.dtype == torch.int32 else a
                              for a in args], **kwargs)
                if not torch.equal(wide.long(), t.long()):
                    self.overflows.append(str(func))
                self.low, self.high = min(self.low, int(t.min())), max(self.high, int(t.max()))
            elif isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.numel():
                self.low64 = min(self.low64, int(t.min()))
        return out


def _lowbias32(counter: int, key: int) -> float:
    """The reference in Python integers (exact at any size): Wellons' hash shape with the multipliers 0x21f0aaad and
    0x735a2d97, of ((counter mod 2**32) xor key), top 24 bits as a fraction."""
    mask = 0xFFFFFFFF
    x = (counter & mask) ^ key
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & mask
    x ^= x >> 15
    x = (x * 0x735A2D97) & mask
    x ^= x >> 15
    return (x >> 8) / 2**24


def _noise(numel: int, start: int, key: int) -> torch.Tensor:
    return counter_uniform(numel, u32_halves(start, CPU), u32_halves(key, CPU), CPU)


@pytest.fixture
def halves(monkeypatch):
    """The noise computed as on Gaudi: no device takes the int64 path."""
    monkeypatch.setattr(fp8_state_quant, "_INT64_DEVICES", frozenset())


def test_noise_is_computed_in_int32_without_overflow(halves) -> None:
    audit = _IntegerAudit()
    with audit:
        u = _noise(1 << 16, 2**32 - 1000, 0xFFFFFFFF)  # the counter wraps; every bit of the key set
    assert audit.dtypes <= {torch.int32, torch.float32}, audit.dtypes
    assert not audit.overflows, audit.overflows
    assert audit.low >= 0 and audit.high < 2**31
    assert u.dtype == torch.float32


@pytest.mark.parametrize("block_size", [0, 128])
def test_an_eager_fp8adamw_step_makes_no_int64_tensor(block_size: int, halves) -> None:
    """The whole update, not only the noise: nothing Gaudi would silently compute in int32."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 300))
    opt = Fp8AdamW([p], block_size=block_size)
    audit = _IntegerAudit()
    for _ in range(2):
        p.grad = torch.randn(64, 300)
        with audit:
            opt.step()
    assert torch.int64 not in audit.dtypes and not audit.overflows, (audit.dtypes, audit.overflows)


@pytest.mark.parametrize("start,key", [(0, 0), (123456789, 4000000000), (2**32 - 300, 0xFFFFFFFF),
                                       (65535, 65536), (2**31 - 100, 2**31)])
@pytest.mark.parametrize("int64", [True, False])
def test_noise_equals_the_hash_in_python_integers(start: int, key: int, int64: bool, monkeypatch) -> None:
    """Bit for bit on both paths, including a counter that wraps past 2**32 and keys with the top bit set."""
    if not int64:
        monkeypatch.setattr(fp8_state_quant, "_INT64_DEVICES", frozenset())
    got = _noise(600, start, key).tolist()
    assert got == [_lowbias32(start + i, key) for i in range(600)]


@pytest.mark.parametrize("compiled", [False, True])
def test_the_int64_path_gives_the_halves_bits_and_never_wraps(compiled: bool, monkeypatch) -> None:
    """The CPU's int64 hash equals the halves' (Gaudi's) on 2**18 counters from starts that wrap past 2**32 and keys
    with every bit set, eagerly and compiled; every int64 value it makes is non-negative (a product at or past 2**63
    would wrap negative)."""
    draw = torch.compile(counter_uniform, dynamic=False) if compiled else counter_uniform
    cases = [(0, 0), (2**32 - 1000, 0xFFFFFFFF), (123456789, 0x80000001)]
    with_int64 = [draw(1 << 18, u32_halves(a, CPU), u32_halves(k, CPU), CPU) for a, k in cases]
    monkeypatch.setattr(fp8_state_quant, "_INT64_DEVICES", frozenset())
    torch._dynamo.reset()
    in_halves = [draw(1 << 18, u32_halves(a, CPU), u32_halves(k, CPU), CPU) for a, k in cases]
    for a, b in zip(with_int64, in_halves):
        assert torch.equal(a, b)
    monkeypatch.setattr(fp8_state_quant, "_INT64_DEVICES", frozenset({"cpu"}))
    audit = _IntegerAudit()
    with audit:
        _noise(1 << 16, 2**32 - 1000, 0xFFFFFFFF)
    assert torch.int64 in audit.dtypes and audit.low64 >= 0


def test_noise_is_uniform_on_0_1() -> None:
    """Kolmogorov-Smirnov by the DKW inequality, P(D > eps) <= 2 exp(-2 n eps**2), plus 2**-24 for the noise being a
    multiple of 2**-24; chi-square on the top 8 bits and on the lowest 8 of the 24, 255 degrees of freedom, against
    the 1 - 1e-9 quantile (Wilson-Hilferty); consecutive elements uncorrelated within 6 standard errors."""
    u = _noise(N, 0, 0x5EED).double()
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    ranks = torch.arange(1, N + 1, dtype=torch.float64) / N
    s = torch.sort(u).values
    d = max(float((ranks - s).max()), float((s - (ranks - 1 / N)).max()))
    assert d < math.sqrt(math.log(2 / TAIL) / (2 * N)) + 2**-24, d
    k, z = 255, 6.0  # z: the standard normal's 1 - 1e-9 quantile (5.998)
    chi2_limit = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3  # ~415; the mean is 255
    integers = (u * 2**24).long()
    for bins in (integers >> 16, integers & 0xFF):
        counts = torch.bincount(bins, minlength=256).double()
        chi2 = float(((counts - N / 256) ** 2 / (N / 256)).sum())
        assert chi2 < chi2_limit, chi2
    serial = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])
    assert abs(serial) < 6 / math.sqrt(N), serial


def test_noise_is_keyed_and_positional() -> None:
    """A chunk drawn from its own start equals the same elements of a longer draw; another key is another stream
    (uncorrelated within 6 standard errors)."""
    n = 1 << 16
    u = _noise(n, 0, 12345)
    assert torch.equal(_noise(n - 1000, 1000, 12345), u[1000:])
    other = _noise(n, 0, 12346)
    assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 6 / math.sqrt(n)


@pytest.mark.parametrize("fraction", [2.0**-12, 0.1, 0.5, 0.9])
def test_stochastic_rounding_with_the_noise_is_unbiased(fraction: float) -> None:
    """E5M2 (v's format), between the neighbours 1.0 and 1.25: the mean of n rounded values is y within 6 standard
    errors (each rounds to a neighbour, variance f(1 - f) ulp**2) plus 2**-21 ulp (the noise is a multiple of
    2**-24 and y / ulp + noise is summed in fp32, spacing 2**-21 at [4, 8))."""
    grid, ulp, n = moment_format("e5m2"), 0.25, 1 << 18
    y = torch.full((n,), 1.0 + fraction * ulp, dtype=torch.float32)
    f = (float(y[0]) - 1.0) / ulp
    rounded = stochastic_round(y, grid, _noise(n, 0, 0xC0FFEE)).double()
    assert set(rounded.unique().tolist()) <= {1.0, 1.25}
    bound = 6 * ulp * math.sqrt(f * (1 - f) / n) + 2**-21 * ulp
    assert abs(float(rounded.mean()) - float(y[0])) <= bound, (float(rounded.mean()), float(y[0]), bound)
