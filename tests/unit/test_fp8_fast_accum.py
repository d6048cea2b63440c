"""Fast accumulation per GEMM (`Fp8Recipe.fast_accum`, `--fp8-fast-accum`): each `_scaled_mm` of a linear layer's
fprop, dgrad and wgrad carries the recipe's `use_fast_accum`, eager and in the compiled graph (read off the
forward and backward ATen graphs, so it cannot regress unseen without a GPU). Default: fprop fast, dgrad and wgrad
with the promoted accumulation, as Transformer Engine and torchao."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Gemm, Fp8Recipe, set_fused_quantization
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import DEFAULT_FAST_ACCUM
from tests.support.config import tiny_argv
from tests.support.fp8_traced import post_grad_graphs

# Dimensions that tell the three GEMMs apart by their output: fprop [T, N], dgrad [T, K], wgrad [N, K].
T, K, N = 48, 32, 16
GEMM_OF_SHAPE = {(T, N): Fp8Gemm.FPROP, (T, K): Fp8Gemm.DGRAD, (N, K): Fp8Gemm.WGRAD}
SCALED_MM = torch.ops.aten._scaled_mm.default


def _fast_accum_arg(args: tuple, kwargs: dict) -> bool:
    if "use_fast_accum" in kwargs:
        return bool(kwargs["use_fast_accum"])
    return bool(args[7]) if len(args) > 7 else False  # the schema's default


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Fp8Gemm, list[bool]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is SCALED_MM:
            self.calls.setdefault(GEMM_OF_SHAPE[tuple(out.shape)], []).append(_fast_accum_arg(args, kwargs or {}))
        return out


def _layer(fast_accum) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear(K, N, bias=False, recipe=Fp8Recipe(backend="scaled_mm", fast_accum=fast_accum))


def _expected(fast_accum) -> dict[Fp8Gemm, list[bool]]:
    return {g: [g in Fp8Recipe(fast_accum=fast_accum).fast_accum] for g in Fp8Gemm}


@pytest.mark.parametrize("fast_accum", [DEFAULT_FAST_ACCUM, "none", "all", "dgrad,wgrad"])
def test_eager_gemms_carry_the_recipes_choice(fast_accum):
    layer = _layer(fast_accum)
    x = torch.randn(T, K, requires_grad=True)
    with _Recorder() as rec:
        layer(x).square().sum().backward()
    assert rec.calls == _expected(fast_accum)


@pytest.mark.parametrize("fast_accum", [DEFAULT_FAST_ACCUM, "all"])
def test_compiled_graph_nodes_carry_the_recipes_choice(fast_accum):
    """Read off inductor's post-grad graphs (forward and backward), the graphs its kernels are generated from."""
    layer = _layer(fast_accum)
    set_fused_quantization(layer, True)  # the traced path the compiled blocks use
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(T, K, requires_grad=True)
    seen: dict[Fp8Gemm, list[bool]] = {}
    for graph in post_grad_graphs(lambda: compiled(x).square().sum().backward()):
        for node in graph.nodes:
            if node.target is SCALED_MM:
                gemm = GEMM_OF_SHAPE[tuple(node.meta["val"].shape)]
                seen.setdefault(gemm, []).append(_fast_accum_arg(node.args, node.kwargs))
    assert seen == _expected(fast_accum)


def test_the_flag_sets_the_recipe_and_refuses_bad_values():
    recipe = parse_config(tiny_argv("--fp8-format", "hybrid")).fp8
    assert recipe.fast_accum == (Fp8Gemm.FPROP,)
    recipe = parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-fast-accum", "wgrad,fprop")).fp8
    assert recipe.fast_accum == (Fp8Gemm.FPROP, Fp8Gemm.WGRAD)
    assert Fp8Recipe.from_dict(recipe.to_dict()) == recipe
    assert recipe.to_dict()["fast_accum"] == ["fprop", "wgrad"]  # plain data in checkpoints
    with pytest.raises(ValueError, match="--fp8-fast-accum 'fprop,bwd'"):
        parse_config(tiny_argv("--fp8-format", "hybrid", "--fp8-fast-accum", "fprop,bwd"))
    with pytest.raises(ValueError, match="--fp8-fast-accum .*only apply to FP8 training"):
        parse_config(tiny_argv("--fp8-fast-accum", "all"))
