"""Gaudi lazy mode: `Accelerator.mark_step` cuts the graph after each backward, after the optimizer step and after
each evaluation forward, only on HPU in lazy mode, which is asked of Habana's bridge (`is_lazy`) when it has the
function, else read from PT_HPU_LAZY_MODE (unset: eager, current Gaudi software's default). And the environment the
HPU path sets before the bridge is imported, and the log lines that say so."""
from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest

from megatron import accelerator
from megatron.accelerator import Accelerator, prepare_habana_environment
from megatron.arguments import parse_config
from megatron.training.loop import Trainer
from tests.support.config import tiny_argv


def _fake_htcore(monkeypatch, is_lazy=None) -> list[str]:
    """A stand-in bridge: `core.mark_step` recorded; `utils.internal.is_lazy` only when `is_lazy` is given."""
    calls: list[str] = []
    names = ("habana_frameworks", "habana_frameworks.torch", "habana_frameworks.torch.core")
    if is_lazy is not None:
        names += ("habana_frameworks.torch.utils", "habana_frameworks.torch.utils.internal")
    modules = [types.ModuleType(n) for n in names]
    for module in modules:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=True)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    modules[0].torch, modules[1].core = modules[1], modules[2]
    modules[2].mark_step = lambda: calls.append("mark_step")
    if is_lazy is not None:
        modules[1].utils, modules[3].internal = modules[3], modules[4]
        modules[4].is_lazy = lambda: is_lazy
    return calls


@pytest.mark.parametrize("device,env,expected", [("hpu", None, False), ("hpu", "1", True), ("hpu", "0", False),
                                                 ("cpu", None, False), ("cuda", "1", False)])
def test_mark_step_only_in_hpu_lazy_mode(monkeypatch, device, env, expected) -> None:
    calls = _fake_htcore(monkeypatch)
    if env is None:
        monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    else:
        monkeypatch.setenv("PT_HPU_LAZY_MODE", env)
    accel = Accelerator(device)
    assert accel.lazy_mode is expected
    accel.mark_step()
    assert calls == (["mark_step"] if expected else [])


@pytest.mark.parametrize("bridge_says", [True, False])
def test_the_bridge_decides_when_it_can_say(monkeypatch, bridge_says) -> None:
    """Habana's code asks `is_lazy()`; the environment variable is only the fallback (here it says the opposite)."""
    calls = _fake_htcore(monkeypatch, is_lazy=bridge_says)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0" if bridge_says else "1")
    accel = Accelerator("hpu")
    assert accel.lazy_mode is bridge_says
    accel.mark_step()
    assert calls == (["mark_step"] if bridge_says else [])


def test_training_loop_marks_steps_after_backward_optimizer_step_and_eval_forward(monkeypatch) -> None:
    cfg = parse_config(tiny_argv(train_iters=2, eval_interval=2, eval_iters=1, lr_warmup_iters=0))
    trainer = Trainer(cfg)
    events: list[str] = []
    monkeypatch.setattr(Accelerator, "mark_step", lambda self: events.append("mark_step"))
    real_backward, real_step = trainer.engine.backward, trainer.engine.step
    monkeypatch.setattr(trainer.engine, "backward", lambda loss: (events.append("backward"), real_backward(loss)))
    monkeypatch.setattr(trainer.engine, "step", lambda *a: (events.append("step"), real_step(*a))[1])
    real_forward = trainer._forward_loss
    monkeypatch.setattr(trainer, "_forward_loss", lambda m, b: (events.append("forward"), real_forward(m, b))[1])
    trainer.train()
    n = cfg.training.num_micro_batches
    one_iteration = ["forward", "backward", "mark_step"] * n + ["step", "mark_step"]
    evaluation = ["forward", "mark_step"] * (cfg.training.eval_iters * n)
    assert events == one_iteration * 2 + evaluation * 2  # validation at iteration 2, then the test split


def test_the_habana_environment_is_set_unless_the_user_set_it(caplog) -> None:
    """PT_ENABLE_INT64_SUPPORT=1 (the FP8 statistics' int64 counters), set before the bridge reads it; a user's value
    is kept, a user's 0 with a warning naming what it affects."""
    env: dict = {}
    assert prepare_habana_environment(env) == ["Gaudi: PT_ENABLE_INT64_SUPPORT=1 (set by megatron)"]
    assert env == {"PT_ENABLE_INT64_SUPPORT": "1"}
    mine = {"PT_ENABLE_INT64_SUPPORT": "0"}
    with caplog.at_level(logging.WARNING, logger="megatron"):
        assert prepare_habana_environment(mine) == ["Gaudi: PT_ENABLE_INT64_SUPPORT=0 (from the environment)"]
    assert mine == {"PT_ENABLE_INT64_SUPPORT": "0"}
    assert "FP8 statistics' element counters" in caplog.text


@pytest.mark.parametrize("bridge_says", [True, False])
def test_the_trainer_logs_the_mode_and_the_environment_on_gaudi(monkeypatch, caplog, bridge_says) -> None:
    """`prepare_bf16` is the trainer's first accelerator call after logging is set up: on HPU it logs the bridge's
    mode and what `prepare_habana_environment` set (which ran before logging existed)."""
    _fake_htcore(monkeypatch, is_lazy=bridge_says)
    monkeypatch.setattr(accelerator, "_HABANA_NOTES", [])
    prepare_habana_environment({})
    with caplog.at_level(logging.INFO, logger="megatron"):
        Accelerator("hpu").prepare_bf16(True)
        Accelerator("cpu").prepare_bf16(False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Gaudi:")]
    mode = "lazy" if bridge_says else "eager"
    assert lines == [f"Gaudi: {mode} mode (habana_frameworks.torch.utils.internal.is_lazy, else PT_HPU_LAZY_MODE)",
                     "Gaudi: PT_ENABLE_INT64_SUPPORT=1 (set by megatron)"]
