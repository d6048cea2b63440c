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


def test_settings_are_read_only_and_configure_replaces_them():
    """A layer's settings have one spelling and one way to change: `configure`, which makes a new frozen value
    (so a compiled graph that read the old one is retraced) and drops the FP8 weight when its cast changes."""
    layer = Fp8Linear(16, 8, recipe=Fp8Recipe())
    state = layer.fp8
    with pytest.raises(AttributeError):
        state.fused_quantization = True
    layer(torch.randn(4, 16))
    cached, before = state.weight_cache, state.settings
    assert cached is not None
    after = state.configure(extra_margin=[0, 2, 1], stats_enabled=True)
    assert before.extra_margin == (0, 0, 0) and after.extra_margin == (0, 2, 1) and state.settings is after
    assert state.margin(1) == state.recipe.margin + 2 and state.stats is not None
    assert state.weight_cache is cached  # the weight's cast did not change
    state.configure(current_roles=[0, 1, 0])
    assert state.current_roles == (False, True, False) and state.weight_cache is None
    layer(torch.randn(4, 16))
    state.configure(weight_per_call=True)
    assert state.weight_cache is None
    layer(torch.randn(4, 16))
    assert state.weight_cache is None  # made per call, never kept


# In-place tensor methods that would write a scaling buffer.
_WRITES = ("copy_", "zero_", "fill_", "add_", "mul_", "maximum", "_foreach_copy_", "_foreach_add_", "_foreach_zero_")


def test_the_scaling_buffers_are_written_in_scaling_py_only():
    """No code outside megatron/fp8/scaling.py calls an in-place method on a scaling buffer (`fp8_scale`,
    `fp8_amax_history`, ...) or assigns into one: every write is one of that file's functions."""
    buffer_names = tuple(new_scaling_buffers(1, "cpu"))
    found = []
    for path in (REPO / "megatron").rglob("*.py"):
        if path.name == "scaling.py" and path.parent.name == "fp8":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            written: list = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _WRITES:
                written = [node.func.value, *node.args[:1]]  # x.copy_(...), torch._foreach_copy_([x, ...], ...)
            elif isinstance(node, ast.AugAssign):
                written = [node.target]
            elif isinstance(node, ast.Assign):
                written = [t for t in node.targets if isinstance(t, ast.Subscript)]
            text = " ".join(ast.unparse(w) for w in written)
            if any(name in text for name in buffer_names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text}")
    assert not found, found
