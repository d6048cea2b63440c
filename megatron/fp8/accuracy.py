"""Accuracy of a recipe on one GEMM, from the same quantization code the layers run (for tests, bench, docs).

`fprop_operands(x, w, recipe)` returns x and W as the forward GEMM of `Fp8Linear` sees them (quantized with
the recipe's tiles and formats, then dequantized exactly), so the SQNR of any product of them against the
float64 product measures the recipe alone. Per-tensor recipes are the one-tile case (`Tile(0, 0)`), with
current scaling (a delayed scale from a history is a different experiment).

`wgrad_layout_sqnr(x, dy, recipe)` measures the choice made in tiled.py for the weight gradient: the saved
second FP8 layout of x (x^T tiled along the tokens, quantized from x) against requantizing the fprop layout
(x tiled along K, dequantized, then tiled along the tokens), both against dy^T x in float64, with dy
unquantized so that only x's layout differs.
"""
from __future__ import annotations

import torch

from megatron.fp8.formats import Fp8FormatSpec, format_spec
from megatron.fp8.quantize import Tile, dequantize_tiles, quantize_tiles
from megatron.fp8.recipe import Fp8Recipe
from megatron.fp8.scaling import Fp8Role, role_dtypes
from megatron.fp8.stats import sqnr_db

PER_TENSOR = Tile(0, 0)


def recipe_tiles(recipe: Fp8Recipe) -> tuple[Tile, Tile]:
    """(activation/gradient tile, weight tile); one tile per tensor for delayed and tensorwise scaling."""
    return recipe.tiles or (PER_TENSOR, PER_TENSOR)


def recipe_specs(recipe: Fp8Recipe, backend: str = "cpu") -> tuple[Fp8FormatSpec, ...]:
    return tuple(format_spec(d, backend) for d in role_dtypes(recipe))


def fake_quantize(t: torch.Tensor, tile: Tile, spec: Fp8FormatSpec, recipe: Fp8Recipe) -> torch.Tensor:
    """t quantized with one current scale per tile and dequantized (fp32)."""
    return dequantize_tiles(quantize_tiles(t, tile, spec, recipe.margin, recipe.pow2_block_scales))


def fprop_operands(x: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, W) as the forward GEMM multiplies them: x [M, K] tiled along K, W [N, K] with the weight tile."""
    act, weight = recipe_tiles(recipe)
    specs = recipe_specs(recipe)
    return (fake_quantize(x, act, specs[Fp8Role.INPUT], recipe),
            fake_quantize(w, weight, specs[Fp8Role.WEIGHT], recipe))


def wgrad_layout_sqnr(x: torch.Tensor, dy: torch.Tensor, recipe: Fp8Recipe) -> dict[str, float]:
    """SQNR (dB) of dW = dy^T x with x from the saved second layout vs from the requantized fprop layout."""
    act, _ = recipe_tiles(recipe)
    specs = recipe_specs(recipe)
    exact = dy.double().t() @ x.double()
    g = dy.t().double()  # unquantized: the SQNR is that of x's layout alone
    second = fake_quantize(x.t(), act, specs[Fp8Role.INPUT], recipe)
    fprop_x = fake_quantize(x, act, specs[Fp8Role.INPUT], recipe)
    requantized = fake_quantize(fprop_x.t(), act, specs[Fp8Role.INPUT], recipe)
    return {"second_layout": sqnr_db(g @ second.double().t(), exact),
            "requantized": sqnr_db(g @ requantized.double().t(), exact)}
