"""The functional core of the FP8 linear: the autograd functions take a layer state and tensors, never the module.

`Fp8LayerState` (megatron/fp8/layer_state.py) with the buffers of `scaling.new_scaling_buffers` is all the
per-tensor and tiled autograd functions need: driven without any module they give the module's results bit for
bit, and what they keep for backward holds no module. The files beneath `linear.py` do not import it (the import
circle linear <-> gemm_steps/tiled/traced/stats is gone)."""
from __future__ import annotations

import ast

import pytest
import torch
import torch.nn as nn

from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step
from megatron.fp8.layer_state import Fp8LayerState
from megatron.fp8 import per_tensor
from megatron.fp8.recipe import Fp8Scaling
from megatron.fp8.scaling import new_scaling_buffers
from megatron.fp8.tiled import TiledFp8LinearFunction
from tests.support.config import REPO
from tests.support.fp8_reference import fp8_node, kept_state_and_weight

BENEATH_LINEAR = ("layer_state", "per_tensor", "tiled", "traced", "gemm_steps", "stats", "fused", "quantize",
                  "scaling", "backends", "partition")


def _module_free_run(recipe: Fp8Recipe, weight: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Three training steps through the autograd function alone: y, dx, dW per step and the scaling buffers."""
    state = Fp8LayerState(recipe)
    state.bind(new_scaling_buffers(recipe.amax_history_len, "cpu"))
    weight = weight.detach().clone().requires_grad_(True)
    out = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        if recipe.tiles is not None:
            y = TiledFp8LinearFunction.apply(x, weight, None, state, torch.float32, True)
        else:
            y = per_tensor.forward(state, x, weight, None, torch.float32, True)
        node = fp8_node(y)  # nothing of a module kept
        kept = [*vars(node).values(), *vars(getattr(node, "eager", None) or node).values()]
        assert not any(isinstance(v, nn.Module) for v in kept)
        y.square().sum().backward()
        out += [y.detach(), x.grad, weight.grad.clone()]
        weight.grad = None
        _update(state)
    return out + [state.buffers[name].clone() for name in ("fp8_amax_history", "fp8_scale", "fp8_step_amax")]


def _update(state: Fp8LayerState) -> None:
    """What `fp8_optimizer_step` does for one layer, through a module made around the same state."""
    holder = Fp8Linear(1, 1, bias=False, recipe=state.recipe)
    holder.fp8 = state
    holder._buffers.update(state.buffers)
    fp8_optimizer_step(holder)


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise", "blockwise"])
def test_the_autograd_function_on_a_bare_state_equals_the_module(scaling):
    torch.manual_seed(0)
    recipe = Fp8Recipe(scaling=Fp8Scaling(scaling))
    layer = Fp8Linear(256, 128, bias=False, recipe=recipe)
    xs = [torch.randn(32, 256) * s for s in (1.0, 4.0, 0.25)]
    want = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        y = layer(x)
        assert kept_state_and_weight(y)[0] is layer.fp8
        y.square().sum().backward()
        want += [y.detach(), x.grad, layer.weight.grad.clone()]
        layer.weight.grad = None
        fp8_optimizer_step(layer)
    want += [layer.fp8_amax_history.clone(), layer.fp8_scale.clone(), layer.fp8_step_amax.clone()]
    got = _module_free_run(recipe, layer.weight, xs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_state_follows_the_modules_buffers():
    """`.to()` replaces the module's buffers; the state reads the module's buffer dict, so it sees the new ones (and
    drops the FP8 weight made from the old storage)."""
    layer = Fp8Linear(16, 8, recipe=Fp8Recipe())
    layer(torch.randn(4, 16)).sum().backward()
    assert layer.fp8.weight_cache is not None
    layer.to(torch.float64)
    for name in ("fp8_scale", "fp8_step_amax", "fp8_amax_history"):
        assert layer.fp8.buffers[name] is getattr(layer, name)
    assert layer.fp8.weight_cache is None
    scale_row, amax_row = layer.fp8.role_rows(0)
    assert scale_row._base is layer.fp8_scale and amax_row._base is layer.fp8_step_amax


def test_the_files_beneath_the_layer_do_not_import_it():
    for name in BENEATH_LINEAR:
        tree = ast.parse((REPO / "megatron" / "fp8" / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not {"megatron.fp8.linear", "megatron.fp8.convert"} & imported, name
