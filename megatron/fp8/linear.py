"""`Fp8Linear`: an `nn.Linear` whose three GEMMs run in FP8.

The three GEMMs
---------------
For y = x W^T + b with x: [M, K] (M = tokens, any leading dims flattened), W: [N, K]:

    fprop  y  = x  W^T     Q_e4m3(x)   x Q_e4m3(W)          -> [M, N]
    dgrad  dx = dy W       Q_e5m2(dy)  x Q_e4m3(W)          -> [M, K]
    wgrad  dW = dy^T x     Q_e5m2(dy)  x Q_e4m3(x)          -> [N, K]

Formats: the "hybrid" recipe (default) uses E4M3 (3 mantissa bits, max 448; 240 on Gaudi2) for the forward
operands, which need precision, and E5M2 (2 mantissa bits, max 57344) for gradients, which need range.
The "e4m3" recipe uses E4M3 for gradients too. With `recipe.fp8_wgrad=False` the wgrad GEMM runs in high
precision (fp32 accumulation of the unquantized dy and x); the input is then saved unquantized for it, as in
Transformer Engine, trading the activation-memory saving for exact weight gradients.

Every operand is quantized per tensor: `q = cast(clamp(t * s, -max, max))` with one fp32 scale `s` per
tensor role (input, weight, grad_output), chosen by delayed or current scaling (see `scaling.py`). The
fine-grained recipes (rowwise, blockwise, mxfp8) scale per tile instead: their GEMMs are in `tiled.py`. The GEMMs
accumulate in FP32 and write the output in the compute dtype: the autocast dtype (bf16) under
`torch.autocast`, otherwise the input's dtype. dW is returned in the weight's dtype (fp32 master weights).

Layout rules
------------
Backends get every GEMM in "NT" form, `gemm_nt(a, b) = a @ b^T` with a: [M, K], b: [N, K] (see
`backends.py`). fprop is already NT with the stored weight. dgrad passes `b = W^T` and wgrad passes
`a = dy^T, b = x^T`: transposed *views*, which the emulated and Gaudi backends use as they are and the CUDA
backend (`torch._scaled_mm` wants its second operand column-major, i.e. b row-major) turns into copies. FP8
transposes are cheap (1 byte per element); the transposed weight is cached once per step with the weight.

Memory and caching
------------------
The input is saved for backward as FP8 (1 byte per element plus its scale) instead of bf16/fp32: that is the
activation-memory saving. The weight is quantized once per optimizer step and the FP8 copy is reused by every
micro-batch's forward and backward; `fp8_optimizer_step` drops the cache after each step. As a safety net the
cache is also keyed on the weight's version counter and storage, so an in-place update made without the hook
is noticed (an update through `.data` is not: call the hook). Under ZeRO-3 (`fp8_weight_per_call`, set by the
DeepSpeed engine) the weight exists only while gathered, and an FP8 copy kept per layer would hold the whole model
again on every rank: the layer then quantizes per forward, keeps no copy, and its backward requantizes the
re-gathered weight with the forward's scale (bitwise the same FP8 weight).

Per-input-channel weight scale (Smooth-SwiGLU, channel form)
-----------------------------------------------------------
`forward(x, weight_column_scale=c)` computes y = Q(x) Q(W diag(c))^T: the columns of W (its input channels)
are multiplied by c *before* quantization, so one FP8 GEMM still does the whole product. W diag(c) is a new
tensor whenever c changes (every micro-batch under Smooth-SwiGLU), so such a call bypasses the per-step
weight cache and quantizes afresh (counted in `fp8_weight_quantizations`), always with a scale from its own
amax (a history of other tensors' amaxes would lag and clip it); its amax still feeds the weight role's
statistics and history. That amax needs no pass over W: it is max_j(colmax_j |c_j|), bitwise, from W's column
maxima, which change once per optimizer step and are computed once per step (`column_maxima`, counted in
`fp8_column_maxima_passes`; the eager reference without fused quantization reduces W diag(c) itself).
Under tensor parallelism W is a shard of the logical weight: `column_scale_group` (the TP group) max-reduces
that amax so every shard uses the scale the whole W diag(c) would get (one scalar all-reduce per call).
Gradients: dx from Q(W diag(c)), dW = (dy^T x) diag(c), none through c.
`input_amax`, when the caller already knows max|x| exactly (Smooth-SwiGLU gets it from its channel maxima),
saves the reduction over x and, being this tensor's own amax, sets x's scale just in time under delayed
scaling too (its amax still feeds the input role's history): current scaling for free. Smooth-SwiGLU needs
it because its split leaves part of an outlier in x, which a scale from earlier steps would clip.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from megatron import comm
from megatron.fp8 import fused, gemm_steps, traced
from megatron.fp8 import stats as fp8_stats
from megatron.fp8.backends import Backend, backend_format_spec, select_backend
from megatron.fp8.formats import Fp8FormatSpec
from megatron.fp8.quantize import amax_of, column_scaled, compute_scale, nonfinite_guard
from megatron.fp8.recipe import Fp8Gemm, Fp8Recipe, Fp8Scaling
from megatron.fp8.scaling import Fp8Role, new_scaling_buffers, record_step_amax, role_dtypes
from megatron.fp8.tiled import TiledFp8LinearFunction, TiledWeight


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMMs' output dtype: the autocast dtype under autocast, else the input's."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


@dataclasses.dataclass
class _QuantizedWeight:
    """The FP8 weight of one optimizer step (and its transpose, made on first need)."""

    key: tuple[Any, ...]
    data: torch.Tensor  # [N, K] FP8
    scale: torch.Tensor
    amax: torch.Tensor
    transposed: torch.Tensor | None = None  # [K, N] FP8, row-major; only for backends that want copies
    values: torch.Tensor | None = None  # the FP8 values in bf16/fp32 (exact); only for the emulated backend
    guarded: torch.Tensor | None = None  # the scale the GEMMs take (`nonfinite_guard`), made on first need
    recorded: bool = False  # its amax is in the step's running amax (once per step is enough: max is idempotent)

    def gemm_scale(self) -> torch.Tensor:
        """The scale multiplied out of the GEMMs: NaN if W held an inf or NaN (made once per cached weight)."""
        if self.guarded is None:
            self.guarded = nonfinite_guard(self.scale, self.amax)
        return self.guarded

    def weight(self, backend: Backend, pow2_scales: bool = False) -> torch.Tensor:
        """Operand for fprop, [N, K]."""
        if backend.name != "emulated":
            return self.data
        # The emulated GEMM upcasts its operands; CPU fp8->float casts are slow, so convert the weight once
        # per step, not twice per micro-batch, into the dtype its GEMM runs in (bf16 only with power-of-two
        # scales, see EmulatedBackend.gemm_nt). Both hold every E4M3/E5M2 value exactly.
        if self.values is None:
            self.values = self.data.to(torch.bfloat16 if pow2_scales else torch.float32)
        return self.values

    def weight_t(self, backend: Backend, pow2_scales: bool = False) -> torch.Tensor:
        """Operand for dgrad, W^T as [K, N]: a view, or a row-major copy for backends that need one."""
        if not backend.wants_contiguous_operands:
            return self.weight(backend, pow2_scales).t()
        if self.transposed is None:
            self.transposed = self.data.t().contiguous()
        return self.transposed


class _Fp8LinearFunction(torch.autograd.Function):
    """fprop, dgrad and wgrad of `Fp8Linear` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                module: "Fp8Linear", out_dtype: torch.dtype, column_scale: torch.Tensor | None = None,
                input_amax: torch.Tensor | None = None, column_scale_group: Any = None) -> torch.Tensor:
        backend, specs, x2d = gemm_steps.begin(module, x)
        values_dtype = gemm_steps.fused_values_dtype(module, backend)
        # Autocast would turn the fp32 GEMM of the emulated backend into bf16; every dtype here is explicit.
        with torch.autocast(x.device.type, enabled=False):
            q_x, v_x, s_x, x_amax = module._quantize_input(backend, specs[Fp8Role.INPUT], x2d, input_amax, values_dtype)
            if module.fp8_stats_enabled:
                fp8_stats.record(module, Fp8Role.INPUT, x2d, q_x, s_x, specs[Fp8Role.INPUT])
            if column_scale is None:
                w = module._quantized_weight(backend, specs[Fp8Role.WEIGHT])
            else:
                w = module._quantized_scaled_weight(backend, specs[Fp8Role.WEIGHT], column_scale, column_scale_group)
            module._note_weight_use(w.scale, w.amax, w)
            # Quantized with the real scales (the clamp saturates inf), multiplied out with guarded ones: an
            # inf/NaN operand makes the whole output NaN, as nn.Linear's would be non-finite.
            s_x = nonfinite_guard(s_x, x_amax)
            pow2 = module.recipe.power_of_two_scales
            y = backend.gemm_nt(q_x if v_x is None else v_x, s_x, w.weight(backend, pow2),
                                w.gemm_scale(), out_dtype, pow2, module.fused_quantization,
                                module.recipe.fast_accum_for(Fp8Gemm.FPROP))
            y = gemm_steps.add_bias(y, bias, out_dtype)
        saved_x = q_x if module.recipe.fp8_wgrad else x2d
        ctx.save_for_backward(saved_x, s_x, column_scale)
        ctx.weight_scale, ctx.weight_amax = w.scale, w.amax  # a per-call weight is requantized with them
        return gemm_steps.finish_forward(ctx, y, x, weight, bias, module, backend, specs,
                                         None if module.fp8_weight_per_call else w)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved_x, s_x, column_scale = ctx.saved_tensors
        module, backend, specs, w = ctx.module, ctx.backend, ctx.specs, ctx.weight_fp8
        grad_spec = specs[Fp8Role.GRAD_OUTPUT]
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        values_dtype = gemm_steps.fused_values_dtype(module, backend)
        with torch.autocast(dy.device.type, enabled=False):
            v_g = None
            if values_dtype is not False and not module.recipe.grad_stochastic_rounding:
                q_g, v_g, s_g, g_amax = module._fused_quantize(Fp8Role.GRAD_OUTPUT, dy2d, grad_spec, values_dtype)
            else:  # stochastic rounding draws its noise eagerly (the generator's stream stays the eager one)
                g_amax = amax_of(dy2d)
                s_g = module._scale_for(Fp8Role.GRAD_OUTPUT, g_amax, grad_spec)
                q_g = backend.quantize(dy2d, s_g, grad_spec, module.recipe.grad_stochastic_rounding)
            if module.fp8_stats_enabled:
                fp8_stats.record(module, Fp8Role.GRAD_OUTPUT, dy2d, q_g, s_g, grad_spec)
            # An inf/NaN in dy must reach dx and dW (the clamp would turn inf into +-max and hide the overflow
            # from the loop's non-finite guard); s_x already carries the guard of the forward input.
            s_g = nonfinite_guard(s_g, g_amax)
            pow2, fused_epilogue = module.recipe.power_of_two_scales, module.fused_quantization
            if ctx.needs_input_grad[0]:
                if w is None:  # a per-call FP8 weight (ZeRO-3): made again from the re-gathered weight
                    w = module._requantized_weight(backend, specs[Fp8Role.WEIGHT], ctx.weight_scale, ctx.weight_amax,
                                                   column_scale)
                # dx = dy W  ==  gemm_nt(dy, W^T)
                dx = backend.gemm_nt(q_g if v_g is None else v_g, s_g, w.weight_t(backend, pow2),
                                     w.gemm_scale(), ctx.x_dtype, pow2, fused_epilogue,
                                     module.recipe.fast_accum_for(Fp8Gemm.DGRAD))
                dx = dx.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                if module.recipe.fp8_wgrad:
                    # dW = dy^T x  ==  gemm_nt(dy^T, x^T)
                    if values_dtype is not False and values_dtype is not None:  # emulated: exact fp32 values
                        saved_x = fused.upcast(saved_x, values_dtype)
                    dw = backend.gemm_nt((q_g if v_g is None else v_g).t(), s_g, saved_x.t(), s_x, torch.float32, pow2,
                                         fused_epilogue, module.recipe.fast_accum_for(Fp8Gemm.WGRAD))
                else:
                    dw = gemm_steps.high_precision_wgrad(dy2d, saved_x)
                dw = gemm_steps.finish_weight_grad(ctx, dw, column_scale)
            db = gemm_steps.bias_grad(ctx, dy2d)
        return dx, dw, db, None, None, None, None, None


class Fp8Linear(nn.Linear):
    """`nn.Linear` with FP8 GEMMs. Same parameters and state_dict keys (`weight`, `bias`) as `nn.Linear`.

    Its FP8 scaling state is held in non-persistent buffers (they follow `.to()`, but stay out of the model's
    state_dict); checkpoints save it separately with `megatron.fp8.fp8_state_dict`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Fp8Recipe | None = None, amax_group: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else Fp8Recipe()
        # Process group over which amaxes are max-reduced: every rank holding a piece (TP) or a replica (DP)
        # of the same logical tensor. None = the default group when torch.distributed is initialized.
        self.amax_group = amax_group
        self.fp8_stats_enabled = False
        # Quantize through the compiled functions of fused.py (bitwise the eager reference, fewer passes);
        # `set_fused_quantization` sets it for a model from --torch-compile. Off: the eager reference.
        self.fused_quantization = False
        # Inside a compiled transformer block: traced into its graph (traced.py), or a graph break running the
        # eager path (`set_fp8_tracing`; the fallback when tracing fails, and a benchmark's comparison).
        self.trace_in_compiled_graph = True
        self.fp8_num_updates = 0  # optimizer steps seen by the delayed-scaling update
        self.fp8_weight_quantizations = 0  # how often the weight was cast (once per step when cached)
        # Per-call FP8 weight (set under ZeRO-3, where the weight exists only while gathered): no cache across
        # forwards, and none kept from forward to backward, which requantizes (see "Memory and caching").
        self.fp8_weight_per_call = False
        self._weight_cache: _QuantizedWeight | TiledWeight | None = None
        # This step's FP8 weight for the traced path (its GEMM operand, scale, amax), set outside the compiled graph
        # by `refresh_step_weight` (a compiled block's pre-hook): (W, scale, amax, W^T as a row-major copy for
        # backends that want one, else None); None: the traced path quantizes per call.
        self._step_weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        # W's column maxima (`column_maxima`), made once per optimizer step for a column-scaled (Smooth-SwiGLU)
        # weight: (weight_storage_key, [K] fp32); `_step_column_maxima` is the traced path's copy of them, set
        # outside the graph by `refresh_step_column_maxima`.
        self._column_maxima: tuple[tuple[int, int], torch.Tensor] | None = None
        self._step_column_maxima: torch.Tensor | None = None
        self.fp8_column_maxima_passes = 0  # how often W's column maxima were computed (once per step when cached)
        # Per role: the delayed scale is known to be valid (its buffer `fp8_scale_valid` is True, which stays so
        # once set). Read off the buffer eagerly by `refresh_scale_validity` (a compiled block's pre-hook) until
        # every role is valid, then never again; the traced path then casts with the history's scale without
        # waiting for the tensor's amax (one graph more, once per run, when it turns True).
        self.fp8_scale_known_valid: tuple[bool, bool, bool] = (False, False, False)
        self._validity_read_at: int | None = None  # fp8_num_updates when the buffer was last read
        self._rows: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None  # `_role_rows`
        self._init_fp8_buffers(self.weight.device)

    def _init_fp8_buffers(self, device: torch.device | str | None) -> None:
        for name, tensor in new_scaling_buffers(self.recipe.amax_history_len, device).items():
            self.register_buffer(name, tensor, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe, amax_group: Any = None) -> "Fp8Linear":
        """An Fp8Linear sharing `linear`'s Parameter objects (same device, dtype, requires_grad and any
        attributes set on them; an optimizer already holding them keeps working)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  recipe=recipe, amax_group=amax_group, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_fp8_buffers(linear.weight.device)
        new.train(linear.training)
        return new

    # --- pieces used by the autograd function -------------------------------------------------------------

    def fp8_backend(self, device: torch.device) -> Backend:
        return select_backend(self.recipe.backend, device, self.recipe.scaling)

    def fp8_specs(self, backend: Backend) -> tuple[Fp8FormatSpec, ...]:
        return tuple(backend_format_spec(backend, d) for d in role_dtypes(self.recipe))

    def _scale_for(self, role: Fp8Role, amax: torch.Tensor, spec: Fp8FormatSpec,
                   record: bool | None = None) -> torch.Tensor:
        """The scale to quantize a tensor of this `amax` with now; records the amax into this step's running
        amax when `record` (default: in training mode).

        Only training passes feed the scaling state: an evaluation between two steps must not change the
        scales of the next training step (or a resumed run would differ from an uninterrupted one).
        """
        # No collective here, also not for current scaling: no FP8 tensor is communicated, so a rank's
        # shard may use its own scale (replicated weights get identical scales anyway), and a blocking
        # all-reduce per GEMM would cost more than the GEMM for small layers.
        scale_row, _ = self._role_rows(role)
        delayed = self.recipe.scaling is Fp8Scaling.DELAYED
        if delayed and self.fp8_scale_known_valid[int(role)]:  # the history's scale, no arithmetic (steady state)
            if self.training if record is None else record:
                self.record_amax(role, amax)
            return scale_row
        current = compute_scale(amax, spec.max, self.recipe.margin, self.recipe.power_of_two_scales,
                                previous=scale_row)
        if self.training if record is None else record:
            self.record_amax(role, amax, current)
        if not delayed:
            return current
        # Delayed: the scale from previous steps once the history holds one; the current amax before that.
        return torch.where(self.fp8_scale_valid[role], scale_row, current)

    def _fused_quantize(self, role: Fp8Role, t: torch.Tensor, spec: Fp8FormatSpec,
                        values_dtype: torch.dtype | None, record: bool | None = None, known_valid: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """`_scale_for` + `quantize` as one compiled function (fused.py): (Q(t), Q(t) in `values_dtype` or
        None, scale, amax); records the amax (and the tensorwise scale) as `_scale_for` does. `known_valid`:
        the role's delayed scale is known to be valid (`fp8_scale_known_valid`), so the cast needs no amax."""
        recipe = self.recipe
        q, values, scale, amax = fused.quantize_tensor(
            t.detach(), self.fp8_scale[role], self.fp8_scale_valid[role], recipe.scaling is Fp8Scaling.DELAYED,
            spec.max, recipe.margin, recipe.power_of_two_scales, spec.torch_dtype, values_dtype, known_valid)
        if self.training if record is None else record:
            self.record_amax(role, amax, scale)
        return q, values, scale, amax

    def _quantize_input(self, backend: Backend, spec: Fp8FormatSpec, x2d: torch.Tensor,
                        input_amax: torch.Tensor | None, values_dtype: torch.dtype | None | bool,
                        known_valid: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(Q(x), Q(x) in the emulated GEMM's dtype when the fused kernel wrote it else None, scale, amax);
        records the amax (and the tensorwise scale) in training. With `input_amax` (the exact amax of this very
        x) the scale is x's own: current scaling for free."""
        if values_dtype is not False and input_amax is None:
            return self._fused_quantize(Fp8Role.INPUT, x2d, spec, values_dtype, known_valid=known_valid)
        x_amax = amax_of(x2d) if input_amax is None else input_amax.float()
        s_x = self._scale_for(Fp8Role.INPUT, x_amax, spec)
        if input_amax is not None:
            s_x = self._own_amax_scale(Fp8Role.INPUT, x_amax, spec)
        if values_dtype is not False:  # one compiled pass with the known scale
            q_x, v_x = fused.quantize_known(x2d, s_x, spec.max, spec.torch_dtype, values_dtype)
            return q_x, v_x, s_x, x_amax
        return backend.quantize(x2d, s_x, spec), None, s_x, x_amax

    def _quantized_weight(self, backend: Backend, spec: Fp8FormatSpec) -> _QuantizedWeight:
        w = self.weight
        key = (*self.weight_storage_key(), backend.name)
        if self._weight_cache is None or self._weight_cache.key != key:
            values_dtype = self._weight_values_dtype(backend)
            values = None
            with torch.no_grad():
                if values_dtype is not False:
                    # Recorded by `_note_weight_use` instead: the cast may happen in an evaluation pass.
                    q, values, scale, amax = self._fused_quantize(Fp8Role.WEIGHT, w, spec, values_dtype, record=False)
                else:
                    amax = amax_of(w)
                    scale = self._scale_for(Fp8Role.WEIGHT, amax, spec, record=False)
                    q = backend.quantize(w, scale, spec)
                if self.fp8_stats_enabled:
                    fp8_stats.record(self, Fp8Role.WEIGHT, w, q, scale, spec)
            self.fp8_weight_quantizations += 1
            made = _QuantizedWeight(key, q, scale, amax, values=values)
            if self.fp8_weight_per_call:
                return made
            self._weight_cache = made
        return self._weight_cache

    def _weight_values_dtype(self, backend: Backend) -> torch.dtype | None | bool:
        """`gemm_steps.fused_values_dtype` for the weight: bf16 for the emulated GEMM with power-of-two scales (the
        dtype `_QuantizedWeight.weight` converts to)."""
        values_dtype = gemm_steps.fused_values_dtype(self, backend)
        if values_dtype is not False and values_dtype is not None and self.recipe.power_of_two_scales:
            return torch.bfloat16
        return values_dtype

    def _cast_weight(self, backend: Backend, spec: Fp8FormatSpec, scale: torch.Tensor,
                     values_dtype: torch.dtype | None | bool, column_scale: torch.Tensor | None,
                     scaled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(Q(W diag(c)) or Q(W), its values for the GEMM or None) with a known scale: fused, one pass that never
        materializes W diag(c); eager, from `scaled` (W diag(c) when the caller made it already)."""
        if values_dtype is not False:
            return fused.quantize_known(self.weight, scale, spec.max, spec.torch_dtype, values_dtype,
                                        column_scale=column_scale)
        if scaled is None:
            scaled = self.weight if column_scale is None else column_scaled(self.weight, column_scale)
        return backend.quantize(scaled, scale, spec), None

    def _requantized_weight(self, backend: Backend, spec: Fp8FormatSpec, scale: torch.Tensor, amax: torch.Tensor,
                            column_scale: torch.Tensor | None) -> _QuantizedWeight:
        """The forward's FP8 weight (or W diag(c)) made again with its scale: the same values and scale give the
        same bits (the fused and eager casts are bitwise equal, tests/unit/test_fp8_fused.py). Records nothing."""
        with torch.no_grad():
            q, values = self._cast_weight(backend, spec, scale, self._weight_values_dtype(backend), column_scale)
        return _QuantizedWeight(None, q, scale, amax, values=values)

    def _own_amax_scale(self, role: Fp8Role, amax: torch.Tensor, spec: Fp8FormatSpec) -> torch.Tensor:
        """The just-in-time scale of a tensor whose exact amax is known, under every scaling recipe."""
        return compute_scale(amax, spec.max, self.recipe.margin, self.recipe.power_of_two_scales,
                             previous=self.fp8_scale[role])

    def _quantized_scaled_weight(self, backend: Backend, spec: Fp8FormatSpec, column_scale: torch.Tensor,
                                 group: Any = None) -> _QuantizedWeight:
        """Q(W diag(column_scale)), made for this call only (see "Per-input-channel weight scale")."""
        with torch.no_grad():
            q, values, scale, amax = self._column_scaled_weight(backend, spec, column_scale, group)
            if self.fp8_stats_enabled:
                fp8_stats.record(self, Fp8Role.WEIGHT, column_scaled(self.weight, column_scale), q, scale, spec)
        self.fp8_weight_quantizations += 1
        return _QuantizedWeight(None, q, scale, amax, values=values)

    def _column_scaled_weight(self, backend: Backend, spec: Fp8FormatSpec, column_scale: torch.Tensor, group: Any,
                              maxima: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(Q(W diag(c)), its values for the GEMM or None, scale, amax): the scale from its own amax, max-reduced
        over `group`. Fused, the amax comes from W's column maxima (`maxima`, else this step's `column_maxima`)
        and W diag(c) is never materialized: one cast pass per call. The unfused reference materializes W diag(c)
        and reduces it. Records nothing and counts nothing (callers do)."""
        values_dtype = self._weight_values_dtype(backend)
        w = None
        if values_dtype is not False:
            amax = fused.column_scaled_amax(self.column_maxima() if maxima is None else maxima, column_scale)
        else:
            w = column_scaled(self.weight.detach(), column_scale)
            amax = amax_of(w)
        comm.all_reduce(amax, group, comm.ReduceOp.MAX)  # a no-op without a group
        scale = self._own_amax_scale(Fp8Role.WEIGHT, amax, spec)
        q, values = self._cast_weight(backend, spec, scale, values_dtype, column_scale, scaled=w)
        return q, values, scale, amax

    def column_maxima(self) -> torch.Tensor:
        """max_i |W_ij| per input channel j ([K], fp32), computed once per optimizer step (keyed like the FP8
        weight cache; per call for a per-call weight, ZeRO-3): what the amax of W diag(c) needs, whatever c."""
        key = self.weight_storage_key()
        if self._column_maxima is not None and self._column_maxima[0] == key and not self.fp8_weight_per_call:
            return self._column_maxima[1]
        with torch.no_grad():
            maxima = fused.column_maxima(self.weight.detach())
        self.fp8_column_maxima_passes += 1
        if not self.fp8_weight_per_call:
            self._column_maxima = (key, maxima)
        return maxima

    def refresh_scale_validity(self) -> None:
        """Eagerly, before a compiled block runs: `fp8_scale_known_valid` from the buffer (a device-to-host read,
        at most once per optimizer step while some role's scale is not valid yet: the first steps of a run)."""
        if self.recipe.scaling is not Fp8Scaling.DELAYED or all(self.fp8_scale_known_valid):
            return
        if self._validity_read_at != self.fp8_num_updates:  # it changes only at a scaling update: one read per step
            self.learn_scale_validity(self.fp8_scale_valid.tolist())

    def learn_scale_validity(self, valid: list[bool]) -> None:
        """`fp8_scale_known_valid` from values read off `fp8_scale_valid` after this step's update (by
        `refresh_scale_validity`, or for the whole model at once by `fp8_optimizer_step`)."""
        self.fp8_scale_known_valid = tuple(bool(v) for v in valid)
        self._validity_read_at = self.fp8_num_updates

    def forget_scale_validity(self) -> None:
        """The scaling buffers were written from outside (a checkpoint's FP8 state, a warm-up's restore): read
        their validity again."""
        self.fp8_scale_known_valid = (False, False, False)
        self._validity_read_at = None

    def refresh_step_column_maxima(self) -> None:
        """Eagerly, before a compiled block runs: this step's column maxima for a column-scaled layer the traced
        path takes (None for the others: the graph then reduces W itself)."""
        backend = self.fp8_backend(self.weight.device)
        self._step_column_maxima = self.column_maxima() if traced.uses_step_weight(self, backend) else None

    def record_amax(self, role: Fp8Role, amax: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """A training use of the role's tensor (`scaling.record_step_amax`); `scale` becomes the role's under
        tensorwise scaling only."""
        scale_row, step_amax_row = self._role_rows(role)
        record_step_amax(step_amax_row, amax, scale_row,
                         scale if self.recipe.scaling is Fp8Scaling.TENSORWISE else None)

    def _role_rows(self, role: Fp8Role) -> tuple[torch.Tensor, torch.Tensor]:
        """The role's entries of `fp8_scale` and `fp8_step_amax` as 0-d views, made once per buffer (indexing
        the buffers is a dispatched op each time, and an eager layer indexes them for every tensor it casts)."""
        role = int(role)  # dynamo (torch 2.13) recurses without end indexing a tuple with an IntEnum member
        if torch.compiler.is_compiling():  # traced into a graph: views made there are the graph's, never cached
            return self.fp8_scale[role], self.fp8_step_amax[role]
        rows = self._rows
        if rows is None or rows[0][0]._base is not self.fp8_scale or rows[0][1]._base is not self.fp8_step_amax:
            rows = self._rows = tuple((self.fp8_scale[r], self.fp8_step_amax[r]) for r in range(len(Fp8Role)))
        return rows[role]

    def _note_weight_use(self, scale: torch.Tensor, amax: torch.Tensor, made: Any = None) -> None:
        """Every training forward records the weight's amax, wherever the FP8 weight was made; a weight cached for
        the step (`made`) records it once (the running max would not change)."""
        if not self.training or (made is not None and made.recorded):
            return
        self.record_amax(Fp8Role.WEIGHT, amax, scale)
        if made is not None:
            made.recorded = True

    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the FP8 weight (and W's column maxima); the next forward re-quantizes (called by
        `fp8_optimizer_step`)."""
        self._weight_cache = None
        self._step_weight = None
        self._column_maxima = self._step_column_maxima = None

    def weight_storage_key(self) -> tuple[int, int]:
        """What identifies the weight's current values for the per-step FP8 caches: its version counter (bumped
        by every in-place update) and its storage (replaced by `.to()` or a `.data` assignment)."""
        return self.weight._version, self.weight.data_ptr()

    def refresh_step_weight(self) -> None:
        """Eagerly, before a compiled block runs (its pre-hook, outside the graph): this step's FP8 weight from the
        per-step cache (quantized once per optimizer step, as the eager layer does), for the traced path to read
        instead of quantizing per call. Only for layers the traced path takes (traced.py); None for the others."""
        cache = self._weight_cache
        if self._step_weight is not None and cache is not None and cache.key[:2] == self.weight_storage_key():
            return  # made this step (the key's backend follows the device, which `_apply` would have reset)
        backend = self.fp8_backend(self.weight.device)
        if not traced.uses_step_weight(self, backend):
            self._step_weight = None
            return
        with torch.autocast(self.weight.device.type, enabled=False):
            made = self._quantized_weight(backend, self.fp8_specs(backend)[Fp8Role.WEIGHT])
            pow2 = self.recipe.power_of_two_scales
            # dgrad's operand too, once per step: inside the graph it would be transposed per micro-batch.
            transposed = made.weight_t(backend, pow2) if backend.wants_contiguous_operands else None
            self._step_weight = (made.weight(backend, pow2), made.scale, made.amax, transposed)

    # --- nn.Module -------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weight_column_scale: torch.Tensor | None = None,
                input_amax: torch.Tensor | None = None, column_scale_group: Any = None) -> torch.Tensor:
        """y = Q(x) Q(W)^T + b; with `weight_column_scale` c, W diag(c) replaces W (see the module docstring);
        `column_scale_group` is the group over which the amax of W diag(c) is max-reduced (TP shards).

        Inside a compiled transformer block (`--torch-compile`) the per-tensor recipes are traced into the
        block's graph (traced.py); everything else runs `_eager_forward`, a graph break there."""
        if torch.compiler.is_compiling() and traced.traceable(self, x, column_scale_group):
            column_scale = None if weight_column_scale is None else weight_column_scale.detach()
            return traced.forward(self, x, _output_dtype(x), column_scale, input_amax)
        return self._eager_forward(x, weight_column_scale, input_amax, column_scale_group)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, weight_column_scale: torch.Tensor | None,
                       input_amax: torch.Tensor | None, column_scale_group: Any) -> torch.Tensor:
        out_dtype = _output_dtype(x)
        if weight_column_scale is not None:
            weight_column_scale = weight_column_scale.detach()
        if self.recipe.tiles is not None:  # rowwise, blockwise, mxfp8: see tiled.py
            return TiledFp8LinearFunction.apply(x, self.weight, self.bias, self, out_dtype, weight_column_scale)
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self, out_dtype, weight_column_scale,
                                        input_amax, column_scale_group)

    def _apply(self, fn: Any, recurse: bool = True) -> "Fp8Linear":
        # .to()/.cuda() may replace the weight's storage; a cached FP8 copy on the old device must go.
        self._weight_cache = None
        self._step_weight = None
        self._column_maxima = self._step_column_maxima = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        r = self.recipe
        fmt = "E4M3 fwd / E5M2 bwd" if r.format.value == "hybrid" else "E4M3"
        if r.scaling is Fp8Scaling.DELAYED:
            scaling = f"delayed(history={r.amax_history_len}, algo={r.amax_compute_algo.value}, margin={r.margin})"
        elif r.tiles is not None:
            act, weight = r.tiles
            size = lambda t: f"{t.rows or 'all'}x{t.cols or 'all'}"  # noqa: E731
            scaling = f"{r.scaling.value}(activations {size(act)}, weights {size(weight)}, margin={r.margin})"
        else:
            scaling = f"tensorwise(margin={r.margin})"
        extras = [f"fp8={r.format.value} ({fmt})", f"scaling={scaling}"]
        if not r.fp8_wgrad:
            extras.append("wgrad=high-precision")
        return f"{super().extra_repr()}, " + ", ".join(extras)

