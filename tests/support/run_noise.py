"""Bounds for comparing whole training runs (`pretrain_gpt.py` subprocesses) by the noise of the runs themselves.

Two runs of the same math that add their fp32 numbers in different orders (a data-parallel all-reduce against
gradient accumulation, two pipeline stages against one, two tensor shards against one matrix) differ by
rounding, which the training steps then amplify (Adam divides by sqrt(v)); how much depends on the CPU's
kernels (AVX-512 and AVX2 block their sums differently). So no constant measured on one CPU bounds it. A test
measures it instead with a *control*: one more run of the same math in yet another order (half the
micro-batch size and twice the accumulation steps, or two data-parallel ranks), and bounds the tested run's
difference from the reference by a small multiple of the control's. A real bug (a lost micro-batch, a
missing all-reduce, a wrong pipeline partition) moves a run by orders of magnitude more than rounding does.

Losses come from the log, printed with 7 significant digits (`%.6E`): two runs can print values one unit of the
last digit apart however close they are, and a control can print identical values. Hence the `printed_unit`
terms in the bound.
"""
from __future__ import annotations

import math

import torch

# Two equivalent summation orders give differences of the same kind and size (roundings of the same sums,
# grown by the same steps); which one is larger is chance. 4 x leaves room for that spread.
NOISE_FACTOR = 4.0


def printed_unit(value: float) -> float:
    """One unit in the last digit of `value` as the log prints it (`%.6E`)."""
    return 10.0 ** (math.floor(math.log10(abs(value))) - 6) if value else 0.0


def assert_losses_within_noise(tested: list[float], reference: list[float], control: list[float],
                               factor: float = NOISE_FACTOR) -> None:
    """|tested - reference| <= factor x (noise + unit) + unit at every logged value, where noise is the
    control's largest distance from the reference over the run: the true control difference is at most its
    printed one plus a unit, and the tested one prints at most a unit away from its true value."""
    assert len(tested) == len(reference) == len(control) and tested, (tested, reference, control)
    noise = max(abs(c - r) for c, r in zip(control, reference))
    for t, r in zip(tested, reference):
        unit = max(printed_unit(t), printed_unit(r))
        bound = factor * (noise + unit) + unit
        assert abs(t - r) <= bound, (abs(t - r), bound, noise, tested, reference, control)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (2-norms over all elements, float64; |b| floored at 1e-30)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def relative_error_all(a: dict, b: dict) -> float:
    """Relative error of all tensors of `a` together (one vector) against those of `b`, in `b`'s names."""
    return relative_error(torch.cat([a[n].reshape(-1).double() for n in b]),
                          torch.cat([b[n].reshape(-1).double() for n in b]))


def weight_errors(weights: dict, reference: dict) -> tuple[float, float]:
    """Relative error of all weights together (one vector), and of the worst tensor, against `reference`."""
    assert weights.keys() == reference.keys()
    return relative_error_all(weights, reference), max(relative_error(weights[k], reference[k]) for k in reference)


def assert_weights_within_noise(tested: dict, reference: dict, control: dict, factor: float = NOISE_FACTOR) -> None:
    """Final weights (exact fp32 from the checkpoints, no printing): both errors within factor x the control's."""
    err, noise = weight_errors(tested, reference), weight_errors(control, reference)
    assert noise[0] > 0, "the control computed in the reference's order: it measures no noise"
    assert err[0] <= factor * noise[0] and err[1] <= factor * noise[1], (err, noise)
