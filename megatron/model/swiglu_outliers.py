"""SwiGLU outlier experiments: an aligned outlier channel, and the FP8 accuracy of each part of the MLP.

The functions behind `tools/fp8_outlier_demo.py`, `bench/bench_smooth_swiglu.py --parts` and the accuracy
tests of Smooth-SwiGLU (tests/unit/test_smooth_swiglu.py). All CPU, emulated FP8, seconds.

Setup (the paper's mechanism in miniature): a SwiGLU MLP with unit-RMS inputs (as after RMSNorm); channel
`OUTLIER_CHANNEL`'s up row w1 is set to its gate row w2 and both are scaled until, on the measured batch,
that channel's product h peaks at `ratio` times the largest other channel. The measured batch is ordinary
tokens plus a few rare tokens along the aligned row, which are what excite the quadratic channel.

SQNR_dB(test, ref) = 10 log10(sum ref^2 / sum (ref - test)^2), always against a float64 autograd reference
of plain SwiGLU with the same weights. Parts (`part_sqnr`):
- `output`: the whole MLP output (the outlier channel dominates it, so it hides what happens to the rest);
- `fwd others`: fc2's output restricted to the other channels, sum_{i != o} h_i w3_i. In the FP8 path the
  outlier is present in every tensor that gets quantized (it sets the scales); only its term is dropped
  from fc2's GEMM after quantization (`_KMaskedBackend`), so this is exactly what the FP8 GEMM makes of
  the other channels;
- `dW1 gate`, `dW1 up`: fc1's weight gradient on the other channels' gate and up rows;
- `dW3 others`: fc2's weight gradient on the other channels' input columns.
Gradients are those of y . dy for a fixed random dy (unit Gaussian), so they do not scale with the outlier.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.config import LLAMA, ModelConfig, SmoothSwiGLUGranularity
from megatron.fp8 import Fp8Linear, Fp8Recipe, Fp8Scaling, fp8_optimizer_step
from megatron.fp8.backends import EmulatedBackend
from megatron.fp8.formats import format_spec
from megatron.fp8.quantize import TiledFp8, amax_of, compute_scale, dequantize_tiles, quantize
from megatron.fp8.stats import sqnr_db
from megatron.model.smooth_swiglu import ChannelSplit, channel_maxima, pow2_scales, swiglu_product
from megatron.model.transformer import MLP

OUTLIER_CHANNEL = 0
PARTS = ("output", "fwd others", "dW1 gate", "dW1 up", "dW3 others")
# Named FP8 treatments of the MLP; a `ChannelSplit` is the channel form with that split.
PLAIN, CHANNEL, TOKEN, FC2_BF16 = "plain FP8", "smooth channel", "smooth token", "fc2 BF16"
Variant = Union[str, ChannelSplit]


@dataclass(frozen=True)
class OutlierSetup:
    """Shape of the experiment: MLP size, tokens per batch, rare (aligned) tokens in the measured batch."""

    hidden: int = 256
    ffn: int = 512
    tokens: int = 1024
    rare: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.rare < self.tokens:
            raise ValueError(f"OutlierSetup: need 0 < rare < tokens, got rare={self.rare}, tokens={self.tokens}")


def model_config(hidden: int, ffn: int, smooth: Optional[SmoothSwiGLUGranularity] = None) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=4,
                       ffn_hidden_size=ffn, seq_length=32, max_position_embeddings=32, padded_vocab_size=128,
                       kv_channels=hidden // 4, smooth_swiglu=smooth, **LLAMA)


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True))


def make_batches(mlp: MLP, tokens: int, rare: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration batch, measured batch): ordinary unit-RMS tokens; the measured batch ends with `rare`
    tokens pointing along the gate row of the outlier channel."""
    g = torch.Generator().manual_seed(seed + 12345)  # not the weight-init stream (it would align tokens)
    hidden = mlp.linear_fc1.in_features
    calibration = _unit_rms(torch.randn(tokens, hidden, generator=g))
    ordinary = _unit_rms(torch.randn(tokens - rare, hidden, generator=g))
    direction = mlp.linear_fc1.weight[OUTLIER_CHANNEL].detach()
    aligned = _unit_rms(direction + 0.3 * direction.abs().mean() * torch.randn(rare, hidden, generator=g))
    return calibration, torch.cat([ordinary, aligned])


@torch.no_grad()
def inject_outlier(mlp: MLP, x: torch.Tensor, ratio: float) -> MLP:
    """A copy of `mlp` whose outlier channel has up row = gate row, both scaled until on `x` its product
    peaks at `ratio` times the largest other channel's."""
    ffn = mlp.linear_fc2.in_features
    out = copy.deepcopy(mlp)
    weight = out.linear_fc1.weight
    weight[ffn + OUTLIER_CHANNEL] = weight[OUTLIER_CHANNEL]
    aligned = weight.clone()
    others = channel_maxima(swiglu_product(mlp.linear_fc1(x)))
    others[OUTLIER_CHANNEL] = 0
    lo, hi = 1e-3, 1e4
    for _ in range(80):  # bisection on log(c): h_o grows ~ c^2
        c = math.sqrt(lo * hi)
        weight.copy_(aligned)
        weight[OUTLIER_CHANNEL] *= c
        weight[ffn + OUTLIER_CHANNEL] *= c
        if channel_maxima(swiglu_product(out.linear_fc1(x)))[OUTLIER_CHANNEL] / others.max() < ratio:
            lo = c
        else:
            hi = c
    return out


def outlier_mlp(setup: OutlierSetup, ratio: Optional[float]) -> tuple[MLP, torch.Tensor, torch.Tensor]:
    """(plain FP32 MLP, calibration batch, measured batch); `ratio=None` leaves the weights untouched."""
    torch.manual_seed(setup.seed)
    base = MLP(model_config(setup.hidden, setup.ffn))
    calibration, measured = make_batches(base, setup.tokens, setup.rare, setup.seed)
    return (base if ratio is None else inject_outlier(base, measured, ratio)), calibration, measured


def fp8_variant(mlp: MLP, variant: Variant, recipe: Fp8Recipe, fc1_fp8: bool = True) -> MLP:
    """A copy of `mlp` with the FP8 treatment `variant` (fc1 stays FP32 when `fc1_fp8` is False)."""
    split = variant if isinstance(variant, ChannelSplit) else None
    smooth = SmoothSwiGLUGranularity.CHANNEL if split is not None else {
        CHANNEL: SmoothSwiGLUGranularity.CHANNEL, TOKEN: SmoothSwiGLUGranularity.TOKEN}.get(variant)
    hidden, ffn = mlp.linear_fc1.in_features, mlp.linear_fc2.in_features
    out = MLP(model_config(hidden, ffn, smooth))
    out.load_state_dict(mlp.state_dict())
    if split is not None:
        out.smooth_swiglu.split = split
    if fc1_fp8:
        out.linear_fc1 = Fp8Linear.from_linear(out.linear_fc1, recipe)
    if variant != FC2_BF16:
        out.linear_fc2 = Fp8Linear.from_linear(out.linear_fc2, recipe)
    return out


class _KMaskedBackend(EmulatedBackend):
    """The emulated backend with one index of the GEMMs' inner (K) dimension dropped after quantization."""

    def __init__(self, k_index: int) -> None:
        self.k_index = k_index

    def gemm_nt(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                out_dtype: torch.dtype, *args, **kwargs) -> torch.Tensor:
        a = a.float().clone()
        a[:, self.k_index] = 0
        return ((a @ b.float().t()) / (a_scale.float() * b_scale.float())).to(out_dtype)

    def gemm_tiles(self, a: TiledFp8, b: TiledFp8, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
        # The fine-grained recipes (--fp8-recipe rowwise/blockwise/mxfp8) multiply tile-scaled operands.
        a_values = dequantize_tiles(a).clone()
        a_values[:, self.k_index] = 0
        return (a_values @ dequantize_tiles(b).t()).to(out_dtype)


def _reference_parts(mlp: MLP, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    w1 = mlp.linear_fc1.weight.detach().double().requires_grad_()
    w3 = mlp.linear_fc2.weight.detach().double().requires_grad_()
    h = swiglu_product(x.double() @ w1.t())
    y = h @ w3.t()
    y.backward(dy.double())
    keep = torch.ones(w3.shape[1], dtype=torch.bool)
    keep[OUTLIER_CHANNEL] = False
    return {"output": y.detach(), "fwd others": (h[:, keep] @ w3[:, keep].t()).detach(),
            **_grad_parts(w1.grad, w3.grad)}


def _grad_parts(dw1: torch.Tensor, dw3: torch.Tensor) -> dict[str, torch.Tensor]:
    ffn = dw3.shape[1]
    keep = torch.ones(ffn, dtype=torch.bool)
    keep[OUTLIER_CHANNEL] = False
    return {"dW1 gate": dw1[:ffn][keep], "dW1 up": dw1[ffn:][keep], "dW3 others": dw3[:, keep]}


def part_sqnr(mlp: MLP, x: torch.Tensor, variant: Variant,
              recipe: Fp8Recipe = Fp8Recipe(scaling=Fp8Scaling.TENSORWISE),
              calibration: Optional[torch.Tensor] = None, seed: int = 0) -> dict[str, float]:
    """SQNR (dB) of each of `PARTS` of the FP8 MLP `variant` against float64 plain SwiGLU, on `x`.

    fc1 and fc2 in FP8, fp32 compute. With `calibration`, a first training step on it sets the delayed
    scales (so under delayed scaling an outlier that only `x` excites arrives suddenly). Then one training
    forward/backward on `x`, and an inference forward whose fc2 GEMM drops the outlier channel after
    quantization, for `fwd others`; no scale changes between the two (delayed scales move only at the
    optimizer step, current ones follow the same tensors).
    """
    if variant == FC2_BF16:
        raise ValueError("part_sqnr measures FP8 GEMMs: fc2 BF16 has none in fc2")
    dy = torch.randn(x.shape[0], mlp.linear_fc2.out_features, generator=torch.Generator().manual_seed(seed + 7))
    reference = _reference_parts(mlp, x, dy)
    model = fp8_variant(mlp, variant, recipe).train()
    if calibration is not None:  # the same kind of upstream gradient, so only the outlier is new
        model(calibration).backward(torch.randn(calibration.shape[0], mlp.linear_fc2.out_features,
                                                generator=torch.Generator().manual_seed(seed + 8)))
        fp8_optimizer_step(model)
        model.zero_grad()
    y = model(x)
    y.backward(dy)
    got = {"output": y.detach(), **_grad_parts(model.linear_fc1.weight.grad, model.linear_fc2.weight.grad)}
    model.eval()
    masked = _KMaskedBackend(OUTLIER_CHANNEL)
    model.linear_fc2.fp8.backend = lambda device: masked  # this layer only: drop the outlier's K index
    with torch.no_grad():
        got["fwd others"] = model(x)
    return {part: sqnr_db(got[part], reference[part]) for part in PARTS}


def blockwise_fwd_others_sqnr(mlp: MLP, x: torch.Tensor, block: int = 128) -> float:
    """`fwd others` SQNR of the candidate "full fold, fc2's weight scaled per K-block of `block` columns".

    Not in the model (measured here only): input h * s quantized per tensor (flat by construction), the
    folded weight W3 diag(1/s) quantized with one E4M3 scale per block of `block` input channels (what
    several scaled-mm calls or a blockwise-scaled GEMM would do), GEMM without the outlier's term.
    """
    spec = format_spec("e4m3")
    with torch.no_grad():
        h = swiglu_product(mlp.linear_fc1(x).float())
        scale, inverse = pow2_scales(channel_maxima(h))
        hs = h * scale
        s_h = compute_scale(amax_of(hs), spec.max)
        qh = quantize(hs, s_h, spec).float() / s_h
        w = mlp.linear_fc2.weight.float() * inverse
        qw = torch.empty_like(w)
        for start in range(0, w.shape[1], block):
            cols = w[:, start:start + block]
            s_w = compute_scale(amax_of(cols), spec.max)
            qw[:, start:start + block] = quantize(cols, s_w, spec).float() / s_w
        qh[:, OUTLIER_CHANNEL] = 0
        got = qh @ qw.t()
    reference = _reference_parts(mlp, x, torch.zeros(x.shape[0], w.shape[0]))["fwd others"]
    return sqnr_db(got, reference)


def sudden_outlier_sqnr(mlp: MLP, calibration: torch.Tensor, measured: torch.Tensor, variant: Variant,
                        recipe: Fp8Recipe = Fp8Recipe(scaling=Fp8Scaling.DELAYED), fc1_fp8: bool = False) -> float:
    """Output SQNR (dB) vs float64 when the outlier first appears: one training step on `calibration` (no
    rare tokens: the channel stays quiet) sets the delayed scales, then `measured` runs in inference.
    By default only fc2 is FP8, which isolates fc2's input cast."""
    model = fp8_variant(mlp, variant, recipe, fc1_fp8=fc1_fp8).train()
    model(calibration).square().mean().backward()
    fp8_optimizer_step(model)
    model.eval()
    with torch.no_grad():
        got = model(measured)
    return sqnr_db(got, _reference_parts(mlp, measured, torch.zeros_like(got))["output"])
