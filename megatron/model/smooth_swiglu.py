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
- CHANNEL (the paper's per-channel scales): m_i = max_tokens |h_i| per FFN channel i over the micro-batch;
  fc2 computes `y = Q(h * a) @ Q(W3 * a^-1)^T` with a_i ~ m_i^-1/2 (`ChannelSplit`, `channel_split_scales`).
  The paper folds the whole m_i into W3's columns (a_i = 1/m_i) before W3 is quantized per tensor; that only
  moves the outlier from the input into the weight: at a 1e5x outlier the other weight columns fall out
  of E4M3's range and the other channels' output and fc1's weight gradient drop to ~1 dB SQNR. Splitting
  the range (SmoothQuant's alpha = 1/2) leaves each operand the square root of the ratio, which E4M3
  holds (measured per part in docs/smooth_swiglu.md, 1e3..1e7). The part left in the input is no longer
  bounded by construction, so fc2's input is scaled from its exact amax, which the channel maxima give for
  free (`Fp8Linear(input_amax=)`): current scaling without a second reduction, under delayed scaling too.
  fc2 stays one tensorwise FP8 GEMM. Its FP8 weight is a new tensor at every micro-batch, so `Fp8Linear`'s
  once-per-step weight cache is bypassed for it (the quantization count shows it,
  `bench/bench_smooth_swiglu.py` measures it). Under tensor parallelism each rank owns whole channels; the
  split's two scalars (the max of h * 2^-shift, and the clamp's top exponent if used) and the amax of the
  folded weight shard are max-reduced over the TP group, so every shard uses the scales of the whole layer.
- TOKEN (the public reference code): s_t = max_channels |x W1| (the linear branch `up`) per token;
  `h = Swish(x W2) * (up / s_t)`, `y = (h W3) * s_t`. Under tensor parallelism the channels of a token are
  spread over ranks, so s_t must be max-reduced over the TP group (`token_maxima(up, group)`); the
  reference code skipped that and was only correct at TP=1. It does not remove a quadratic outlier: for an
  aligned channel Swish(g) * g / max|g| is still linear in g, so a sudden outlier under delayed scaling is
  clipped as in plain FP8 (measured: ~2 dB at 1000x, channel form ~32 dB). Prefer CHANNEL.

Numerics
--------
- Scales are detached (no gradient through them) and computed per micro-batch with ONE max reduction.
  For CHANNEL that reduction also yields the exact amax of the FP8 cast of h * a (max_i of m_i * a_i, an
  [F]-sized op), which is handed to `Fp8Linear` as the input's amax and scale. For TOKEN the scale is a
  max over `up` while the cast needs the max of `Swish(gate) * up / s_t`, a different tensor, so the cast
  keeps its own amax.
- Scales are powers of two (s = 2^-e with max = m * 2^e, m in [0.5, 1)): multiplying by them is exact in
  fp32 and bf16, so the re-parametrisation adds no rounding of its own (the FP32 output of a smooth MLP
  equals plain SwiGLU's bitwise in practice) and folding for export is exact. The largest scaled channel
  max lands in [0.5, 1) instead of exactly 1: one binade, irrelevant to FP8's relative precision.
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

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron import comm
from megatron.config import ModelConfig, SmoothSwiGLUGranularity
from megatron.dtypes import exp2_int, frexp_fp32, ldexp_fp32

# Exponent clamp: 2**125 and its inverse are both finite, normal fp32 (and bf16) numbers.
_MAX_EXPONENT = 125


def pow2_scales(maxima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) in fp32 with `maxima * scale` in [0.5, 1); both exact powers of two.

    Unusable maxima (0, inf, NaN) give scale = inverse = 1.
    """
    maxima = maxima.float()
    usable = torch.isfinite(maxima) & (maxima > 0)
    _, exponent = frexp_fp32(torch.where(usable, maxima, torch.ones_like(maxima)))
    exponent = torch.where(usable, exponent, torch.zeros_like(exponent)).clamp(-_MAX_EXPONENT, _MAX_EXPONENT)
    return exp2_int(-exponent), exp2_int(exponent)


def swiglu_product(fc1_out: torch.Tensor) -> torch.Tensor:
    """h = Swish(gate) * up of `linear_fc1`'s output, laid out [gate | up] on the last dim."""
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


def channel_maxima(h: torch.Tensor) -> torch.Tensor:
    """max over all tokens (every dim but the last) of |h|, per channel: fp32 [F], detached.

    The one implementation of the SwiGLU channel max: the channel form's scales, the export calibration and
    the outlier diagnostics (`swiglu_diagnostics.ActivationRecorder`) all call it.
    """
    if torch.compiler.is_compiling():
        return _traced_channel_maxima(h.detach())
    return h.detach().abs().reshape(-1, h.shape[-1]).amax(dim=0).float()


def _traced_channel_maxima(h: torch.Tensor) -> torch.Tensor:
    """`channel_maxima` as a compiled block computes it, the same numbers (|.| and max round nothing): |h| in fp32
    (of a bf16 h, inductor would round |h| to bf16 and back per element: `emulate_precision_casts`), and the maximum
    over 16 blocks of rows first. Inductor's C++ code walks a column reduction column block by column block, each down
    all the rows; over a block of rows that walk stays in the cache (Smooth-SwiGLU's forward kernel in the demo model:
    12.8-13.6 ms per step against 14.2-15.5 ms; Intel Xeon with AMX, torch 2.13.0+cpu, 2026-12-07)."""
    h2d = h.float().abs().reshape(-1, h.shape[-1])
    rows = h2d.shape[0]
    if rows % 16:
        return h2d.amax(dim=0)
    return h2d.view(16, rows // 16, h2d.shape[-1]).amax(dim=1).amax(dim=0)


def swiglu_channel_maxima(fc1_out: torch.Tensor) -> torch.Tensor:
    """`channel_maxima` of the SwiGLU product of `linear_fc1`'s output (hooks and calibration use this)."""
    with torch.no_grad():
        return channel_maxima(swiglu_product(fc1_out.detach()))


def _max_over_group(values: torch.Tensor, group: Any) -> torch.Tensor:
    """`values` max-reduced over `group` (a no-op without one); `megatron.comm` sends NaN as inf, since NaN is
    not ordered under MAX on every backend (a non-finite max keeps the previous FP8 scale either way)."""
    return comm.all_reduce(values, group, comm.ReduceOp.MAX)


def token_maxima(up: torch.Tensor, group: Any = None) -> torch.Tensor:
    """max over channels of |up| per token: fp32 [..., 1], detached; max-reduced over `group` if given.

    `group` is the tensor-parallel group when the FFN channels are split across ranks: every rank then
    holds a slice of each token's channels and must use the max over all of them, or ranks disagree on
    the scale of the same token.
    """
    return _max_over_group(up.detach().abs().amax(dim=-1, keepdim=True).float(), group)


@dataclass(frozen=True)
class ChannelSplit:
    """How the channel form shares each channel's dynamic range between fc2's input and fc2's weight.

    Channel i's max m_i = 2^e_i (to a power of two) is divided out of the input column h_i and multiplied
    into the weight column w3_i. `weight_share` alpha moves m_i^alpha into the weight and leaves
    m_i^(1 - alpha) in the input (SmoothQuant's split): alpha = 1 is the paper's full fold, which makes the
    input perfectly flat but puts the whole outlier ratio into ONE per-tensor weight scale, so at a 1e5x
    outlier every other weight column falls below E4M3's range (measured: ~0.6 dB on the non-outlier
    channels). alpha = 0.5 gives each operand the square root of the ratio (316x at 1e5x), which E4M3's
    ~18 binades hold with the ordinary channels still in the normal range. `max_weight_binades` C, if set,
    additionally caps the weight's column spread at 2^C (the rest stays in the input): a fold clamped to
    what E4M3 can carry. The default is the measured choice (docs/smooth_swiglu.md).
    """

    weight_share: float = 0.5
    max_weight_binades: Optional[int] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight_share <= 1.0:
            raise ValueError(f"ChannelSplit.weight_share must be in [0, 1], got {self.weight_share}")
        if self.max_weight_binades is not None and self.max_weight_binades < 0:
            raise ValueError(f"ChannelSplit.max_weight_binades must be >= 0, got {self.max_weight_binades}")


def channel_split_scales(maxima: torch.Tensor, split: ChannelSplit = ChannelSplit(), group: Any = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input scale a, weight column scale 1/a, input amax max_i maxima_i * a_i) for per-channel `maxima`.

    All powers of two (exact multiplies, so the re-parametrisation rounds nothing). One global power of two
    puts the scaled input's largest channel max in [0.5, 1): the returned amax is exactly that of h * a,
    which is fc2's FP8 input scale for free (current scaling without a second reduction over h * a).
    `group` (the TP group, each rank owning whole channels) max-reduces the scalars the split depends on,
    so every rank uses the scales and amax that one rank holding all channels would.
    With `ChannelSplit(1.0)` the scales equal `pow2_scales(maxima)`.
    """
    maxima = maxima.float()
    usable = torch.isfinite(maxima) & (maxima > 0)
    _, exponent = frexp_fp32(torch.where(usable, maxima, torch.ones_like(maxima)))
    exponent = torch.where(usable, exponent, torch.zeros_like(exponent))
    # Exponent moved into the weight, per channel (unusable channels: 0).
    shift = torch.floor(exponent.float() * split.weight_share)
    if split.max_weight_binades is not None:
        # No host read (`usable.any()`, `shift[usable]`): it would stall the device, and a rank-local condition
        # around a collective hangs the ranks that skip it. Without usable channels top_shift is -inf: no-op.
        top_shift = _max_over_group(torch.where(usable, shift, torch.full_like(shift, float("-inf"))).amax(), group)
        shift = torch.where(usable, torch.maximum(shift, top_shift - split.max_weight_binades), shift)
    shift = shift.to(torch.int32)
    top = _max_over_group(ldexp_fp32(maxima, -shift).amax(), group)  # max of h * 2^-shift: NaN/inf propagate
    top_usable = torch.isfinite(top) & (top > 0)
    _, top_exponent = frexp_fp32(torch.where(top_usable, top, torch.ones_like(top)))
    top_exponent = torch.where(top_usable, top_exponent, torch.zeros_like(top_exponent))
    shift = (shift + top_exponent).clamp(-_MAX_EXPONENT, _MAX_EXPONENT)
    return exp2_int(-shift), exp2_int(shift), ldexp_fp32(top, -top_exponent)


def _channel_scales(h2d: torch.Tensor, split: ChannelSplit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`channel_split_scales(channel_maxima(h2d), split)` without a tensor-parallel group (h2d: [tokens, F]): the
    graph `warm_up_channel_scales` compiles."""
    return channel_split_scales(channel_maxima(h2d), split)


# (device type, dtype) -> `_channel_scales` compiled for every shape at start-up (`warm_up_channel_scales`).
_START_UP_GRAPHS: dict[tuple[str, torch.dtype], Callable[..., Any]] = {}


def warm_up_channel_scales(device: torch.device, dtype: torch.dtype, split: ChannelSplit = ChannelSplit()) -> None:
    """Compile the channel form's maxima and scales for every shape of `dtype` activations on `device`, for blocks
    that run eagerly: one compiled pass instead of about 40 eager ops on [F]-sized vectors and an eager column
    reduction (a [2048, 352] bf16 h: 550 us eager, 66 us compiled, the same bits; AMD EPYC, torch 2.13.0+cpu,
    2026-12-07). Only without tensor parallelism (the split's scalars are max-reduced over the TP group)."""
    from megatron.fp8 import fused

    graph = fused.CompiledOrEager(_channel_scales, "Smooth-SwiGLU's channel scales", dynamic=True)
    fused.start_up_graph(graph, torch.zeros(16, 32, dtype=dtype, device=device), split)
    _START_UP_GRAPHS[(device.type, dtype)] = lambda h2d, chosen: fused.call_as_compiled(graph, h2d, chosen)


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
    CHANNEL form's split scalars and folded-weight amax are reduced over it. `split` is the CHANNEL form's
    `ChannelSplit` (the measured default; other values are for experiments).
    """

    def __init__(self, granularity: SmoothSwiGLUGranularity, has_bias: bool = False,
                 split: ChannelSplit = ChannelSplit()) -> None:
        super().__init__()
        self.granularity = SmoothSwiGLUGranularity(granularity)
        if self.granularity is SmoothSwiGLUGranularity.TOKEN and has_bias:
            raise ValueError("--smooth-swiglu-granularity token rescales fc2's output rows, which would also "
                             "scale fc2's bias: use --disable-bias-linear or --smooth-swiglu-granularity channel")
        self.enabled = True
        self.split = split
        self.tp_group: Any = None

    def forward(self, fc1_out: torch.Tensor, linear_fc2: nn.Linear) -> torch.Tensor:
        if self.granularity is SmoothSwiGLUGranularity.CHANNEL:
            h = swiglu_product(fc1_out)
            # One reduction (the channel maxima) gives the scales and the exact amax of h * scale.
            scale, inverse, input_amax = self._channel_scales(h)
            return _fc2_channel_scaled(linear_fc2, h * scale.to(h.dtype), inverse, input_amax, self.tp_group)
        gate, up = fc1_out.chunk(2, dim=-1)
        scale, inverse = pow2_scales(token_maxima(up, self.tp_group))
        h = F.silu(gate) * (up * scale.to(up.dtype))
        y = linear_fc2(h)
        return y * inverse.to(y.dtype)

    def _channel_scales(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The channel form's (scale, inverse, input amax) of h: the start-up's graph where one was made for an eager
        block without tensor parallelism, else the functions themselves (traced into a compiled block as they are)."""
        graph = None
        if self.tp_group is None and h.numel() > 0 and not torch.compiler.is_compiling():
            graph = _START_UP_GRAPHS.get((h.device.type, h.dtype))
        if graph is not None:
            return graph(h.reshape(-1, h.shape[-1]), self.split)
        return channel_split_scales(channel_maxima(h), self.split, self.tp_group)

    def extra_repr(self) -> str:
        split = ""
        if self.granularity is SmoothSwiGLUGranularity.CHANNEL:
            split = f", weight_share={self.split.weight_share}"
            if self.split.max_weight_binades is not None:
                split += f", max_weight_binades={self.split.max_weight_binades}"
        return f"granularity={self.granularity.value}{split}, enabled={self.enabled}"


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
            cmax = swiglu_channel_maxima(out)
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
