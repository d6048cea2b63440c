"""The three GEMMs of an FP8 linear with one scale per tensor (delayed and tensorwise scaling), run eagerly.

`Fp8LinearFunction` takes the layer's state (`layer_state.Fp8LayerState`) and tensors, never the module; the
arithmetic is described in linear.py's docstring. The fine-grained recipes are in tiled.py, the version dynamo
traces into a compiled block in traced.py.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron.fp8 import fused, gemm_steps
from megatron.fp8.layer_state import Fp8LayerState
from megatron.fp8.quantize import amax_of, nonfinite_guard
from megatron.fp8.recipe import Fp8Gemm
from megatron.fp8.scaling import Fp8Role


class Fp8LinearFunction(torch.autograd.Function):
    """fprop, dgrad and wgrad with per-tensor scales. `training`: the call feeds the scaling state (amaxes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: Fp8LayerState,
                out_dtype: torch.dtype, training: bool, column_scale: torch.Tensor | None = None,
                input_amax: torch.Tensor | None = None, column_scale_group: Any = None) -> torch.Tensor:
        backend, specs, x2d = gemm_steps.begin(state, x)
        values_dtype = state.values_dtype(backend)
        recipe = state.recipe
        # Autocast would turn the fp32 GEMM of the emulated backend into bf16; every dtype here is explicit.
        with torch.autocast(x.device.type, enabled=False):
            q_x, v_x, s_x, x_amax = state.quantize_input(backend, specs[Fp8Role.INPUT], x2d, input_amax, values_dtype,
                                                         training)
            state.record_stats(Fp8Role.INPUT, x2d, q_x, s_x, specs[Fp8Role.INPUT])
            if column_scale is None:
                w = state.quantized_weight(weight, backend, specs[Fp8Role.WEIGHT])
            else:
                w = state.quantized_scaled_weight(weight, backend, specs[Fp8Role.WEIGHT], column_scale,
                                                  column_scale_group)
            state.note_weight_use(w.scale, w.amax, training, w)
            # Quantized with the real scales (the clamp saturates inf), multiplied out with guarded ones: an
            # inf/NaN operand makes the whole output NaN, as nn.Linear's would be non-finite.
            s_x = nonfinite_guard(s_x, x_amax)
            pow2 = recipe.power_of_two_scales
            y = backend.gemm_nt(q_x if v_x is None else v_x, s_x, w.weight(backend, pow2), w.gemm_scale(), out_dtype,
                                pow2, state.fused_quantization, recipe.fast_accum_for(Fp8Gemm.FPROP))
            y = gemm_steps.add_bias(y, bias, out_dtype)
        saved_x = q_x if recipe.fp8_wgrad else x2d
        ctx.save_for_backward(saved_x, s_x, column_scale)
        ctx.weight_scale, ctx.weight_amax = w.scale, w.amax  # a per-call weight is requantized with them
        return gemm_steps.finish_forward(ctx, y, x, weight, bias, state, backend, specs, w, training)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved_x, s_x, column_scale = ctx.saved_tensors
        state, backend, specs, w = ctx.state, ctx.backend, ctx.specs, ctx.weight_fp8
        recipe = state.recipe
        grad_spec = specs[Fp8Role.GRAD_OUTPUT]
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        values_dtype = state.values_dtype(backend)
        with torch.autocast(dy.device.type, enabled=False):
            v_g = None
            if values_dtype is not False and not recipe.grad_stochastic_rounding:
                q_g, v_g, s_g, g_amax = state.fused_quantize(Fp8Role.GRAD_OUTPUT, dy2d, grad_spec, values_dtype,
                                                             ctx.training)
            else:  # stochastic rounding draws its noise eagerly (the generator's stream stays the eager one)
                g_amax = amax_of(dy2d)
                s_g = state.scale_for(Fp8Role.GRAD_OUTPUT, g_amax, grad_spec, ctx.training)
                q_g = backend.quantize(dy2d, s_g, grad_spec, recipe.grad_stochastic_rounding)
            state.record_stats(Fp8Role.GRAD_OUTPUT, dy2d, q_g, s_g, grad_spec)
            # An inf/NaN in dy must reach dx and dW (the clamp would turn inf into +-max and hide the overflow
            # from the loop's non-finite guard); s_x already carries the guard of the forward input.
            s_g = nonfinite_guard(s_g, g_amax)
            pow2, fused_epilogue = recipe.power_of_two_scales, state.fused_quantization
            if ctx.needs_input_grad[0]:
                if w is None:  # a per-call FP8 weight (ZeRO-3): made again from the re-gathered weight
                    w = state.requantized_weight(ctx.weight, backend, specs[Fp8Role.WEIGHT], ctx.weight_scale,
                                                 ctx.weight_amax, column_scale)
                # dx = dy W  ==  gemm_nt(dy, W^T)
                dx = backend.gemm_nt(q_g if v_g is None else v_g, s_g, w.weight_t(backend, pow2), w.gemm_scale(),
                                     ctx.x_dtype, pow2, fused_epilogue, recipe.fast_accum_for(Fp8Gemm.DGRAD))
                dx = dx.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                if recipe.fp8_wgrad:
                    # dW = dy^T x  ==  gemm_nt(dy^T, x^T)
                    if values_dtype is not False and values_dtype is not None:  # emulated: exact fp32 values
                        saved_x = fused.upcast(saved_x, values_dtype)
                    dw = backend.gemm_nt((q_g if v_g is None else v_g).t(), s_g, saved_x.t(), s_x, torch.float32, pow2,
                                         fused_epilogue, recipe.fast_accum_for(Fp8Gemm.WGRAD))
                else:
                    dw = gemm_steps.high_precision_wgrad(dy2d, saved_x)
                dw = gemm_steps.finish_weight_grad(ctx, dw, column_scale)
            db = gemm_steps.bias_grad(ctx, dy2d)
        return dx, dw, db, None, None, None, None, None, None
