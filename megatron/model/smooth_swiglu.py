"""Smooth-SwiGLU: rescale the SwiGLU product before the FP8 quantization of fc2's input, undo it after fc2.

Why
---
In FP8 the input of `linear_fc2` (the SwiGLU product h = Swish(x W2) * (x W1)) is quantized with ONE scale
per tensor. When a channel's w1 and w2 rows align (the paper's weight-alignment mechanism), that channel
becomes quadratic in the input and occasionally produces values far above every other channel: one scale
then either clips the outlier (delayed scaling calibrated on earlier steps) or flushes the resolution of
all other channels. Smooth-SwiGLU normalises h before the cast and restores the scale after the GEMM.

The two forms (`ModelConfig.smooth_swiglu`)
-------------------------------------------
- CHANNEL (the paper): s_i = 1 / max_tokens |h_i| per FFN channel i over the micro-batch; fc2 computes
  `y = Q(h * s) @ Q(W3 * s^-1)^T`. The inverse scale is folded into fc2's weight columns (its input
  channels) *before* the weight is quantized, so fc2 stays one FP8 GEMM. Consequence: fc2's FP8 weight is a
  new tensor at every micro-batch, so `Fp8Linear`'s once-per-step weight cache is bypassed for it (the
  quantization count shows it, `bench/bench_smooth_swiglu.py` measures it). Under tensor parallelism each
  rank owns whole channels, so the scales need no communication; only the amax of the folded weight shard
  is max-reduced over the TP group (one scalar), so the shards share the FP8 scale of the whole weight.
- TOKEN (the public reference code): s_t = max_channels |x W1| (the linear branch `up`) per token;
  `h = Swish(x W2) * (up / s_t)`, `y = (h W3) * s_t`. Under tensor parallelism the channels of a token are
  spread over ranks, so s_t must be max-reduced over the TP group (`token_maxima(up, group)`); the
  reference code skipped that and was only correct at TP=1.

Numerics
--------
- Scales are detached (no gradient through them) and computed per micro-batch with ONE max reduction.
  For CHANNEL that reduction also yields the amax of the FP8 cast of h * s (max_i of cmax_i * s_i, an
  [F]-sized op), which is handed to `Fp8Linear` so it does not reduce h*s again. For TOKEN the scale is a
  max over `up` while the cast needs the max of `Swish(gate) * up / s_t`, a different tensor, so the cast
  keeps its own amax.
- Scales are powers of two (s = 2^-e with max = m * 2^e, m in [0.5, 1)): multiplying by them is exact in
  fp32 and bf16, so the re-parametrisation adds no rounding of its own (the FP32 output of a smooth MLP
  equals plain SwiGLU's bitwise in practice) and folding for export is exact. The normalised channel max
  lands in [0.5, 1) instead of exactly 1: one binade, irrelevant to FP8's relative precision.
- A zero, non-finite or denormal max never divides by zero: the scale is 1 for 0/inf/NaN (a NaN then
  reaches the loss as in plain SwiGLU, where the loop skips the step) and the exponent is clamped so
  neither the scale nor its inverse overflows.

Export
------
Per-micro-batch scales are an exact re-parametrisation, so a smooth model's weights ARE plain SwiGLU
weights: they export unchanged. `calibrate_smooth_swiglu_scales` + `fold_smooth_swiglu_scales` optionally
fold fixed per-channel scales into `up` rows (x s_i) and fc2 columns (/ s_i) for FP8 *inference*, where
the fc2 input is then already normalised with no extra op.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig, SmoothSwiGLUGranularity

# Exponent clamp: 2**125 and its inverse are both finite, normal fp32 (and bf16) numbers.
_MAX_EXPONENT = 125


def pow2_scales(maxima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) in fp32 with `maxima * scale` in [0.5, 1); both exact powers of two.

    Unusable maxima (0, inf, NaN) give scale = inverse = 1.
    """
    maxima = maxima.float()
    usable = torch.isfinite(maxima) & (maxima > 0)
    _, exponent = torch.frexp(torch.where(usable, maxima, torch.ones_like(maxima)))
    exponent = torch.where(usable, exponent, torch.zeros_like(exponent)).clamp(-_MAX_EXPONENT, _MAX_EXPONENT)
    one = torch.ones_like(maxima)
    return torch.ldexp(one, -exponent), torch.ldexp(one, exponent)


def channel_maxima(h: torch.Tensor) -> torch.Tensor:
    """max over all tokens (every dim but the last) of |h|, per channel: fp32 [F], detached."""
    return h.detach().abs().reshape(-1, h.shape[-1]).amax(dim=0).float()


def token_maxima(up: torch.Tensor, group: Any = None) -> torch.Tensor:
    """max over channels of |up| per token: fp32 [..., 1], detached; max-reduced over `group` if given.

    `group` is the tensor-parallel group when the FFN channels are split across ranks: every rank then
    holds a slice of each token's channels and must use the max over all of them, or ranks disagree on
    the scale of the same token.
    """
    maxima = up.detach().abs().amax(dim=-1, keepdim=True).float()
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # NaN is not ordered under MAX on every backend; send it as inf (then the scale is 1 everywhere).
        maxima = torch.nan_to_num(maxima, nan=float("inf"))
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    return maxima


def _fc2_channel_scaled(linear_fc2: nn.Linear, h_scaled: torch.Tensor, inverse: torch.Tensor,
                        input_amax: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """fc2 with its weight columns multiplied by `inverse` (folded before any weight quantization)."""
    from megatron.fp8.linear import Fp8Linear  # the model package must not need the FP8 engine to import

    if isinstance(linear_fc2, Fp8Linear):
        return linear_fc2(h_scaled, weight_column_scale=inverse, input_amax=input_amax, column_scale_group=tp_group)
    weight = linear_fc2.weight * inverse.to(linear_fc2.weight.dtype)
    return F.linear(h_scaled, weight, linear_fc2.bias)


class SmoothSwiGLU(nn.Module):
    """SwiGLU product + fc2 with Smooth-SwiGLU scaling; owned by `MLP` as `mlp.smooth_swiglu`.

    No parameters or buffers (the scales live for one micro-batch), so state dicts are those of plain
    SwiGLU. `enabled=False` makes the MLP run plain SwiGLU: the training hooks set it on layers whose fc2
    stays in high precision (`--fp8-mlp-fc2-bf16`, `--fp8-first-last-layers-bf16`), where there is no FP8
    cast to protect. `tp_group` is the tensor-parallel group (None at TP=1): the TOKEN form's max and the
    CHANNEL form's folded-weight amax are reduced over it.
    """

    def __init__(self, granularity: SmoothSwiGLUGranularity, has_bias: bool = False) -> None:
        super().__init__()
        self.granularity = SmoothSwiGLUGranularity(granularity)
        if self.granularity is SmoothSwiGLUGranularity.TOKEN and has_bias:
            raise ValueError("--smooth-swiglu-granularity token rescales fc2's output rows, which would also "
                             "scale fc2's bias: use --disable-bias-linear or --smooth-swiglu-granularity channel")
        self.enabled = True
        self.tp_group: Any = None

    def forward(self, fc1_out: torch.Tensor, linear_fc2: nn.Linear) -> torch.Tensor:
        gate, up = fc1_out.chunk(2, dim=-1)
        if self.granularity is SmoothSwiGLUGranularity.CHANNEL:
            h = F.silu(gate) * up
            cmax = channel_maxima(h)
            scale, inverse = pow2_scales(cmax)
            # The one reduction also gives the FP8 cast's amax: max_i cmax_i * s_i (exact, po2 scales).
            input_amax = (cmax * scale).amax()
            return _fc2_channel_scaled(linear_fc2, h * scale.to(h.dtype), inverse, input_amax, self.tp_group)
        scale, inverse = pow2_scales(token_maxima(up, self.tp_group))
        h = F.silu(gate) * (up * scale.to(up.dtype))
        y = linear_fc2(h)
        return y * inverse.to(y.dtype)

    def extra_repr(self) -> str:
        return f"granularity={self.granularity.value}, enabled={self.enabled}"


# ------------------------------------------------------------------------------------------------ export
def _mlp_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp for layer in model.decoder.layers]


@torch.no_grad()
def calibrate_smooth_swiglu_scales(model: nn.Module, batches: Iterable[torch.Tensor] | torch.Tensor
                                   ) -> dict[int, torch.Tensor]:
    """Per layer, the power-of-two per-channel scales s_i = 1 / running max over `batches` of |h_i|.

    `batches` is one token tensor [b, s] or an iterable of them. The model runs in eval mode (restored
    afterwards); forward hooks on each `mlp.linear_fc1` record the running max of the unscaled SwiGLU
    product per channel, whatever the MLP's own smoothing does.
    """
    if isinstance(batches, torch.Tensor):
        batches = [batches]
    mlps = _mlp_layers(model)
    running = [None] * len(mlps)

    def make_hook(index: int):
        def hook(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
            gate, up = out.chunk(2, dim=-1)
            cmax = channel_maxima(F.silu(gate) * up)
            running[index] = cmax if running[index] is None else torch.maximum(running[index], cmax)
        return hook

    handles = [mlp.linear_fc1.register_forward_hook(make_hook(i)) for i, mlp in enumerate(mlps)]
    was_training = model.training
    model.eval()
    try:
        for tokens in batches:
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if any(r is None for r in running):
        raise ValueError("calibrate_smooth_swiglu_scales: no batch was given")
    return {i: pow2_scales(cmax)[0] for i, cmax in enumerate(running)}


def fold_smooth_swiglu_scales(state_dict: dict[str, torch.Tensor], config: ModelConfig,
                              scales: Optional[dict[int, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """A new state dict with per-channel scales folded in: `up` rows * s_i, fc2 columns / s_i.

    The result is a plain SwiGLU model whose fc2 input is already normalised (max ~1 per channel on the
    calibration data) with no extra op. `scales` maps layer index -> [ffn_hidden_size] scales (from
    `calibrate_smooth_swiglu_scales`); None returns the state dict unchanged, which is the correct export of
    a `--smooth-swiglu` model: its weights are plain SwiGLU weights (the training-time scales are an exact
    per-micro-batch re-parametrisation, not parameters). Power-of-two scales make the fold exact.
    """
    if not config.swiglu:
        raise ValueError("fold_smooth_swiglu_scales needs a SwiGLU model (--swiglu)")
    out = dict(state_dict)
    if not scales:
        return out
    ffn = config.ffn_hidden_size
    for index, s in scales.items():
        if s.shape != (ffn,):
            raise ValueError(f"layer {index}: scales of shape {tuple(s.shape)}, expected ({ffn},)")
        fc1_key = f"decoder.layers.{index}.mlp.linear_fc1.weight"
        fc2_key = f"decoder.layers.{index}.mlp.linear_fc2.weight"
        fc1, fc2 = state_dict[fc1_key], state_dict[fc2_key]
        s = s.to(torch.float32)
        row_scale = torch.cat([torch.ones(ffn), s]).to(fc1.device)  # [gate | up]: only up rows scale
        out[fc1_key] = (fc1.float() * row_scale[:, None]).to(fc1.dtype)
        fc1_bias = f"decoder.layers.{index}.mlp.linear_fc1.bias"
        if fc1_bias in state_dict:
            out[fc1_bias] = (state_dict[fc1_bias].float() * row_scale).to(state_dict[fc1_bias].dtype)
        out[fc2_key] = (fc2.float() / s.to(fc2.device)[None, :]).to(fc2.dtype)
    return out
