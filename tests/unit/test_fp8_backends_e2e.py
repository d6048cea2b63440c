"""Both FP8 hardware backends trained end to end on the CPU: `scaled_mm` (torch._scaled_mm, which runs on the
CPU) and `hpu` (HpuBackend over stand-ins of Gaudi's ops, tests/support/fake_hpu.py). Each tracks the emulated backend.

The bound comes from the run itself: a backend that computes the same FP8 GEMMs may differ from the emulated
one by rounding (accumulation order; Gaudi2's E4M3 max of 240 moves every E4M3 scale), which is FP8 noise of
the size that separates the emulated FP8 run from BF16. So the mean |loss difference| to the emulated run must
stay within 5x the mean |FP8 - BF16| difference of the same steps: two independent FP8 noises add up to ~1.4x,
and an 8-step mean is itself a rough estimate (measured: scaled_mm 0.5x, hpu 1.9x). A layout error (wrong
transpose, a lost scale) is a different function and lands two orders of magnitude outside (the negative
control: ~500x).

The model is sized so that every GEMM needs padding to multiples of 16 on the CUDA path (hidden 72, FFN 200,
attention heads of 18) and every dgrad/wgrad passes transposed views; E5M2 gradients meet E4M3 operands.
"""
from __future__ import annotations

import pytest
import torch

import megatron.fp8.layer_state as layer_state
from megatron.arguments import parse_config
from megatron.fp8.backends import HpuBackend
from megatron.fp8.recipe import Fp8Backend
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv

from tests.support import fake_hpu

ITERS = 8
TRACKING = 5  # allowed mean |loss - emulated| in units of the run's mean |FP8 - BF16| (see above)
SHAPE = dict(hidden_size=72, ffn_hidden_size=200, train_iters=ITERS, eval_iters=0, lr_warmup_iters=0)


def _losses(*flags: str) -> list[float]:
    return pretrain(parse_config(tiny_argv("--bf16", *flags, **SHAPE))).losses


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    """(emulated FP8 losses, BF16 losses) of the same run."""
    return _losses("--fp8-format", "hybrid", "--fp8-backend", "emulated"), _losses()


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def _assert_tracks(losses: list[float], reference: tuple[list[float], list[float]]) -> None:
    emulated, bf16 = reference
    noise = _mean_abs_diff(emulated, bf16)
    assert noise > 0
    assert _mean_abs_diff(losses, emulated) <= TRACKING * noise, (losses, emulated, bf16)
    assert losses[-1] < losses[0] - 0.3  # and it learns


def test_scaled_mm_backend_trains_on_cpu_and_tracks_emulation(reference, monkeypatch) -> None:
    used = []
    real = layer_state.select_backend

    def spy(choice, device, scaling="delayed"):
        backend = real(choice, device, scaling)
        used.append(backend.name)
        return backend

    monkeypatch.setattr(layer_state, "select_backend", spy)
    _assert_tracks(_losses("--fp8-format", "hybrid", "--fp8-backend", "scaled_mm"), reference)
    assert used and set(used) == {"scaled_mm"}


def _hpu_run(monkeypatch, ops_patch=None) -> tuple[list[float], fake_hpu.FakeHpuOps]:
    ops = fake_hpu.install(monkeypatch)
    if ops_patch is not None:
        ops_patch(ops)
    backend = HpuBackend()
    real = layer_state.select_backend
    monkeypatch.setattr(layer_state, "select_backend",
                        lambda choice, device, scaling="delayed":
                        backend if Fp8Backend(choice) is Fp8Backend.HPU else real(choice, device, scaling))
    return _losses("--fp8-format", "hybrid", "--fp8-backend", "hpu"), ops


def test_hpu_backend_over_fake_gaudi_ops_tracks_emulation(reference, monkeypatch) -> None:
    losses, ops = _hpu_run(monkeypatch)
    _assert_tracks(losses, reference)
    # 8 FP8 linears x 3 GEMMs per micro-batch, all through the Gaudi ops.
    assert ops.calls.count("fp8_gemm_v2") >= 8 * 3 * ITERS
    assert ops.calls.count("cast_to_fp8_v2") >= 8 * 2 * ITERS


def test_a_layout_error_is_caught_by_the_bound(reference, monkeypatch) -> None:
    """Negative control: a Gaudi GEMM that ignores B's scale-inverse (a plausible integration bug)."""
    def drop_b_scale(ops):
        real = ops.fp8_gemm_v2
        ops.fp8_gemm_v2 = lambda a, ta, b, tb, d, dt, sa=None, sb=None, *rest: real(a, ta, b, tb, d, dt, sa, None, *rest)

    losses, _ = _hpu_run(monkeypatch, drop_b_scale)
    emulated, bf16 = reference
    assert _mean_abs_diff(losses, emulated) > 20 * TRACKING * _mean_abs_diff(emulated, bf16)


def test_the_ocp_limit_on_gaudi_is_caught(monkeypatch) -> None:
    """Negative control: the Gaudi backend scaling E4M3 to OCP's 448 instead of Gaudi2's 240 reaches the stand-in
    cast with values it would turn into inf, and the stand-in refuses them."""
    monkeypatch.setattr(HpuBackend, "format_backend", "cpu")
    with pytest.raises(AssertionError, match="beyond the Gaudi2 maximum 240"):
        _hpu_run(monkeypatch)


def test_the_stand_in_cast_rounds_as_documented() -> None:
    """Nearest-even is torch's own cast; stochastic rounding picks one of the two neighbouring FP8 values, with the
    probability that makes it unbiased."""
    ops = fake_hpu.FakeHpuOps()
    torch.manual_seed(0)
    x = torch.randn(4096) * 30
    nearest, _ = ops.cast_to_fp8_v2(x, None, False, False, torch.float8_e4m3fn)
    assert torch.equal(nearest.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
    lo, hi = fake_hpu._neighbours(x, torch.float8_e4m3fn)
    assert bool((lo <= x.abs()).all() and (x.abs() <= hi).all())
    value = torch.full((20000,), 10.3)  # between E4M3's 10 and 11: 30% up
    draws, _ = ops.cast_to_fp8_v2(value, None, True, False, torch.float8_e4m3fn)
    assert set(draws.float().unique().tolist()) == {10.0, 11.0}
    assert abs(float(draws.float().mean()) - 10.3) < 4 * (0.3 * 0.7 / 20000) ** 0.5


def test_selection_picks_the_gaudi_backend_for_hpu_devices(monkeypatch) -> None:
    """`select_backend` itself (the e2e run above routes CPU tensors to HpuBackend, having no hpu tensors): with
    habana_frameworks importable, an hpu device gets HpuBackend with `auto` and `hpu`, Gaudi2's E4M3 limit with it."""
    from megatron.fp8.backends import _make, backend_format_spec, select_backend

    fake_hpu.install(monkeypatch)
    _make.cache_clear()
    try:
        for choice in ("auto", "hpu"):
            backend = select_backend(choice, torch.device("hpu"))
            assert isinstance(backend, HpuBackend) and backend_format_spec(backend, "e4m3").max == 240.0
        with pytest.raises(ValueError, match="--fp8-backend hpu needs a Gaudi device"):
            select_backend("hpu", torch.device("cpu"))
    finally:
        _make.cache_clear()
