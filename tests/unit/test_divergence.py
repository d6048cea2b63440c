"""The divergence guard (megatron/training/divergence.py): runs that explode without a NaN stop before saving."""
import math
import statistics

import pytest
import torch

from megatron.checkpoint import store as ckpt
from megatron.config import DivergenceConfig
from megatron.training.divergence import DivergenceGuard

WARMUP = 5


def _feed(guard: DivergenceGuard, losses, start: int = 1, grad_norm: float = 1.0) -> None:
    for i, loss in enumerate(losses, start):
        guard.observe(i, loss, grad_norm)


def _trained_losses(n: int) -> list[float]:
    return [3.0 + 0.5 * math.exp(-i / 20) + 0.05 * math.sin(i) for i in range(n)]  # a noisy decreasing curve


def test_a_2x_spike_that_recovers_does_not_stop_the_run():
    guard = DivergenceGuard(DivergenceConfig(patience=20), WARMUP)
    base = _trained_losses(60)
    _feed(guard, base)
    spike = [2.0 * base[-1]] * 30  # twice the loss for 30 iterations (longer than the patience)
    _feed(guard, spike, start=61)
    assert guard.reason is None and guard.healthy
    _feed(guard, base[-20:], start=91)
    assert guard.reason is None and guard.healthy


def test_a_short_3x_spike_pauses_saving_and_a_sustained_one_stops():
    guard = DivergenceGuard(DivergenceConfig(patience=20), WARMUP)
    _feed(guard, _trained_losses(60))
    _feed(guard, [9.5] * 5, start=61)
    assert guard.reason is None and not guard.healthy  # a checkpoint now would be mid-spike
    _feed(guard, [3.1], start=66)
    assert guard.healthy  # recovered
    _feed(guard, [9.5] * 19, start=67)
    assert guard.reason is None
    _feed(guard, [9.5], start=86)
    assert guard.reason is not None and "--divergence-patience 20" in guard.reason and "iteration 86" in guard.reason


def test_spike_losses_stay_out_of_the_running_median():
    """The median is taken over healthy losses only: losses above the threshold must not enter the history, or a
    sustained spike raises its own reference level until it no longer counts as a spike. With a window of 10
    healthy losses of 3.0 and spikes of 8.0 (> 2.5 x 3.0 = 7.5), a history that took in the spikes would hold five
    of them after five iterations, its median would become (3 + 8) / 2 = 5.5, the threshold 13.75, and the sixth
    spike would count as healthy."""
    guard = DivergenceGuard(DivergenceConfig(window=10, patience=10), WARMUP)
    _feed(guard, [3.0] * 20)
    for i in range(21, 30):  # nine spikes: one short of the patience
        guard.observe(i, 8.0, 1.0)
        assert guard.reason is None and not guard.healthy, f"iteration {i}: the spike no longer counts as one"
        assert statistics.median(guard.history) == 3.0
    guard.observe(30, 8.0, 1.0)
    assert guard.reason is not None and "running median (3.0000)" in guard.reason and "iteration 30" in guard.reason
    guard = DivergenceGuard(DivergenceConfig(window=10, patience=20), WARMUP)
    _feed(guard, [3.0] * 20)
    _feed(guard, [8.0] * 5, start=21)  # a spike that recovers
    _feed(guard, [3.1], start=26)
    assert guard.healthy
    guard.observe(27, 8.0, 1.0)  # the reference is still 3.0: the next 8.0 is still a spike
    assert not guard.healthy


def test_the_loss_rule_waits_for_warm_up_and_a_history():
    guard = DivergenceGuard(DivergenceConfig(patience=1, window=100), warmup_iters=50)
    _feed(guard, [10.0, 9.0, 30.0])  # early training is allowed anything
    assert guard.reason is None
    guard = DivergenceGuard(DivergenceConfig(patience=1), warmup_iters=0)
    _feed(guard, [3.0] * 9 + [30.0])  # fewer than 10 losses of history: no median yet
    assert guard.reason is None
    _feed(guard, [30.0], start=11)
    assert guard.reason is not None


def test_a_gradient_norm_stuck_at_zero_stops_the_run():
    guard = DivergenceGuard(DivergenceConfig(zero_grad_iters=10), WARMUP)
    _feed(guard, [4.85] * 9, grad_norm=0.0)
    assert guard.reason is None and not guard.healthy
    _feed(guard, [4.85], start=10, grad_norm=0.0)
    assert "exactly 0 for 10 iterations" in guard.reason
    guard = DivergenceGuard(DivergenceConfig(zero_grad_iters=10), WARMUP)
    _feed(guard, [4.85] * 9, grad_norm=0.0)
    _feed(guard, [4.85], start=10, grad_norm=1e-12)  # any gradient at all resets the count
    _feed(guard, [4.85] * 9, start=11, grad_norm=0.0)
    assert guard.reason is None


def test_exploded_weights_stop_the_run_and_name_the_flag():
    guard = DivergenceGuard(DivergenceConfig(), WARMUP)
    guard.observe_weights(0, 3.0)
    assert guard.reason is None
    guard.observe_weights(0, 4.2e6)
    assert "at initialization" in guard.reason and "--init-method-std" in guard.reason
    guard = DivergenceGuard(DivergenceConfig(), WARMUP)
    guard.observe_weights(7, float("nan"))
    assert "iteration 7" in guard.reason


def test_disabled_guard_never_stops():
    guard = DivergenceGuard(DivergenceConfig(enabled=False, patience=1, zero_grad_iters=1), 0)
    _feed(guard, [3.0] * 20 + [300.0] * 5, grad_norm=0.0)
    guard.observe_weights(0, 1e30)
    assert guard.reason is None and guard.healthy


@pytest.mark.parametrize("field, value, flag", [("loss_factor", 1.0, "--divergence-loss-factor"),
                                                ("patience", 0, "--divergence-patience"),
                                                ("max_weight", 0.0, "--divergence-max-weight")])
def test_config_validates_itself(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        DivergenceConfig(**{field: value})


def test_a_checkpoint_saved_while_diverging_is_skipped_on_resume(tmp_path, caplog):
    for iteration, healthy in ((2, True), (4, False)):
        ckpt.save_checkpoint(tmp_path, iteration, {"model": {"w": torch.full((2,), float(iteration))}},
                             {"iteration": iteration, "healthy": healthy}, {})
    assert ckpt.read_tracker(tmp_path) == 2
    assert "resuming from the newest healthy one, 2" in caplog.text
