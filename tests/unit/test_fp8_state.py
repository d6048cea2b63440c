"""FP8 checkpoint state: round trip through torch.save / torch.load(weights_only=True), mismatch messages."""
from __future__ import annotations

import io

import pytest
import torch

from megatron.fp8 import Fp8Linear, Fp8Recipe, convert_to_fp8, fp8_optimizer_step, fp8_state_dict, \
    load_fp8_state_dict
from tests.support.fp8_reference import TinyGPT


def _trained(recipe: Fp8Recipe, steps: int = 3) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    convert_to_fp8(model, recipe)
    for step in range(steps):
        tokens = torch.randint(0, 128, (2, 16))
        model(tokens).float().square().mean().mul(step + 1).backward()
        fp8_optimizer_step(model)
    return model


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _fp8_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.{b}": getattr(m, b) for n, m in model.named_modules() if isinstance(m, Fp8Linear)
            for b in ("fp8_amax_history", "fp8_scale", "fp8_scale_valid")}


def test_round_trip_restores_histories_and_scales() -> None:
    recipe = Fp8Recipe(amax_history_len=4, amax_compute_algo="max")
    model = _trained(recipe)
    state = _round_trip(fp8_state_dict(model, recipe))
    assert state["format_version"] == 1 and state["recipe"]["scaling"] == "delayed"
    layer = state["layers"]["decoder.layers.0.mlp.linear_fc1"]
    assert layer["num_updates"] == 3 and layer["grad_output"]["amax_history"].shape == (4,)
    fresh = TinyGPT(layers=3)
    convert_to_fp8(fresh, recipe)
    load_fp8_state_dict(fresh, recipe, state)
    want, got = _fp8_buffers(model), _fp8_buffers(fresh)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert any(v.abs().sum() > 0 for k, v in got.items() if k.endswith("history"))
    assert fresh.decoder.layers[0].mlp.linear_fc1.fp8.num_updates == 3


def test_other_recipe_is_rejected_with_the_differences() -> None:
    saved = Fp8Recipe(amax_history_len=4, amax_compute_algo="max")
    state = fp8_state_dict(_trained(saved, steps=1), saved)
    current = Fp8Recipe(amax_history_len=8, amax_compute_algo="max", margin=1)
    model = TinyGPT(layers=3)
    convert_to_fp8(model, current)
    with pytest.raises(ValueError) as err:
        load_fp8_state_dict(model, current, state)
    message = str(err.value)
    assert "amax_history_len: saved 4 vs current 8" in message and "margin: saved 0 vs current 1" in message
    assert "amax_compute_algo" not in message
    # The backend may differ (resuming on other hardware).
    moved = Fp8Recipe(amax_history_len=4, amax_compute_algo="max", backend="emulated")
    model = TinyGPT(layers=3)
    convert_to_fp8(model, moved)
    load_fp8_state_dict(model, moved, state)


def test_missing_and_extra_layers_are_listed() -> None:
    recipe = Fp8Recipe()
    state = fp8_state_dict(_trained(recipe, steps=1), recipe)
    model = TinyGPT(layers=3)
    convert_to_fp8(model, recipe, module_filter=lambda fqn, m: "linear_fc2" not in fqn)
    with pytest.raises(ValueError) as err:
        load_fp8_state_dict(model, recipe, state)
    assert "in the checkpoint but not in the model: ['decoder.layers.0.mlp.linear_fc2'" in str(err.value)
    state["layers"]["decoder.layers.9.mlp.linear_fc1"] = state["layers"].pop("decoder.layers.0.mlp.linear_fc1")
    with pytest.raises(ValueError, match=r"in the model but not in the checkpoint: \['decoder.layers.0.mlp.linear_fc1'\]"):
        load_fp8_state_dict(model, recipe, state)
    with pytest.raises(ValueError, match="format_version"):
        load_fp8_state_dict(model, recipe, {**state, "format_version": 99})
