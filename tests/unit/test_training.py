"""The training loop: learning, gradient accumulation, exact resume, NaN handling, logging, exit conditions."""
import math

import pytest
import torch

from megatron.arguments import parse_config
from megatron.optimizer.lr_scheduler import lr_at
from megatron.training.loop import Trainer, TrainingDiverged, pretrain
from tests.support.config import tiny_argv
from tests.support.logs import LOSS
from tests.support.run_noise import assert_weights_within_noise


def test_tiny_run_loss_drops_clearly():
    result = pretrain(parse_config(tiny_argv("--bf16", train_iters=40)))
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert first > 4.3  # ~ln(128) at init
    assert last < first - 1.5, (first, last)
    assert result.valid and result.valid[-1][1] < first - 1.5
    assert result.test_loss is not None and math.isfinite(result.test_loss)
    assert result.state.consumed_train_samples == 40 * 8
    assert result.state.consumed_train_tokens == 40 * 8 * 32


@pytest.mark.isa_sensitive
def test_gradient_accumulation_equivalence():
    """8 micro-batches of 1 and 1 micro-batch of 8 give the same update (fp32), to within the noise of the run:
    4 micro-batches of 2, the same math in a third summation order, is the control (tests/support/run_noise.py)."""
    weights = []
    for mbs in (1, 8, 2):
        result = pretrain(parse_config(tiny_argv(micro_batch_size=mbs, global_batch_size=8, train_iters=2,
                                                 eval_iters=0, lr_warmup_iters=0)))
        weights.append({k: v.clone() for k, v in result.model.state_dict().items()})
    assert_weights_within_noise(*weights)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_exact_resume(tmp_path):
    """N steps, save, a new process-like Trainer loads and runs N more == 2N steps at once (bitwise on CPU)."""
    common = dict(train_iters=12, hidden_dropout=0.1, attention_dropout=0.1, eval_interval=6)
    straight = pretrain(parse_config(tiny_argv(**common)))
    first = pretrain(parse_config(tiny_argv(save=tmp_path / "ckpt", exit_interval=6, **common)))
    assert first.exit_reason == "exit-interval" and first.state.iteration == 6
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (tmp_path / "ckpt" / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt").exists()
    second = pretrain(parse_config(tiny_argv(load=tmp_path / "ckpt", **common)))
    assert second.state.iteration == 12
    assert first.losses + second.losses == straight.losses
    a, b = _weights(straight.model), _weights(second.model)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert second.valid[-1] == straight.valid[-1]


def test_loading_a_different_shape_names_both_shapes(tmp_path):
    pretrain(parse_config(tiny_argv(save=tmp_path / "c", train_iters=1, eval_iters=0, lr_warmup_iters=0)))
    with pytest.raises(ValueError, match=r"checkpoint \(128, 64\) vs model \(128, 96\)"):
        pretrain(parse_config(tiny_argv(load=tmp_path / "c", hidden_size=96, train_iters=2, eval_iters=0, lr_warmup_iters=0)))


def test_non_finite_steps_are_skipped_then_training_stops(tmp_path, monkeypatch):
    cfg = parse_config(tiny_argv(save=tmp_path / "c", save_interval=3, train_iters=20, eval_iters=0,
                                 max_consecutive_nan_steps=3))
    trainer = Trainer(cfg)
    real = trainer._forward_loss
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        masked, count = real(model, batch)
        step = (calls["n"] - 1) // cfg.training.num_micro_batches + 1
        if step == 2 or step >= 5:  # one isolated bad step, then a run of them
            masked = masked * float("nan")
        return masked, count

    monkeypatch.setattr(trainer, "_forward_loss", poisoned)
    with pytest.raises(TrainingDiverged, match="3 consecutive non-finite steps, the last at iteration 7"):
        trainer.train()
    s = trainer.state
    assert s.skipped_iterations == 4 and s.nan_iterations == 4 and s.iteration == 7
    # The last good checkpoint (iteration 3) stays the newest one: nothing was saved after the divergence.
    assert (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not (tmp_path / "c" / "iter_0000006").exists()


def test_skipped_step_leaves_weights_unchanged(monkeypatch):
    cfg = parse_config(tiny_argv(train_iters=1, eval_iters=0, lr_warmup_iters=0))
    trainer = Trainer(cfg)
    w0 = _weights(trainer.model)
    real = trainer._forward_loss
    monkeypatch.setattr(trainer, "_forward_loss", lambda m, b: (real(m, b)[0] * float("inf"), real(m, b)[1]))
    result = trainer.train()
    assert math.isnan(result.losses[0]) and result.state.skipped_iterations == 1
    for key, value in _weights(trainer.model).items():
        assert torch.equal(value, w0[key]), key


def test_lr_schedule_values():
    cfg = parse_config(tiny_argv(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_iters=110, train_iters=200)).scheduler
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 60) == pytest.approx(0.55)  # cosine midpoint
    assert lr_at(cfg, 110) == pytest.approx(0.1) and lr_at(cfg, 150) == pytest.approx(0.1)
    lin = parse_config(tiny_argv(lr=1.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_style="linear",
                                 train_iters=100)).scheduler
    assert lr_at(lin, 25) == pytest.approx(0.75)
    const = parse_config(tiny_argv(lr=0.5, min_lr=0.0, lr_warmup_iters=4, lr_decay_style="constant")).scheduler
    assert lr_at(const, 1) == pytest.approx(0.25) and lr_at(const, 50) == pytest.approx(0.5)


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pretrain(parse_config(tiny_argv(tensorboard_dir=tmp_path / "tb", train_iters=10)))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm-loss-training/lm loss", "lm-loss-training/lm loss vs tokens", "learning-rate/learning-rate",
                "grad-norm/grad-norm", "throughput/tokens-per-sec", "lm-loss-validation/lm loss validation",
                "lm-loss-validation/lm loss validation ppl", "memory/mem-max-rss-MiB"):
        assert tag in tags, tag
    by_tokens = acc.Scalars("lm-loss-training/lm loss vs tokens")
    assert [e.step for e in by_tokens] == [5 * 8 * 32, 10 * 8 * 32]


def test_exit_duration_stops_after_the_current_iteration(tmp_path):
    result = pretrain(parse_config(tiny_argv(exit_duration_in_mins=0.0, save=tmp_path / "c", train_iters=50,
                                             eval_iters=0)))
    assert result.exit_reason == "exit-duration" and result.state.iteration == 1
    assert (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_finetune_loads_weights_only(tmp_path):
    first = pretrain(parse_config(tiny_argv(save=tmp_path / "c", train_iters=3, eval_iters=0, lr_warmup_iters=0)))
    trainer = Trainer(parse_config(tiny_argv("--finetune", load=tmp_path / "c", train_iters=3, eval_iters=0,
                                             lr_warmup_iters=0)))
    assert trainer.state.iteration == 0 and not trainer.optimizer.state
    for key, value in first.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[key], value), key


def test_a_skipped_step_logs_the_loss_it_computed(capfd):
    """A step skipped for a non-finite gradient with a finite loss: the log line prints that loss (it printed nan
    while the warning showed the finite value)."""
    import re

    trainer = Trainer(parse_config(tiny_argv(train_iters=1, eval_iters=0, lr_warmup_iters=0, log_interval=1)))
    weight = next(p for n, p in trainer.model.named_parameters() if n.endswith("linear_fc2.weight"))
    weight.register_hook(lambda grad: grad * float("inf"))
    result = trainer.train()
    assert result.state.skipped_iterations == 1
    err = capfd.readouterr().err
    warned = float(re.search(r"non-finite loss or grad norm \(loss (\S+), grad norm (?:inf|nan)\)", err).group(1))
    logged = float(LOSS.search(err).group(1))
    assert math.isfinite(warned) and logged == pytest.approx(warned, rel=1e-6)
