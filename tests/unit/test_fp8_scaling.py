"""Delayed vs current scaling, amax history rolling, max vs most_recent, first step, non-finite amaxes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megatron.fp8 import Fp8Linear, Fp8Recipe, enable_fp8_stats, collect_fp8_stats, fp8_optimizer_step
from megatron.fp8.scaling import Fp8Role, amax_from_history, roll_history
from megatron.fp8.stats import sqnr_db

IN = Fp8Role.INPUT


def _layer(**recipe_kwargs: object) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_linear(nn.Linear(32, 16, bias=False), Fp8Recipe(**recipe_kwargs))


def _x(amax: float, seed: int = 0) -> torch.Tensor:
    """Random [8, 32] input whose max |x| is exactly `amax`."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    return x / x.abs().max() * amax


def _step(layer: Fp8Linear, *amaxes: float) -> None:
    """One optimizer step made of one micro-batch per amax (forward + backward), then the hook."""
    for i, a in enumerate(amaxes):
        layer(_x(a, seed=i).requires_grad_()).sum().backward()
    fp8_optimizer_step(layer)


def test_roll_and_reduce_history() -> None:
    h = torch.zeros(1, 3)
    for a in (4.0, 3.0, 2.0, 1.0):
        h = roll_history(h, torch.tensor([a]))
    assert h.tolist() == [[1.0, 2.0, 3.0]]  # newest first, oldest (4.0) dropped
    assert amax_from_history(h, "max").item() == 3.0
    assert amax_from_history(h, "most_recent").item() == 1.0


def test_step_amax_is_the_max_over_micro_batches_and_updated_once_per_step() -> None:
    layer = _layer(amax_history_len=4)
    for i, a in enumerate((2.0, 5.0, 3.0)):
        layer(_x(a, seed=i))
    assert layer.fp8_step_amax[IN].item() == 5.0
    assert layer.fp8_amax_history[IN].tolist() == [0, 0, 0, 0]  # nothing rolled during the step
    fp8_optimizer_step(layer)
    assert layer.fp8_amax_history[IN].tolist() == [5.0, 0, 0, 0]
    assert layer.fp8_step_amax[IN].item() == 0.0
    assert layer.fp8_scale[IN].item() == pytest.approx(448 / 5)
    assert layer.fp8.num_updates == 1


@pytest.mark.parametrize("algo,expected_amax", [("max", 3.0), ("most_recent", 1.0)])
def test_history_len_and_algo(algo: str, expected_amax: float) -> None:
    layer = _layer(amax_history_len=3, amax_compute_algo=algo)
    for a in (4.0, 3.0, 2.0, 1.0):
        _step(layer, a)
    assert layer.fp8_amax_history[IN].tolist() == [1.0, 2.0, 3.0]
    assert layer.fp8_scale[IN].item() == pytest.approx(448 / expected_amax)


def test_margin_and_power_of_two_in_the_update() -> None:
    layer = _layer(margin=1, power_of_two_scales=True)
    _step(layer, 3.0)
    assert layer.fp8_scale[IN].item() == 64.0  # 448 / 3 / 2 = 74.7 -> 64
    # grad_output is E5M2: its scale uses 57344, weight E4M3 448.
    g_amax = layer.fp8_amax_history[Fp8Role.GRAD_OUTPUT, 0].item()
    expected = 2.0 ** torch.floor(torch.log2(torch.tensor(57344 / g_amax / 2))).item()
    assert layer.fp8_scale[Fp8Role.GRAD_OUTPUT].item() == expected


def test_first_step_uses_current_amax_then_delayed_scale_lags() -> None:
    delayed = _layer(amax_history_len=1)
    current = _layer(scaling="tensorwise")
    ref = nn.Linear(32, 16, bias=False)
    ref.weight = delayed.weight
    enable_fp8_stats(delayed)
    # Step 1: empty history -> scale from the current amax, even for a large input: no clipping.
    x1 = _x(1000.0)
    assert sqnr_db(delayed(x1), ref(x1)) > 25
    assert collect_fp8_stats(delayed)["fp8/input/clipped_frac"] == 0.0
    fp8_optimizer_step(delayed)
    fp8_optimizer_step(current)
    # Step 2: the input jumps 100x. Delayed scaling still uses step 1's amax and clips; current adapts.
    x2 = _x(100_000.0, seed=5)
    assert sqnr_db(delayed(x2), ref(x2)) < 10
    assert collect_fp8_stats(delayed)["fp8/input/clipped_frac"] > 0.5
    assert sqnr_db(current(x2), ref(x2)) > 25
    # After the step's update delayed scaling has caught up.
    fp8_optimizer_step(delayed)
    assert sqnr_db(delayed(x2), ref(x2)) > 25


def test_tensorwise_scale_follows_each_tensor_and_ignores_history() -> None:
    layer = _layer(scaling="tensorwise", amax_history_len=4)
    layer(_x(2.0))
    assert layer.fp8_scale[IN].item() == pytest.approx(448 / 2)
    layer(_x(8.0))
    assert layer.fp8_scale[IN].item() == pytest.approx(448 / 8)
    fp8_optimizer_step(layer)
    assert layer.fp8_amax_history.abs().sum() == 0 and layer.fp8_step_amax.abs().sum() == 0


def test_zero_and_nonfinite_amax_keep_the_previous_scale() -> None:
    layer = _layer(amax_history_len=1)
    _step(layer, 4.0)
    good = layer.fp8_scale[IN].item()
    layer(torch.zeros(8, 32))  # a step whose input was all zeros
    fp8_optimizer_step(layer)
    assert layer.fp8_scale[IN].item() == good
    x = _x(4.0)
    x[0, 0] = float("inf")
    y = layer(x)
    fp8_optimizer_step(layer)
    assert layer.fp8_scale[IN].item() == good and torch.isfinite(layer.fp8_scale).all()
    assert layer.fp8_nonfinite_steps[IN].item() == 1
    assert layer.fp8_amax_history[IN, 0].item() == 0.0  # recorded as "no information"
    # The overflow is not masked by the clamp: the GEMM's guarded scale turns the output NaN, so the loss
    # (and then the loop's skip check) sees it; only the stored scale state stays finite.
    assert torch.isnan(y).all()
    nan_x = _x(4.0)
    nan_x[1, 3] = float("nan")
    assert torch.isnan(layer(nan_x)[1]).all()  # NaN propagates to the output (the loss will show it)
    fp8_optimizer_step(layer)
    assert layer.fp8_nonfinite_steps[IN].item() == 2 and layer.fp8_scale[IN].item() == good


def test_evaluation_does_not_touch_the_scaling_state() -> None:
    layer = _layer(amax_history_len=2)
    _step(layer, 3.0)
    before = {k: v.clone() for k, v in layer.named_buffers()}
    layer.eval()
    with torch.no_grad():
        layer(_x(1000.0))
    layer.train()
    assert all(torch.equal(v, before[k]) for k, v in layer.named_buffers())


def test_weight_amax_is_recorded_even_when_the_cast_happened_in_evaluation() -> None:
    layer = _layer(amax_history_len=2)
    _step(layer, 3.0)
    layer.eval()
    layer(_x(1.0))  # the FP8 weight of the next step is made here, outside training
    layer.train()
    _step(layer, 3.0)
    assert layer.fp8.weight_quantizations == 2
    assert layer.fp8_amax_history[Fp8Role.WEIGHT, 0].item() == layer.weight.abs().max().item()


def test_batched_update_equals_the_per_module_update() -> None:
    """`fp8_optimizer_step` updates the delayed-scaling modules in stacked batches (one per history shape and
    update arithmetic): every buffer equals `delayed_update` run module by module, over 4 steps, for a model mixing
    history lengths, max/most-recent, margins, power-of-two scales and tensorwise layers, with step amaxes that
    include 0, inf and NaN."""
    from megatron.fp8.scaling import delayed_update
    from megatron.fp8.step import _fp8_maxes

    recipes = [Fp8Recipe(amax_history_len=4, amax_compute_algo="max"), Fp8Recipe(),
               Fp8Recipe(amax_history_len=4, amax_compute_algo="most_recent", margin=2),
               Fp8Recipe(amax_history_len=4, amax_compute_algo="max", power_of_two_scales=True),
               Fp8Recipe(scaling="tensorwise")]
    model = nn.Sequential(*[Fp8Linear(4, 4, bias=False, recipe=recipes[i % len(recipes)]) for i in range(12)])
    reference = [(m.fp8_amax_history.clone(), m.fp8_scale.clone(), m.fp8_scale_valid.clone(),
                  m.fp8_nonfinite_steps.clone()) for m in model]
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, float("inf"), float("nan")])
    for step in range(4):
        amaxes = torch.rand(len(model), 3, generator=g) * 2.0 ** torch.randint(-20, 20, (len(model), 3), generator=g)
        amaxes.view(-1)[torch.randint(0, amaxes.numel(), (4,), generator=g)] = specials[torch.arange(4) % 3]
        for m, a in zip(model, amaxes):
            m.fp8_step_amax.copy_(a)
        want = []
        for m, (history, scale, valid, steps), a in zip(model, reference, amaxes):
            if m.fp8.recipe.scaling.value == "delayed":
                history, scale, valid, nonfinite = delayed_update(history, scale, valid, a, _fp8_maxes(m), m.fp8.recipe)
            else:
                nonfinite = ~torch.isfinite(a)
            want.append((history, scale, valid, steps + nonfinite.to(torch.int64)))
        reference = want
        fp8_optimizer_step(model)
        for i, (m, (history, scale, valid, steps)) in enumerate(zip(model, want)):
            assert torch.equal(m.fp8_amax_history, history) and torch.equal(m.fp8_scale_valid, valid), (step, i)
            assert torch.equal(m.fp8_scale, scale) and torch.equal(m.fp8_nonfinite_steps, steps), (step, i)
            assert not m.fp8_step_amax.any()
    assert [m.fp8.num_updates for m in model] == [4 if r.scaling.value == "delayed" else 0
                                                  for r in (m.fp8.recipe for m in model)]


def test_the_unbatched_update_is_the_batched_one() -> None:
    """`fp8_optimizer_step(model, batched=False)` (each module on its own, what bench_host_overhead compares) writes
    the same bits as the batched default."""
    import copy

    recipes = [Fp8Recipe(amax_history_len=4, amax_compute_algo="max"), Fp8Recipe(margin=1)]
    a = nn.Sequential(*[Fp8Linear(4, 4, bias=False, recipe=recipes[i % 2]) for i in range(6)])
    b = copy.deepcopy(a)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        amaxes = torch.rand(len(a), 3, generator=g) * 100
        for ma, mb, amax in zip(a, b, amaxes):
            ma.fp8_step_amax.copy_(amax)
            mb.fp8_step_amax.copy_(amax)
        fp8_optimizer_step(a)
        fp8_optimizer_step(b, batched=False)
    for ma, mb in zip(a, b):
        for name in ("fp8_amax_history", "fp8_scale", "fp8_scale_valid", "fp8_nonfinite_steps"):
            assert torch.equal(getattr(ma, name), getattr(mb, name)), name
