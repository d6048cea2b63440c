"""`--fp8-autoheal` (megatron/training/fp8_autoheal.py): each trigger and action on synthetic statistics, each
action's exact effect, the checkpointed state, the flags, and a training run where it acts, resumed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.checkpoint import store as ckpt
from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step, fp8_state_dict, load_fp8_state_dict
from megatron.training.fp8_autoheal import Fp8Controller
from megatron.model.swiglu_outliers import model_config
from megatron.fp8.recipe import Fp8AutohealConfig, Fp8Scaling
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv


def _model() -> nn.Module:
    return nn.Sequential(Fp8Linear(8, 8, bias=False, recipe=Fp8Recipe()), Fp8Linear(8, 8, bias=False,
                                                                                    recipe=Fp8Recipe()))


def _stats(signal: str = "clipped_frac", **values: float) -> dict[str, float]:
    """Statistics as collect_fp8_stats names them: `_stats(l0_input=0.01)` is layer "0"'s input clipped fraction."""
    out = {}
    for key, value in values.items():
        layer, role = key[1], key[3:]
        out[f"fp8/{layer}/{role}/{signal}"] = value
    return out


def test_a_tensor_that_keeps_clipping_gets_one_more_power_of_two_of_margin_up_to_the_cap(caplog):
    model = _model()
    controller = Fp8Controller(model, Fp8AutohealConfig(enabled=True, clip_threshold=1e-3, patience=2, max_margin=2,
                                                        actions=("margin",)))
    assert controller.step(10, _stats(l0_input=0.01)) == []  # one log iteration over the threshold: patience 2
    assert controller.step(20, _stats(l0_input=0.01, l1_grad_output=5e-4)) != []
    assert model[0].fp8.extra_margin == (1, 0, 0) and model[1].fp8.extra_margin == (0, 0, 0)
    assert "fp8 autoheal: iteration 20: 0 input clipped 1.00e-02 of its values (> 1.0e-03) at 2 log iterations in " \
           "a row: extra margin 0 -> 1 (scale / 2)" in caplog.text
    assert controller.step(30, _stats()) == []  # a clean iteration resets the streak
    for iteration in (40, 50, 60, 70, 80, 90):
        controller.step(iteration, _stats(l0_input=0.01))
    assert model[0].fp8.extra_margin == (2, 0, 0) and controller.actions == 2  # capped at max_margin


def test_the_undo_lowers_a_margin_after_clean_log_iterations():
    model = _model()
    controller = Fp8Controller(model, Fp8AutohealConfig(enabled=True, patience=1, undo_after=3))
    controller.step(1, _stats(l1_weight=0.5))
    assert model[1].fp8.extra_margin == (0, 1, 0)
    for iteration in (2, 3):
        assert controller.step(iteration, _stats()) == []
    assert "clean at 3 log iterations in a row: extra margin 1 -> 0" in controller.step(4, _stats())[0]
    assert model[1].fp8.extra_margin == (0, 0, 0)


def test_an_extra_margin_divides_the_scale_by_its_power_of_two_exactly():
    """Delayed update and per-call current scales alike: scale(extra e) = scale(0) / 2^e, bit for bit."""
    torch.manual_seed(0)
    a = nn.Sequential(Fp8Linear(16, 8, recipe=Fp8Recipe()))
    b = nn.Sequential(Fp8Linear(16, 8, recipe=Fp8Recipe()))
    b.load_state_dict(a.state_dict())
    b[0].fp8.configure(extra_margin=[1, 2, 3])
    x = torch.randn(4, 16) * 7
    for model in (a, b):
        model(x).square().sum().backward()  # step 0: per-call current scales (no history yet)
        fp8_optimizer_step(model)  # the delayed update
    want = a[0].fp8_scale / torch.tensor([2.0, 4.0, 8.0])
    assert torch.equal(b[0].fp8_scale, want)


def test_the_margins_and_counters_are_checkpointed():
    model = _model()
    recipe = Fp8Recipe()
    model[1].fp8.configure(extra_margin=[0, 2, 1])
    state = fp8_state_dict(model, recipe)
    assert state["layers"]["1"]["extra_margin"] == [0, 2, 1] and "extra_margin" not in state["layers"]["0"]
    other = _model()
    load_fp8_state_dict(other, recipe, state)
    assert other[1].fp8.extra_margin == (0, 2, 1) and other[0].fp8.extra_margin == (0, 0, 0)
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
ACTING = (*EAGER, "--fp8-autoheal", "--fp8-autoheal-clip-threshold", "1e-6", "--fp8-autoheal-patience", "1",
          "--fp8-autoheal-max-margin", "1", "--fp8-autoheal-flush-threshold", "1e-6")


def _margins(save) -> dict:
    """What the controller changed, per layer, from a checkpoint: margins, current roles, high precision; and its
    levels."""
    fp8 = ckpt.load_checkpoint_files(save)["payload"]["fp8"]
    changed = {name: {k: entry[k] for k in ("extra_margin", "current_roles", "high_precision") if k in entry}
               for name, entry in fp8["layers"].items()}
    return {"layers": {k: v for k, v in changed.items() if v}, "level": fp8["autoheal"]["level"]}


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
    assert acted and margins["layers"], "the tiny run never clipped: lower the threshold of this test"
    for rung in ("extra margin 0 -> 1", "current scaling", "Smooth-SwiGLU channel scaling on", "high precision"):
        assert any(rung in line for line in acted), rung  # the resume below repeats every kind of action
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


# --- the ladder beyond the margin: current scaling, Smooth-SwiGLU for fc2, high precision --------------------------

def _fp8_mlp(smooth=None) -> nn.Module:
    """One SwiGLU MLP with FP8 fc1 and fc2 (module names `linear_fc1`, `linear_fc2`), the same weights each call."""
    from megatron.model.transformer import MLP

    torch.manual_seed(0)
    mlp = MLP(model_config(16, 32, smooth))
    for name in ("linear_fc1", "linear_fc2"):
        setattr(mlp, name, Fp8Linear.from_linear(getattr(mlp, name), Fp8Recipe()))
    return mlp


def _mlp_model() -> nn.Module:
    return _fp8_mlp()


def test_the_ladder_climbs_margin_current_smooth_bf16_one_rung_per_patience(caplog):
    mlp = _mlp_model()
    fc2 = mlp.linear_fc2
    controller = Fp8Controller(mlp, Fp8AutohealConfig(enabled=True, patience=1, max_margin=1))
    assert controller.rungs("linear_fc2", fc2, 0) == ["margin", "current", "smooth", "bf16"]
    assert controller.rungs("linear_fc1", mlp.linear_fc1, 0) == ["margin", "current", "bf16"]  # fc1: no smoothing
    clip = {"fp8/linear_fc2/input/clipped_frac": 0.01}
    controller.step(1, clip)
    assert fc2.fp8.extra_margin == (1, 0, 0) and fc2.fp8.current_roles == (False, False, False)
    controller.step(2, clip)
    assert fc2.fp8.current_roles == (True, False, False) and mlp.smooth_swiglu is None
    # Current-scaled, the tensor cannot clip: what counts now is its flushed fraction (and inf/NaN).
    flush = {"fp8/linear_fc2/input/flushed_frac": 0.05}
    controller.step(3, flush)
    assert mlp.smooth_swiglu is not None and mlp.smooth_swiglu.enabled and mlp.fc2_weight_column_scaled
    assert not fc2.fp8.high_precision
    controller.step(4, {"fp8/linear_fc2/input/nan_count": 3.0})
    assert fc2.fp8.high_precision and controller.actions == 4
    assert controller.step(5, flush) == []  # the top of the ladder: nothing left to do
    text = caplog.text
    assert "iteration 2: linear_fc2 input clipped 1.00e-02 of its values (> 1.0e-03) at 1 log iterations in a row: " \
           "current scaling (its own amax at every cast)" in text
    assert "iteration 3: linear_fc2 input flushed 5.00e-02 of its nonzero values to 0 (> 1.0e-02)" in text
    assert "(> 1.0e-02) at 1 log iterations in a row: Smooth-SwiGLU channel scaling on for (model)" in text
    assert "iteration 4: linear_fc2 input held 3 inf/NaN values at 1 log iterations in a row: the layer runs in high " \
           "precision (no FP8 cast)" in text


def test_flushing_does_not_count_before_the_tensor_is_current_scaled():
    """A margin makes a tensor flush more: flushing alone must not raise it further (nor switch its scaling)."""
    mlp = _mlp_model()
    controller = Fp8Controller(mlp, Fp8AutohealConfig(enabled=True, patience=1))
    for iteration in range(1, 6):
        assert controller.step(iteration, {"fp8/linear_fc2/input/flushed_frac": 0.5}) == []
    assert controller.level["linear_fc2"] == [0, 0, 0]


def test_the_undo_steps_down_the_ladder_one_rung_at_a_time():
    mlp = _mlp_model()
    fc2 = mlp.linear_fc2
    controller = Fp8Controller(mlp, Fp8AutohealConfig(enabled=True, patience=1, max_margin=1, undo_after=1))
    controller.step(1, {"fp8/linear_fc2/input/clipped_frac": 0.1})
    controller.step(2, {"fp8/linear_fc2/input/clipped_frac": 0.1})
    controller.step(3, {"fp8/linear_fc2/input/flushed_frac": 0.1})
    assert controller.level["linear_fc2"][0] == 3 and mlp.smooth_swiglu.enabled
    lines = controller.step(4, {})
    assert "clean at 1 log iterations in a row: Smooth-SwiGLU channel scaling off for (model)" in lines[0]
    assert not mlp.smooth_swiglu.enabled and fc2.fp8.current_roles[0]
    assert "back to delayed scaling" in controller.step(5, {})[0] and not fc2.fp8.current_roles[0]
    assert "extra margin 1 -> 0" in controller.step(6, {})[0] and fc2.fp8.extra_margin == (0, 0, 0)


def test_a_current_scaled_role_casts_as_the_tensorwise_recipe_bit_for_bit():
    """Under delayed scaling, a role switched to current scaling quantizes with its own amax at every call: the
    GEMMs then equal the tensorwise recipe's exactly (all three roles switched; forward and both gradients)."""
    torch.manual_seed(1)
    delayed = Fp8Linear(32, 16, bias=False, recipe=Fp8Recipe())
    tensorwise = Fp8Linear(32, 16, bias=False, recipe=Fp8Recipe(scaling=Fp8Scaling.TENSORWISE))
    tensorwise.load_state_dict(delayed.state_dict())
    x = torch.randn(8, 32, dtype=torch.float64).float() * 3
    for step in range(3):  # history built in step 0, used from step 1 (where the switch matters)
        if step == 1:
            delayed.fp8.configure(current_roles=(True, True, True))
        outs = []
        for layer in (delayed, tensorwise):
            xi = (x * (1 + step)).requires_grad_(True)  # a growing amax: the history's scale would clip
            y = layer(xi)
            y.backward(torch.ones_like(y) * (2.0 ** step))
            outs.append((y.detach(), xi.grad, layer.weight.grad.clone()))
            layer.weight.grad = None
            fp8_optimizer_step(nn.Sequential(layer))
        if step >= 1:
            for a, b in zip(*outs):
                assert torch.equal(a, b)


def test_a_high_precision_layer_is_nn_linear_exactly():
    torch.manual_seed(2)
    layer = Fp8Linear(16, 8, bias=True, recipe=Fp8Recipe())
    layer.fp8.configure(high_precision=True)
    x = torch.randn(4, 16)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), ref)
    c = torch.rand(16) + 0.5  # Smooth-SwiGLU's fold, as for a high-precision fc2
    assert torch.equal(layer(x, weight_column_scale=c), torch.nn.functional.linear(x, layer.weight * c, layer.bias))


def test_smoothing_turned_on_by_the_controller_is_the_smooth_swiglu_model_bit_for_bit():
    from megatron.model.smooth_swiglu import SmoothSwiGLUGranularity

    healed = _mlp_model()
    smooth = _fp8_mlp(SmoothSwiGLUGranularity.CHANNEL)
    smooth.load_state_dict(healed.state_dict())
    controller = Fp8Controller(healed, Fp8AutohealConfig(enabled=True, patience=1, actions=("smooth",)))
    controller.step(1, {"fp8/linear_fc2/input/flushed_frac": 0.5})
    x = torch.randn(3, 5, 16) * 4
    x[0, 0, 3] = 300.0  # an outlier, as Smooth-SwiGLU is there for
    assert torch.equal(healed(x), smooth(x))


def test_levels_are_checkpointed_and_applied_on_load():
    mlp = _mlp_model()
    controller = Fp8Controller(mlp, Fp8AutohealConfig(enabled=True, patience=1, max_margin=1))
    for iteration in (1, 2):
        controller.step(iteration, {"fp8/linear_fc2/input/clipped_frac": 0.1,
                                    "fp8/linear_fc1/grad_output/inf_count": 1.0})
    controller.step(3, {"fp8/linear_fc2/input/flushed_frac": 0.1})
    recipe = Fp8Recipe()
    fp8_state, heal_state = fp8_state_dict(mlp, recipe), controller.state_dict()
    assert fp8_state["layers"]["linear_fc2"]["current_roles"] == [True, False, False]
    other = _mlp_model()
    load_fp8_state_dict(other, recipe, fp8_state)
    assert other.linear_fc2.fp8.current_roles == (True, False, False)
    restored = Fp8Controller(other, Fp8AutohealConfig(enabled=True, patience=1, max_margin=1))
    restored.load_state_dict(heal_state)
    assert restored.level == controller.level and other.smooth_swiglu.enabled
    assert other.linear_fc1.fp8.current_roles == (False, False, True)
    assert other.linear_fc1.fp8.extra_margin == (0, 0, 1)


@pytest.mark.parametrize("switches, needle", [
    (("--fp8-recipe", "tensorwise", "--fp8-autoheal-actions", "margin,current"), "current (--fp8-recipe tensorwise"),
    (("--smooth-swiglu", "--fp8-autoheal-actions", "smooth"), "smooth (--smooth-swiglu is on for every layer"),
    (("--fp8-autoheal-actions", "margin,bogus"), "--fp8-autoheal-actions: unknown ['bogus']"),
    (("--fp8-autoheal-flush-threshold", "1.5"), "--fp8-autoheal-flush-threshold must be in (0, 1)"),
])
def test_actions_that_make_no_sense_for_the_recipe_are_refused_at_parse_time(switches, needle):
    with pytest.raises(ValueError) as err:
        parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-autoheal", *switches))
    assert needle in str(err.value)


def test_the_default_ladder_is_what_applies():
    assert parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-autoheal")).fp8_autoheal.actions == (
        "margin", "current", "smooth", "bf16")
    assert parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--smooth-swiglu",
                                  "--fp8-autoheal")).fp8_autoheal.actions == ("margin", "bf16")


def test_an_injected_outlier_triggers_an_action_and_a_resumed_run_repeats_it(tmp_path, monkeypatch):
    """The stability lab's injection (two channels of every layer's fc1 set to up = +-c x gate) in a checkpoint,
    then training resumed with the default controller: the edited fc1 weight clips (its delayed scale predates the
    edit) and gets a margin at the first log point. The same resume cut in two (exit at 6, resumed) takes the same
    actions at the same iterations and ends with the same weights and FP8 state, bit for bit."""
    import shutil

    from megatron.stability.inject import inject_aligned_channels

    # Its threshold sits between this tiny run's own clipping (<= 3.7e-4 of a tensor's values in the base run) and
    # the edited weight's (7.8e-3: 2 of each layer's fc1 rows), a factor 8 and 2.6 away.
    heal = ("--fp8-autoheal", "--fp8-autoheal-clip-threshold", "3e-3")
    lines = _actions(monkeypatch)
    common = dict(train_iters=8, save_interval=2, log_interval=1, eval_iters=0)
    pretrain(parse_config(tiny_argv(*EAGER, *heal, save=tmp_path / "base", exit_interval=4, **common)))
    assert lines == [], lines  # nothing wrong before the edit: no action
    inject_aligned_channels(tmp_path / "base", 1000.0, 2)
    for name in ("straight", "cut"):
        shutil.copytree(tmp_path / "base", tmp_path / name)
    straight = tiny_argv(*EAGER, *heal, load=tmp_path / "straight", save=tmp_path / "straight", **common)
    pretrain(parse_config(straight))
    acted = list(lines)
    assert acted and all("mlp.linear_fc1 weight clipped" in line for line in acted[:2]), acted
    assert acted[0].startswith("fp8 autoheal: iteration 5:"), acted[0]
    lines.clear()
    pretrain(parse_config(tiny_argv(*EAGER, *heal, load=tmp_path / "cut", save=tmp_path / "cut",
                                    exit_interval=6, **common)))
    pretrain(parse_config(tiny_argv(*EAGER, *heal, load=tmp_path / "cut", save=tmp_path / "cut",
                                    **common)))
    assert lines == acted
    a = ckpt.load_checkpoint_files(tmp_path / "straight")["payload"]
    b = ckpt.load_checkpoint_files(tmp_path / "cut")["payload"]
    assert a["fp8"]["autoheal"]["level"] == b["fp8"]["autoheal"]["level"]
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key


def test_a_run_resumed_without_the_flag_keeps_the_actions_and_takes_no_new_ones(tmp_path, monkeypatch, capfd):
    lines = _actions(monkeypatch)
    common = dict(save=tmp_path, train_iters=8, save_interval=4, log_interval=1, eval_iters=0)
    pretrain(parse_config(tiny_argv(*ACTING, exit_interval=4, **common)))
    assert lines, "the tiny run never clipped: lower the threshold of ACTING"
    taken = _margins(tmp_path)
    lines.clear()
    capfd.readouterr()
    pretrain(parse_config(tiny_argv(*EAGER, load=tmp_path, **common)))
    assert lines == []  # no controller steps
    log = capfd.readouterr()
    assert "FP8 controller action(s) (--fp8-autoheal): kept; add --fp8-autoheal to let it act further" in (
        log.out + log.err)
    assert _margins(tmp_path) == taken  # the iteration-8 checkpoint holds the same margins, roles and levels
