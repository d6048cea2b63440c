"""The three GEMMs of `Fp8Linear` under the fine-grained recipes: rowwise, blockwise and MXFP8.

Every operand is scaled per *tile* along the dimension its GEMM contracts (current scaling, `quantize_tiles`).
In "NT" form (`a @ b^T`, the contraction on both operands' last dimension), with x: [M, K], W: [N, K]:

    GEMM    a      b      contracts   tiles of a        tiles of b
    fprop   x      W      K           act along K       weight along K
    dgrad   dy     W^T    N           act along N       weight along N
    wgrad   dy^T   x^T    M (tokens)  act along M       act along M

`Fp8Recipe.tiles` gives (activation tile, weight tile): rowwise (1, whole) and (1, whole); blockwise
(1, 128) and (128, 128); MXFP8 (1, 32) and (1, 32). So every tensor is needed in two layouts, one per
contraction axis, and the FP8 copy made for one GEMM does not serve the other:

- the weight: a square 128x128 block is the same block seen from either side, so blockwise transposes its
  FP8 weight and scale grid for dgrad (no requantization, as in DeepSeek-V3); rowwise and MXFP8 quantize
  W^T afresh from the high-precision weight (it is there anyway). Both layouts are cached once per step.
- the output gradient: quantized twice (along N for dgrad, along M for wgrad) from dy, which backward has.
- the input: x is gone by backward, and its fprop tiles run along K while wgrad needs tiles along M. We
  save the *second FP8 layout* (x^T quantized along M, as Transformer Engine does), not x, and not a
  requantization of the fprop layout: requantizing dequantized values rounds twice. The cost is the
  activation memory of one FP8 copy (1 byte per element plus scales; bf16's 2 bytes is no more than two FP8
  copies; MXFP8's tile scales are saved as E8M0 bytes). The error of both choices against dW from the unquantized
  x is measured in tests/unit/test_fp8_recipes.py and docs/fp8.md ("Fine-grained recipes").

Scaling state: fine-grained scales are recomputed at every use and never kept; the layer still accumulates
each role's whole-tensor amax into `fp8_step_amax` (non-finite step counting and statistics behave as under
tensorwise scaling), and its checkpoint state stays the per-tensor buffers, untouched.
Smooth-SwiGLU's `weight_column_scale` composes: W diag(c) is quantized per call, like under per-tensor
scaling; `input_amax` is not needed (each tile has its own amax) and is ignored.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from megatron.fp8 import fused, gemm_steps
from megatron.fp8.formats import Fp8FormatSpec
from megatron.fp8.layer_state import Fp8LayerState, weight_storage_key
from megatron.fp8.quantize import Tile, TiledFp8, column_scaled, from_e8m0, quantize_tiles, to_e8m0
from megatron.fp8.recipe import Fp8Gemm, Fp8Scaling
from megatron.fp8.scaling import Fp8Role

if TYPE_CHECKING:
    from megatron.fp8.backends import Backend


@dataclasses.dataclass
class TiledWeight:
    """The FP8 weight of one step in its fprop layout, and its dgrad layout (W^T) made on first need."""

    key: tuple[Any, ...] | None
    source: torch.Tensor  # the high-precision weight (or W diag(c)) the layouts are quantized from
    fprop: TiledFp8
    dgrad: TiledFp8 | None = None

    def transposed(self, state: Fp8LayerState, spec: Fp8FormatSpec) -> TiledFp8:
        if self.dgrad is None:
            tile = self.fprop.tile
            if tile.rows == tile.cols and tile.rows > 0:
                self.dgrad = self.fprop.t()
            else:
                self.dgrad = quantize_tile_role(state, Fp8Role.WEIGHT, self.source.t(), tile, spec, record=False)
        return self.dgrad


def quantize_tile_role(state: Fp8LayerState, role: Fp8Role, t: torch.Tensor, tile: Tile, spec: Fp8FormatSpec,
                       record: bool = True, stochastic_rounding: bool = False, training: bool = False) -> TiledFp8:
    """`quantize_tiles` with the layer's recipe; with `record`, statistics and (`training`) the role's amax."""
    recipe = state.recipe
    if state.fused_quantization and not stochastic_rounding:  # compiled; the eager function is its reference
        q = fused.quantize_tiles(t, tile, spec, recipe.margin, recipe.pow2_block_scales)
    else:
        q = quantize_tiles(t, tile, spec, recipe.margin, recipe.pow2_block_scales, stochastic_rounding)
    if record:
        amax = q.amax.amax() if q.amax.numel() else torch.zeros((), device=t.device)
        if training:
            state.record_amax(role, amax)
        state.record_stats(role, t, q.data, q.scale, spec, tile=tile)
    return q


def tiled_weight(state: Fp8LayerState, weight: torch.Tensor, backend: "Backend", spec: Fp8FormatSpec,
                 column_scale: torch.Tensor | None, training: bool) -> TiledWeight:
    """The cached tiled FP8 weight of this step, or Q(W diag(c)) for this call only (Smooth-SwiGLU)."""
    _, w_tile = state.recipe.tiles
    with torch.no_grad():
        if column_scale is not None:
            w = column_scaled(weight, column_scale)
            state.weight_quantizations += 1
            return TiledWeight(None, w, quantize_tile_role(state, Fp8Role.WEIGHT, w, w_tile, spec, training=training))
        key = (*weight_storage_key(weight), backend.name, "tiles")
        cache = state.weight_cache
        if not isinstance(cache, TiledWeight) or cache.key != key:
            cache = TiledWeight(key, weight, quantize_tile_role(state, Fp8Role.WEIGHT, weight, w_tile, spec,
                                                                training=training))
            state.weight_quantizations += 1
            state.cache_weight(cache)
        elif training:  # the amax of every training use, as `note_weight_use` does per tensor
            state.record_amax(Fp8Role.WEIGHT, cache.fprop.amax.amax())
    return cache


def requantized_weight(state: Fp8LayerState, weight: torch.Tensor, spec: Fp8FormatSpec,
                       column_scale: torch.Tensor | None) -> TiledWeight:
    """A per-call weight (ZeRO-3) made again in backward from the re-gathered weight: tile scales come from the
    tiles' own values, so the same weight gives the same bits. Records nothing."""
    _, w_tile = state.recipe.tiles
    with torch.no_grad():
        w = weight if column_scale is None else column_scaled(weight, column_scale)
        return TiledWeight(None, w, quantize_tile_role(state, Fp8Role.WEIGHT, w, w_tile, spec, record=False))


class TiledFp8LinearFunction(torch.autograd.Function):
    """fprop, dgrad and wgrad with tile scales (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: Fp8LayerState,
                out_dtype: torch.dtype, training: bool, column_scale: torch.Tensor | None = None) -> torch.Tensor:
        backend, specs, x2d = gemm_steps.begin(state, x)
        recipe = state.recipe
        act_tile, _ = recipe.tiles
        with torch.autocast(x.device.type, enabled=False):
            q_x = quantize_tile_role(state, Fp8Role.INPUT, x2d, act_tile, specs[Fp8Role.INPUT], training=training)
            w = tiled_weight(state, weight, backend, specs[Fp8Role.WEIGHT], column_scale, training)
            y = gemm_steps.add_bias(backend.gemm_tiles(q_x, w.fprop, out_dtype, recipe.fast_accum_for(Fp8Gemm.FPROP)),
                                    bias, out_dtype)
            wgrad_fp8 = recipe.fp8_wgrad and weight.requires_grad
            if wgrad_fp8:  # the wgrad layout: x^T tiled along the tokens
                q_xt = quantize_tile_role(state, Fp8Role.INPUT, x2d.t(), act_tile, specs[Fp8Role.INPUT], False)
                # MXFP8's scales are powers of two: kept as one E8M0 byte per tile, not four.
                scale = to_e8m0(q_xt.scale) if recipe.scaling is Fp8Scaling.MXFP8 else q_xt.scale
                ctx.save_for_backward(q_xt.data, scale, column_scale)
            else:
                ctx.save_for_backward(x2d, None, column_scale)
        ctx.wgrad_fp8 = wgrad_fp8
        return gemm_steps.finish_forward(ctx, y, x, weight, bias, state, backend, specs, w, training)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, saved_scale, column_scale = ctx.saved_tensors
        state, backend, specs, w = ctx.state, ctx.backend, ctx.specs, ctx.weight_fp8
        recipe, training = state.recipe, ctx.training
        act_tile, _ = recipe.tiles
        spec = specs[Fp8Role.GRAD_OUTPUT]
        rounding = recipe.grad_stochastic_rounding
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                if w is None:  # a per-call FP8 weight (ZeRO-3)
                    w = requantized_weight(state, ctx.weight, specs[Fp8Role.WEIGHT], column_scale)
                q_g = quantize_tile_role(state, Fp8Role.GRAD_OUTPUT, dy2d, act_tile, spec, True, rounding, training)
                dx = backend.gemm_tiles(q_g, w.transposed(state, specs[Fp8Role.WEIGHT]), ctx.x_dtype,
                                        recipe.fast_accum_for(Fp8Gemm.DGRAD))
                dx = dx.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                if ctx.wgrad_fp8:
                    q_gt = quantize_tile_role(state, Fp8Role.GRAD_OUTPUT, dy2d.t(), act_tile, spec,
                                              not ctx.needs_input_grad[0], rounding, training)
                    if saved_scale.dtype == torch.uint8:
                        saved_scale = from_e8m0(saved_scale)
                    q_xt = TiledFp8(saved, saved_scale, saved_scale, act_tile)  # amax is not needed here
                    dw = backend.gemm_tiles(q_gt, q_xt, torch.float32, recipe.fast_accum_for(Fp8Gemm.WGRAD))
                else:
                    dw = gemm_steps.high_precision_wgrad(dy2d, saved)
                dw = gemm_steps.finish_weight_grad(ctx, dw, column_scale)
            db = gemm_steps.bias_grad(ctx, dy2d)
        return dx, dw, db, None, None, None, None
