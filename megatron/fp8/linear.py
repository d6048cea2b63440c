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
is noticed (an update through `.data` is not: call the hook). Under ZeRO-3 (`fp8.weight_per_call`, set by the
DeepSpeed engine) the weight exists only while gathered, and an FP8 copy kept per layer would hold the whole model
again on every rank: the layer then quantizes per forward, keeps no copy, and its backward requantizes the
re-gathered weight with the forward's scale (bitwise the same FP8 weight).

Per-input-channel weight scale (Smooth-SwiGLU, channel form)
-----------------------------------------------------------
`forward(x, weight_column_scale=c)` computes y = Q(x) Q(W diag(c))^T: the columns of W (its input channels)
are multiplied by c *before* quantization, so one FP8 GEMM still does the whole product. W diag(c) is a new
tensor whenever c changes (every micro-batch under Smooth-SwiGLU), so such a call bypasses the per-step
weight cache and quantizes afresh (counted in `fp8.weight_quantizations`), always with a scale from its own
amax (a history of other tensors' amaxes would lag and clip it); its amax still feeds the weight role's
statistics and history. That amax needs no pass over W: it is max_j(colmax_j |c_j|), bitwise, from W's column
maxima, which change once per optimizer step and are computed once per step (`column_maxima`, counted in
`fp8.column_maxima_passes`; the eager reference without fused quantization reduces W diag(c) itself).
Under tensor parallelism W is a shard of the logical weight: `column_scale_group` (the TP group) max-reduces
that amax so every shard uses the scale the whole W diag(c) would get (one scalar all-reduce per call).
Gradients: dx from Q(W diag(c)), dW = (dy^T x) diag(c), none through c.
`input_amax`, when the caller already knows max|x| exactly (Smooth-SwiGLU gets it from its channel maxima),
saves the reduction over x and, being this tensor's own amax, sets x's scale just in time under delayed
scaling too (its amax still feeds the input role's history): current scaling for free. Smooth-SwiGLU needs
it because its split leaves part of an outlier in x, which a scale from earlier steps would clip.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from megatron.fp8 import per_tensor, traced
from megatron.fp8.backends import Backend
from megatron.fp8.formats import Fp8FormatSpec
from megatron.fp8.layer_state import Fp8LayerState, weight_storage_key
from megatron.fp8.recipe import Fp8Recipe, Fp8Scaling
from megatron.fp8.scaling import new_scaling_buffers
from megatron.fp8.tiled import TiledFp8LinearFunction


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMMs' output dtype: the autocast dtype under autocast, else the input's."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


class Fp8Linear(nn.Linear):
    """`nn.Linear` with FP8 GEMMs. Same parameters and state_dict keys (`weight`, `bias`) as `nn.Linear`.

    Its FP8 state is `self.fp8` (`layer_state.Fp8LayerState`); the scaling buffers are the module's
    non-persistent buffers (they follow `.to()`, but stay out of the model's state_dict), which the state reads.
    Checkpoints save them separately with `megatron.fp8.fp8_state_dict`. The module chooses the path of a call
    (traced into a compiled block, per-tensor or tiled autograd function) and hands it the state and tensors.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Fp8Recipe | None = None, amax_group: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8 = Fp8LayerState(recipe if recipe is not None else Fp8Recipe(), amax_group)
        self._init_fp8_buffers(self.weight.device)

    def _init_fp8_buffers(self, device: torch.device | str | None) -> None:
        for name, tensor in new_scaling_buffers(self.fp8.recipe.amax_history_len, device).items():
            self.register_buffer(name, tensor, persistent=False)
        self.fp8.bind(self._buffers)

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

    # --- what code outside the layer calls (the engines, the compiled blocks' pre-hook, checkpoints) ------------

    def column_maxima(self) -> torch.Tensor:
        """W's column maxima, made once per optimizer step (`Fp8LayerState.column_maxima`)."""
        return self.fp8.column_maxima(self.weight)

    def refresh_step_weight(self) -> None:
        """Before a compiled block runs: this step's FP8 weight for the traced path (`Fp8LayerState`)."""
        self.fp8.refresh_step_weight(self.weight)

    def refresh_step_column_maxima(self) -> None:
        """Before a compiled block runs: this step's column maxima for the traced path (`Fp8LayerState`)."""
        self.fp8.refresh_step_column_maxima(self.weight)

    def weight_storage_key(self) -> tuple[int, int]:
        return weight_storage_key(self.weight)

    # --- nn.Module -------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weight_column_scale: torch.Tensor | None = None,
                input_amax: torch.Tensor | None = None, column_scale_group: Any = None) -> torch.Tensor:
        """y = Q(x) Q(W)^T + b; with `weight_column_scale` c, W diag(c) replaces W (see the module docstring);
        `column_scale_group` is the group over which the amax of W diag(c) is max-reduced (TP shards).

        Inside a compiled transformer block (`--torch-compile`) the per-tensor recipes are traced into the
        block's graph (traced.py); everything else runs `_eager_forward`, a graph break there. A layer the FP8
        controller put in high precision (`Fp8LayerState.high_precision`) runs nn.Linear's GEMM instead."""
        if self.fp8.high_precision:
            weight = self.weight
            if weight_column_scale is not None:  # the fold Smooth-SwiGLU applies to a high-precision fc2
                weight = weight * weight_column_scale.detach().to(weight.dtype)
            return nn.functional.linear(x, weight, self.bias)
        if torch.compiler.is_compiling() and traced.traceable(self.fp8, x, column_scale_group):
            column_scale = None if weight_column_scale is None else weight_column_scale.detach()
            return traced.forward(self.fp8, x, self.weight, self.bias, _output_dtype(x), self.training, column_scale,
                                  input_amax)
        return self._eager_forward(x, weight_column_scale, input_amax, column_scale_group)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, weight_column_scale: torch.Tensor | None,
                       input_amax: torch.Tensor | None, column_scale_group: Any) -> torch.Tensor:
        out_dtype = _output_dtype(x)
        if weight_column_scale is not None:
            weight_column_scale = weight_column_scale.detach()
        if self.fp8.recipe.tiles is not None:  # rowwise, blockwise, mxfp8: see tiled.py
            return TiledFp8LinearFunction.apply(x, self.weight, self.bias, self.fp8, out_dtype, self.training,
                                                weight_column_scale)
        return per_tensor.forward(self.fp8, x, self.weight, self.bias, out_dtype, self.training, weight_column_scale,
                                  input_amax, column_scale_group)

    def _apply(self, fn: Any, recurse: bool = True) -> "Fp8Linear":
        # .to()/.cuda() may replace the weight's storage; a cached FP8 copy on the old device must go.
        self.fp8.forget_weights()
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        r = self.fp8.recipe
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

