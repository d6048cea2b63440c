"""An inf/NaN in any tensor an FP8 layer quantizes reaches its outputs, is counted, and skips the step.

Quantization clamps before the cast, so without a guard an inf becomes +-fp8_max and the layer returns finite
values where nn.Linear returns inf: the loop's skip-on-non-finite check could never fire.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step
from megatron.fp8.scaling import Fp8Role
from megatron.training.loop import Trainer
from tests.support.config import tiny_argv
from tests.support.fp8_reference import linear_pair

RECIPES = [Fp8Recipe(scaling="delayed"), Fp8Recipe(scaling="tensorwise")]


def _layer(recipe: Fp8Recipe) -> tuple[nn.Linear, Fp8Linear]:
    return linear_pair(recipe, 32, 48, bias=False)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 32, generator=g), torch.randn(16, 48, generator=g)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "tensorwise"])
def test_inf_in_the_output_gradient_reaches_dx_and_dw_and_is_counted(recipe: Fp8Recipe) -> None:
    ref, fp8 = _layer(recipe)
    x, dy = _data()
    dy[3, 5] = float("inf")
    for layer in (ref, fp8):
        xg = x.clone().requires_grad_()
        layer(xg).backward(dy)
        # nn.Linear's gradients are non-finite; the FP8 layer's must be too (they were finite, |dW| ~ 1e5).
        assert not torch.isfinite(xg.grad).all(), type(layer).__name__
        assert not torch.isfinite(layer.weight.grad).all(), type(layer).__name__
    scales_before = fp8.fp8_scale.clone()
    fp8_optimizer_step(fp8)
    assert fp8.fp8_step_nonfinite.tolist() == [False, False, True]
    assert fp8.fp8_nonfinite_steps.tolist() == [0, 0, 1]
    # The stored scales stay usable: no scale can represent inf.
    assert torch.isfinite(fp8.fp8_scale).all()
    if recipe.scaling.value == "delayed":
        assert fp8.fp8_scale[Fp8Role.GRAD_OUTPUT] == scales_before[Fp8Role.GRAD_OUTPUT]


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "tensorwise"])
@pytest.mark.parametrize("where", ["input", "weight"])
def test_inf_in_a_forward_operand_makes_the_output_non_finite(recipe: Fp8Recipe, where: str) -> None:
    ref, fp8 = _layer(recipe)
    x, _ = _data()
    if where == "input":
        x[0, 0] = float("inf")
    else:
        with torch.no_grad():  # the FP8 layer holds a copy of ref's weight
            fp8.weight[1, 1] = float("inf")
            ref.weight[1, 1] = float("inf")
    assert not torch.isfinite(ref(x)).all()
    y = fp8(x)
    assert not torch.isfinite(y).all()
    fp8_optimizer_step(fp8)
    role = Fp8Role.INPUT if where == "input" else Fp8Role.WEIGHT
    assert bool(fp8.fp8_step_nonfinite[role]) and int(fp8.fp8_nonfinite_steps[role]) == 1


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "tensorwise"])
def test_finite_tensors_are_untouched_by_the_guard(recipe: Fp8Recipe) -> None:
    _, fp8 = _layer(recipe)
    x, dy = _data()
    xg = x.clone().requires_grad_()
    fp8(xg).backward(dy)
    assert torch.isfinite(xg.grad).all() and torch.isfinite(fp8.weight.grad).all()
    fp8_optimizer_step(fp8)
    assert fp8.fp8_step_nonfinite.tolist() == [False, False, False]
    assert fp8.fp8_nonfinite_steps.tolist() == [0, 0, 0]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_gradient_overflow_in_an_fp8_layer_skips_the_step_names_the_layer_and_is_logged(
        recipe: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    """The loss stays finite; only fc2's output gradient overflows, in iteration 2. Before the guard that step
    was taken with finite, clamped gradients."""
    cfg = parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe, train_iters=3,
                                 eval_iters=0, log_interval=1, lr_warmup_iters=0))
    trainer = Trainer(cfg)
    fc2 = [m for n, m in trainer.model.named_modules() if n.endswith("layers.1.mlp.linear_fc2")]
    assert len(fc2) == 1 and isinstance(fc2[0], Fp8Linear)

    def overflow_grad(module, args, output):
        if trainer.state.iteration == 1 and module.training:  # iteration 2 is running
            output.register_hook(lambda g: g.index_put((torch.tensor([0]),), torch.tensor(float("inf"), dtype=g.dtype)))

    fc2[0].register_forward_hook(overflow_grad)
    snapshots = {}
    real_step = trainer.train_step

    def step_with_snapshots(micro_batches):
        snapshots[trainer.state.iteration] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return real_step(micro_batches)

    monkeypatch.setattr(trainer, "train_step", step_with_snapshots)
    result = trainer.train()
    log = capfd.readouterr().err.splitlines()
    assert math.isfinite(result.losses[0]) and math.isnan(result.losses[1]) and math.isfinite(result.losses[2])
    assert result.state.skipped_iterations == 1
    for key, value in snapshots[1].items():  # the skipped iteration 2 changed no weight
        assert torch.equal(snapshots[2][key], value), key
    warning = [line for line in log if "step skipped" in line]
    # Named first: where the inf appeared (the other layers' gradients inherited it through dx).
    assert len(warning) == 1 and "first seen in: decoder.layers.1.mlp.linear_fc2.grad_output," in warning[0], warning
    lines = [line for line in log if " iteration        3/" in line]
    assert lines and "fp8 non-finite iterations:   1" in lines[0], lines
    assert int(fc2[0].fp8_nonfinite_steps[Fp8Role.GRAD_OUTPUT]) == 1
