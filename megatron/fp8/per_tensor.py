"""The three GEMMs of an FP8 linear with one scale per tensor (delayed and tensorwise scaling): one autograd
Function, `Fp8Gemms`, for the eager layer (`forward` below) and for the layer traced into a compiled block
(traced.py).

x and W are quantized before the Function (here eagerly, in traced.py inside the block's graph); the Function takes
the quantized operands, their scales and a tuple of constants (`gemm_constants`), runs fprop, and in backward
quantizes dy and runs dgrad and wgrad. How dy is quantized is the one thing that differs: traced, by the fused cast
inside the Function, which updates the grad role's scaling buffers in place (passed in as tensors); eager, by the
layer's state (`_EagerCall`), which also covers what only runs eagerly: stochastic rounding of gradients,
unfused casts, statistics, the Gaudi backend, and a weight cast again in backward under ZeRO-3 (per-call weights).
The arithmetic is described in linear.py's docstring. The tile recipes keep a Function of their own (tiled.py):
their GEMMs take a scale per tile, and dy is cast twice there, in row tiles for dgrad and column tiles for wgrad.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.fp8 import fused, gemm_steps
from megatron.fp8.backends import STATELESS_BACKENDS, Backend
from megatron.fp8.layer_state import Fp8LayerState, QuantizedWeight
from megatron.fp8.quantize import amax_of, nonfinite_guard
from megatron.fp8.recipe import Fp8Gemm
from megatron.fp8.scaling import Fp8Role, record_step_amax

# The roles as plain ints: dynamo (torch 2.13) recurses without end indexing a tuple with an IntEnum member.
ROLE_INPUT, ROLE_WEIGHT, ROLE_GRAD = (int(role) for role in (Fp8Role.INPUT, Fp8Role.WEIGHT, Fp8Role.GRAD_OUTPUT))
# The GEMMs in order, iterated here: dynamo (torch 2.11) breaks the graph iterating an Enum class.
_GEMMS = tuple(Fp8Gemm)


def gemm_constants(state: Fp8LayerState, backend: Backend, out_dtype: torch.dtype, x_dtype: torch.dtype,
                   w_dtype: torch.dtype, training: bool, values_dtype: Any, fused_epilogue: bool) -> tuple:
    """The Python constants of one `Fp8Gemms` call, a plain tuple (what dynamo takes as a constant): backend name,
    output / input / weight dtypes, power-of-two scales, FP8 wgrad, training, and dy's cast (delayed, tensorwise,
    margin, format max, FP8 dtype, values dtype, fast accumulation per GEMM, delayed scale known valid), the
    GEMMs' fused epilogue."""
    recipe, g_spec = state.recipe, state.specs(backend)[ROLE_GRAD]
    delayed = state.role_delayed(ROLE_GRAD)
    return (backend.name, out_dtype, x_dtype, w_dtype, recipe.power_of_two_scales, recipe.fp8_wgrad, training,
            delayed, recipe.scaling.value == "tensorwise", state.margin(ROLE_GRAD), g_spec.max, g_spec.torch_dtype,
            values_dtype, tuple(recipe.fast_accum_for(g) for g in _GEMMS), state.known_valid[ROLE_GRAD] and delayed,
            fused_epilogue)


@dataclass
class _EagerCall:
    """What the eager layer's backward needs besides tensors: its state and backend (maybe a stateful one), dy's
    format, and the forward's FP8 weight, or how to cast it again (per-call weights: `weight` is the parameter,
    which DeepSpeed re-gathers before backward; the FP8 copy is not kept from forward to backward)."""

    state: Fp8LayerState
    backend: Backend
    specs: tuple
    weight: torch.Tensor
    weight_fp8: QuantizedWeight | None
    weight_scale: torch.Tensor
    weight_amax: torch.Tensor
    column_scale: torch.Tensor | None

    def quantize_grad(self, dy2d: torch.Tensor, values_dtype: Any, training: bool) -> tuple:
        """(Q(dy) or None where only its values are made, its values for the GEMM or None, scale, amax), recorded for
        the next scales when `training`."""
        state, spec = self.state, self.specs[ROLE_GRAD]
        stochastic = state.recipe.grad_stochastic_rounding
        if values_dtype is not False and not stochastic:
            # Where the GEMMs multiply the values, Q(dy) itself only feeds the statistics (E5M2's conversion is the
            # slow part of the cast on CPU); `quantize_tensor` keeps it where there are no values.
            q_g, v_g, s_g, g_amax = state.fused_quantize(Fp8Role.GRAD_OUTPUT, dy2d, spec, values_dtype, training,
                                                         keep_q=state.stats_enabled)
        elif stochastic:  # draws its noise eagerly (the generator's stream stays the eager one)
            g_amax, v_g = amax_of(dy2d), None
            s_g = state.scale_for(Fp8Role.GRAD_OUTPUT, g_amax, spec, training)
            q_g = self.backend.quantize(dy2d, s_g, spec, stochastic)
        else:  # the eager layer: as it casts x (`Fp8LayerState.eager_cast`)
            q_g, v_g, s_g, g_amax = state.eager_cast(Fp8Role.GRAD_OUTPUT, self.backend, dy2d, spec, training)
        state.record_stats(Fp8Role.GRAD_OUTPUT, dy2d, v_g if q_g is None else q_g, s_g, spec)
        return q_g, v_g, s_g, g_amax

    def weight_t(self, pow2: bool) -> torch.Tensor:
        """dgrad's W^T: the forward's FP8 weight transposed (a row-major copy, cached for the step, for backends
        that want one), or for a per-call weight the same FP8 weight made again from the re-gathered parameter."""
        w = self.weight_fp8
        if w is None:
            w = self.state.requantized_weight(self.weight, self.backend, self.specs[ROLE_WEIGHT], self.weight_scale,
                                              self.weight_amax, self.column_scale)
        return w.weight_t(self.backend, pow2)


def forward(state: Fp8LayerState, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype, training: bool, column_scale: torch.Tensor | None = None,
            input_amax: torch.Tensor | None = None, column_scale_group: Any = None) -> torch.Tensor:
    """The eager layer: y = Q(x) Q(W)^T + b (W diag(c) with `column_scale`, its amax max-reduced over
    `column_scale_group`); `training`: the call feeds the scaling state (amaxes)."""
    backend, specs, x2d = gemm_steps.begin(state, x)
    values_dtype = state.values_dtype(backend)
    recipe = state.recipe
    # BF16 values (cpu_gemm's bf16 mode): wgrad takes the forward's values, saved as the compiled block saves them
    # (partition.py), instead of converting Q(x) again in backward, and Q(x) is made for the statistics only.
    values_only = values_dtype is torch.bfloat16 and recipe.fp8_wgrad
    # Autocast would turn the fp32 GEMM of the emulated backend into bf16; every dtype here is explicit.
    with torch.autocast(x.device.type, enabled=False), torch.no_grad():
        q_x, v_x, s_x, x_amax = state.quantize_input(backend, specs[ROLE_INPUT], x2d, input_amax, values_dtype,
                                                     training, state.known_valid[ROLE_INPUT],
                                                     keep_q=not values_only or state.stats_enabled)
        state.record_stats(Fp8Role.INPUT, x2d, v_x if q_x is None else q_x, s_x, specs[ROLE_INPUT])
        if column_scale is None:
            w = state.quantized_weight(weight, backend, specs[ROLE_WEIGHT])
        else:
            w = state.quantized_scaled_weight(weight, backend, specs[ROLE_WEIGHT], column_scale, column_scale_group)
        state.note_weight_use(w.scale, w.amax, training, w)
        # Quantized with the real scales (the clamp saturates inf), multiplied out with guarded ones: an inf/NaN
        # operand makes the whole output NaN, as nn.Linear's would be non-finite.
        s_x = nonfinite_guard(s_x, x_amax)
    per_call = state.weight_per_call
    eager = _EagerCall(state, backend, specs, weight, None if per_call else w, w.scale, w.amax, column_scale)
    consts = gemm_constants(state, backend, out_dtype, x.dtype, weight.dtype, training, values_dtype,
                            state.fused_quantization)
    saved_x = (None if v_x is None or values_only else q_x) if recipe.fp8_wgrad else x2d.detach()
    y2d = Fp8Gemms.apply(x2d, weight, bias, q_x if v_x is None else v_x, s_x,
                         w.weight(backend, recipe.power_of_two_scales), w.gemm_scale(), None, saved_x, column_scale,
                         state.scale, state.scale_valid, state.step_amax, consts, eager)
    return y2d.reshape(*x.shape[:-1], y2d.shape[-1])


class Fp8Gemms(torch.autograd.Function):
    """fprop on quantized operands; dgrad and wgrad with dy quantized in backward (module docstring). Inputs 0-2
    (x as [tokens, K], W, b) carry the gradients; the rest are operands, buffers and constants."""

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                s_a: torch.Tensor, w: torch.Tensor, s_w: torch.Tensor, w_t: torch.Tensor | None,
                saved_x: torch.Tensor | None, column_scale: torch.Tensor | None, scale_buf: torch.Tensor,
                valid_buf: torch.Tensor, step_amax_buf: torch.Tensor, consts: tuple,
                eager: _EagerCall | None) -> torch.Tensor:
        """`a`, `w`: Q(x) and Q(W) as the GEMM takes them; `w_t`: dgrad's W^T when made already (the traced path's
        step weight), else None; `saved_x`: what wgrad reads (Q(x), or x for a high-precision wgrad), None for `a`
        itself (dynamo refuses one tensor passed twice); the buffers: the layer's scaling state (the traced cast of
        dy updates them); `eager`: the eager layer's call, None when traced."""
        backend = _backend(consts, eager)
        out_dtype, pow2, fast_accum, fused_epilogue = consts[1], consts[4], consts[13][0], consts[15]
        with torch.autocast(x2d.device.type, enabled=False):
            y = gemm_steps.add_bias(backend.gemm_nt(a, s_a, w, s_w, out_dtype, pow2, fused_epilogue, fast_accum,
                                                    run_dtype=out_dtype), bias, out_dtype)
        keep_w = eager is None or eager.weight_fp8 is not None  # a per-call weight is made again in backward
        if eager is not None:  # the eager layer's buffers are read through its state; other calls may update them
            scale_buf = valid_buf = step_amax_buf = None
        ctx.save_for_backward(a if saved_x is None else saved_x, s_a, w if keep_w else None, s_w, w_t, column_scale,
                              scale_buf, valid_buf, step_amax_buf)
        ctx.consts, ctx.eager, ctx.has_bias, ctx.w_dtype = consts, eager, bias is not None, consts[3]
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved_x, s_x, w, s_w, w_t, column_scale, scale_buf, valid_buf, step_amax_buf = ctx.saved_tensors
        consts, eager = ctx.consts, ctx.eager
        (_, y_dtype, x_dtype, _, pow2, fp8_wgrad, training, _, _, _, _, _, values_dtype, (_, dgrad_fast, wgrad_fast), _,
         fused_epilogue) = consts
        backend = _backend(consts, eager)
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            if eager is None:
                q_g, v_g, s_g, g_amax = _traced_grad_cast(dy.detach(), scale_buf, valid_buf, step_amax_buf, consts)
            else:
                q_g, v_g, s_g, g_amax = eager.quantize_grad(dy, values_dtype, training)
            # An inf/NaN in dy must reach dx and dW (the clamp would turn inf into +-max and hide the overflow
            # from the loop's non-finite guard); s_x already carries the guard of the forward input.
            s_g = nonfinite_guard(s_g, g_amax)
            g_op = q_g if v_g is None else v_g
            if ctx.needs_input_grad[0]:
                if w_t is None:
                    w_t = _weight_t(w, backend, pow2, eager)
                # dx = dy W  ==  gemm_nt(dy, W^T)
                dx = backend.gemm_nt(g_op, s_g, w_t, s_w, x_dtype, pow2, fused_epilogue, dgrad_fast, run_dtype=y_dtype)
            if ctx.needs_input_grad[1]:
                if fp8_wgrad:
                    # dW = dy^T x  ==  gemm_nt(dy^T, x^T); the emulated GEMM's operand as exact fp32 values
                    x_op = saved_x if values_dtype is False or values_dtype is None else fused.upcast(saved_x,
                                                                                                      values_dtype)
                    dw = backend.gemm_nt(g_op.t(), s_g, x_op.t(), s_x, torch.float32, pow2, fused_epilogue, wgrad_fast,
                                         run_dtype=y_dtype)
                else:
                    dw = gemm_steps.high_precision_wgrad(dy, saved_x)
                dw = gemm_steps.finish_weight_grad(ctx, dw, column_scale)
            db = gemm_steps.bias_grad(ctx, dy)
        return (dx, dw, db) + (None,) * 12


def _backend(consts: tuple, eager: _EagerCall | None) -> Backend:
    """The eager call's backend (maybe stateful: Gaudi), else the stateless one the traced path named."""
    return STATELESS_BACKENDS[consts[0]] if eager is None else eager.backend


def _traced_grad_cast(dy: torch.Tensor, scale_buf: torch.Tensor, valid_buf: torch.Tensor,
                      step_amax_buf: torch.Tensor, consts: tuple) -> tuple:
    """dy's fused cast inside the graph; a training call records its amax (and tensorwise scale) in the buffers."""
    (_, _, _, _, pow2, _, training, delayed, tensorwise, margin, g_max, g_dtype, values_dtype, _,
     known_valid, _) = consts
    g = ROLE_GRAD
    q_g, v_g, s_g, g_amax = fused.quantize_tensor(dy, scale_buf[g], valid_buf[g], delayed, g_max, margin, pow2,
                                                  g_dtype, values_dtype, known_valid)
    if training:
        record_step_amax(step_amax_buf[g], g_amax, scale_buf[g], s_g if tensorwise else None)
    return q_g, v_g, s_g, g_amax


def _weight_t(w: torch.Tensor | None, backend: Backend, pow2: bool, eager: _EagerCall | None) -> torch.Tensor:
    """dgrad's W^T when the caller did not pass it: the eager call's (cached per step, or made again), else from
    the forward's operand (a weight made per call in the graph, such as Smooth-SwiGLU's W diag(c))."""
    if eager is not None:
        return eager.weight_t(pow2)
    return w.t().contiguous() if backend.wants_contiguous_operands else w.t()
