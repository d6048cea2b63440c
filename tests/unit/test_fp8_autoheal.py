"""`--fp8-autoheal` (megatron/fp8/autoheal.py): each trigger and action on synthetic statistics, the margin's exact
effect on the scales, the checkpointed state, and a training run where it acts, resumed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.checkpoint import store as ckpt
from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step, fp8_state_dict, load_fp8_state_dict
from megatron.fp8.autoheal import Fp8Controller
from megatron.fp8.recipe import Fp8AutohealConfig
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv


def _model() -> nn.Module:
    return nn.Sequential(Fp8Linear(8, 8, bias=False, recipe=Fp8Recipe()), Fp8Linear(8, 8, bias=False,
                                                                                    recipe=Fp8Recipe()))


def _stats(**clipped: float) -> dict[str, float]:
    """Statistics as collect_fp8_stats names them: `_stats(l0_input=0.01)` is layer "0"'s input."""
    out = {}
    for key, value in clipped.items():
        layer, role = key[1], key[3:]
        out[f"fp8/{layer}/{role}/clipped_frac"] = value
    return out


def test_a_tensor_that_keeps_clipping_gets_one_more_power_of_two_of_margin_up_to_the_cap(caplog):
    model = _model()
    controller = Fp8Controller(model, Fp8AutohealConfig(enabled=True, clip_threshold=1e-3, patience=2, max_margin=2))
    assert controller.step(10, _stats(l0_input=0.01)) == []  # one log iteration over the threshold: patience 2
    assert controller.step(20, _stats(l0_input=0.01, l1_grad_output=5e-4)) != []
    assert model[0].fp8.extra_margin == [1, 0, 0] and model[1].fp8.extra_margin == [0, 0, 0]
    assert "fp8 autoheal: iteration 20: 0 input clipped 1.00e-02 of its values (> 1.0e-03) at 2 log iterations in " \
           "a row: extra margin 0 -> 1 (scale / 2)" in caplog.text
    assert controller.step(30, _stats()) == []  # a clean iteration resets the streak
    for iteration in (40, 50, 60, 70, 80, 90):
        controller.step(iteration, _stats(l0_input=0.01))
    assert model[0].fp8.extra_margin == [2, 0, 0] and controller.actions == 2  # capped at max_margin


def test_the_undo_lowers_a_margin_after_clean_log_iterations():
    model = _model()
    controller = Fp8Controller(model, Fp8AutohealConfig(enabled=True, patience=1, undo_after=3))
    controller.step(1, _stats(l1_weight=0.5))
    assert model[1].fp8.extra_margin == [0, 1, 0]
    for iteration in (2, 3):
        assert controller.step(iteration, _stats()) == []
    assert "clean at 3 log iterations in a row: extra margin 1 -> 0" in controller.step(4, _stats())[0]
    assert model[1].fp8.extra_margin == [0, 0, 0]


def test_an_extra_margin_divides_the_scale_by_its_power_of_two_exactly():
    """Delayed update and per-call current scales alike: scale(extra e) = scale(0) / 2^e, bit for bit."""
    torch.manual_seed(0)
    a = nn.Sequential(Fp8Linear(16, 8, recipe=Fp8Recipe()))
    b = nn.Sequential(Fp8Linear(16, 8, recipe=Fp8Recipe()))
    b.load_state_dict(a.state_dict())
    b[0].fp8.extra_margin = [1, 2, 3]
    x = torch.randn(4, 16) * 7
    for model in (a, b):
        model(x).square().sum().backward()  # step 0: per-call current scales (no history yet)
        fp8_optimizer_step(model)  # the delayed update
    want = a[0].fp8_scale / torch.tensor([2.0, 4.0, 8.0])
    assert torch.equal(b[0].fp8_scale, want)


def test_the_margins_and_counters_are_checkpointed():
    model = _model()
    recipe = Fp8Recipe()
    model[1].fp8.extra_margin = [0, 2, 1]
    state = fp8_state_dict(model, recipe)
    assert state["layers"]["1"]["extra_margin"] == [0, 2, 1] and "extra_margin" not in state["layers"]["0"]
    other = _model()
    load_fp8_state_dict(other, recipe, state)
    assert other[1].fp8.extra_margin == [0, 2, 1] and other[0].fp8.extra_margin == [0, 0, 0]
    controller = Fp8Controller(model, Fp8AutohealConfig(enabled=True, patience=3))
    controller.step(1, _stats(l0_grad_output=0.1))
    restored = Fp8Controller(other, Fp8AutohealConfig(enabled=True, patience=3))
    restored.load_state_dict(controller.state_dict())
    assert restored.streak == controller.streak and restored.streak["0"] == [0, 0, 1]


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--fp8-autoheal only apply to FP8 training"):
        parse_config(tiny_argv("--fp8-autoheal"))
    with pytest.raises(ValueError, match="--fp8-autoheal-patience only apply with --fp8-autoheal"):
        parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-autoheal-patience", "3"))
    with pytest.raises(ValueError, match="--fp8-recipe blockwise scales every tile by its own amax"):
        parse_config(tiny_argv("--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-autoheal"))
    with pytest.raises(ValueError, match="--fp8-autoheal-clip-threshold must be in"):
        parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-autoheal", "--fp8-autoheal-clip-threshold", "0"))


# A threshold no tensor of the tiny run stays under for long: the controller acts within the run.
EAGER = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1", "--fp8-amax-compute-algo", "most_recent",
         "--device", "cpu")
ACTING = (*EAGER, "--fp8-autoheal", "--fp8-autoheal-clip-threshold", "1e-6", "--fp8-autoheal-patience", "1")


def _margins(save) -> dict:
    fp8 = ckpt.load_checkpoint_files(save)["payload"]["fp8"]
    return {name: entry.get("extra_margin") for name, entry in fp8["layers"].items() if entry.get("extra_margin")}


def _actions(monkeypatch) -> list[str]:
    """The controller's action lines of the runs that follow."""
    lines: list[str] = []
    step = Fp8Controller.step
    monkeypatch.setattr(Fp8Controller, "step", lambda self, it, stats: lines.extend(step(self, it, stats)) or lines)
    return lines


def test_a_run_where_it_acts_and_its_resume_make_the_same_decisions(tmp_path, monkeypatch):
    lines = _actions(monkeypatch)
    straight = tiny_argv(*ACTING, save=tmp_path / "a", train_iters=8, save_interval=4, log_interval=1, eval_iters=0)
    pretrain(parse_config(straight))
    acted, margins = list(lines), _margins(tmp_path / "a")
    assert acted and margins, "the tiny run never clipped: lower the threshold of this test"
    lines.clear()
    first = tiny_argv(*ACTING, save=tmp_path / "b", train_iters=8, exit_interval=4, save_interval=4, log_interval=1,
                      eval_iters=0)
    pretrain(parse_config(first))
    resumed = tiny_argv(*ACTING, load=tmp_path / "b", save=tmp_path / "b", train_iters=8, save_interval=4,
                        log_interval=1, eval_iters=0)
    pretrain(parse_config(resumed))
    assert lines == acted
    assert _margins(tmp_path / "b") == margins


def test_a_run_where_it_never_acts_is_the_run_without_it_bitwise(tmp_path):
    plain = tiny_argv(*EAGER, save=tmp_path / "plain", train_iters=4, save_interval=4, log_interval=1, eval_iters=0)
    watched = tiny_argv(*EAGER, "--fp8-autoheal", "--fp8-autoheal-clip-threshold", "0.99", save=tmp_path / "watched",
                        train_iters=4, save_interval=4, log_interval=1, eval_iters=0)
    pretrain(parse_config(plain))
    pretrain(parse_config(watched))
    a = ckpt.load_checkpoint_files(tmp_path / "plain")["payload"]
    b = ckpt.load_checkpoint_files(tmp_path / "watched")["payload"]
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    for name, entry in a["fp8"]["layers"].items():
        for role in ("input", "weight", "grad_output"):
            assert torch.equal(entry[role]["amax_history"], b["fp8"]["layers"][name][role]["amax_history"])
    assert b["fp8"]["autoheal"]["actions"] == 0
