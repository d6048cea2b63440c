"""Smooth-SwiGLU: exact re-parametrisation in FP32, FP8 accuracy with an outlier, training, export. The TP scales
(2 spawned processes) are in tests/e2e/test_smooth_swiglu_launch.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.config import LLAMA, ModelConfig, SmoothSwiGLUGranularity as G
from megatron.fp8 import Fp8Linear, Fp8Recipe, Fp8Scaling
from megatron.model import GPTModel
from megatron.model.smooth_swiglu import (ChannelSplit, calibrate_smooth_swiglu_scales, channel_maxima,
                                          channel_split_scales, fold_smooth_swiglu_scales, pow2_scales,
                                          swiglu_product)
from megatron.model.swiglu_outliers import (CHANNEL, PARTS, PLAIN, TOKEN, OutlierSetup, outlier_mlp, part_sqnr,
                                            sudden_outlier_sqnr)
from megatron.model.transformer import MLP
from megatron.training.loop import pretrain
from tests.support.config import load_tool, tiny_argv
from tests.support.training import assert_resume_is_exact

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
            seq_length=32, max_position_embeddings=32, padded_vocab_size=128, kv_channels=16, **LLAMA)
FP8 = ("--bf16", "--fp8-format", "hybrid")


def _mlp(smooth=None, bias=False, like: MLP | None = None) -> MLP:
    mlp = MLP(ModelConfig(**{**BASE, "add_bias_linear": bias}, smooth_swiglu=smooth))
    if like is not None:
        mlp.load_state_dict(like.state_dict())
    return mlp


def _output_and_grads(mlp: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = mlp(x)
    y.float().square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]


# ------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("smooth,bias", [(G.CHANNEL, False), (G.TOKEN, False), (G.CHANNEL, True)])
def test_fp32_output_and_gradients_equal_plain_swiglu(smooth, bias):
    torch.manual_seed(0)
    plain = _mlp(bias=bias)
    if bias:
        for p in (plain.linear_fc1.bias, plain.linear_fc2.bias):
            nn.init.normal_(p, std=0.1)
    x = torch.randn(4, 32, 64) * torch.logspace(-2, 2, 64)  # very uneven channels
    expected = _output_and_grads(plain, x)
    got = _output_and_grads(_mlp(smooth, bias, like=plain), x)
    for name, e, g in zip(["y", "dx", *[n for n, _ in plain.named_parameters()]], expected, got):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6 * float(e.abs().max()), msg=name)


def test_token_form_with_biases_is_refused():
    with pytest.raises(ValueError, match="disable-bias-linear"):
        _mlp(G.TOKEN, bias=True)


def test_scales_are_safe_powers_of_two():
    maxima = torch.tensor([0.0, float("inf"), float("nan"), 1e-44, 3.0, 4.0, 3e38])
    scale, inverse = pow2_scales(maxima)
    assert torch.isfinite(scale).all() and torch.isfinite(inverse).all()
    assert torch.equal(scale * inverse, torch.ones_like(scale))
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    assert scale[:3].tolist() == [1.0, 1.0, 1.0]
    normalised = maxima[4:6] * scale[4:6]
    assert ((normalised >= 0.5) & (normalised < 1.0)).all(), normalised
    assert torch.isfinite(maxima[6] * scale[6])  # near the fp32 max the clamped exponent keeps it finite


@pytest.mark.parametrize("smooth", [G.CHANNEL, G.TOKEN])
def test_dead_channels_and_tokens_stay_finite(smooth):
    torch.manual_seed(0)
    plain = _mlp()
    with torch.no_grad():
        plain.linear_fc1.weight[128 + 5] = 0.0  # up row of channel 5: h_5 == 0 on every token
    x = torch.randn(2, 8, 64)
    x[0, 3] = 0.0  # an all-zero token: up == 0 on every channel
    expected = _output_and_grads(plain, x)
    got = _output_and_grads(_mlp(smooth, like=plain), x)
    for e, g in zip(expected, got):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------- FP8 path
def _fp8(mlp: MLP, recipe: Fp8Recipe) -> MLP:
    mlp.linear_fc1 = Fp8Linear.from_linear(mlp.linear_fc1, recipe)
    mlp.linear_fc2 = Fp8Linear.from_linear(mlp.linear_fc2, recipe)
    return mlp


def test_column_scaled_fp8_weight_is_one_gemm_with_exact_gradient():
    """Fp8Linear(x, weight_column_scale=c) == Fp8Linear with weight W*c; dW == dW_eff * c; no caching."""
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, bias=False, recipe=Fp8Recipe(scaling=Fp8Scaling.TENSORWISE))
    c = torch.exp2(torch.randint(-4, 5, (32,)).float())
    ref = Fp8Linear(32, 16, bias=False, recipe=lin.fp8.recipe)
    with torch.no_grad():
        ref.weight.copy_(lin.weight * c)
    x = torch.randn(8, 32, requires_grad=True)
    y = lin(x, weight_column_scale=c)
    y.square().sum().backward()
    dx = x.grad.clone()
    x.grad = None
    y_ref = ref(x)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, x.grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad * c, rtol=1e-6, atol=0)
    lin(x, weight_column_scale=c)
    assert lin.fp8.weight_quantizations == 2  # a new FP8 weight at every call, never the step cache


def test_channel_split_scales_are_exact_and_give_the_input_amax():
    torch.manual_seed(0)
    mlp = _fp8(_mlp(G.CHANNEL), Fp8Recipe())
    x = torch.randn(2, 16, 64)
    for _ in range(3):  # three micro-batches of one optimizer step
        mlp(x).sum().backward()
    assert mlp.linear_fc1.fp8.weight_quantizations == 1  # cached once per step
    assert mlp.linear_fc2.fp8.weight_quantizations == 3  # W3 * (1/a) changes with every micro-batch
    h = swiglu_product(mlp.linear_fc1(x).detach())
    h[..., 3] *= 1e5  # an outlier channel
    cmax = channel_maxima(h)
    scale, inverse, amax = channel_split_scales(cmax, ChannelSplit(0.5))
    assert torch.equal(scale * inverse, torch.ones_like(scale))
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two: exact multiplies
    assert torch.equal(amax, (h * scale).abs().amax())  # the cast's amax, from the [F] maxima alone
    assert 0.5 <= float(amax) < 1.0
    # The outlier's range is shared: input and weight columns each carry about its square root (2^17 here).
    spread = torch.log2(cmax * scale)
    assert 7 <= float(spread.max() - spread.median()) <= 10, spread
    # The full fold (the paper's form) is the old per-channel normalisation.
    full_scale, full_inverse, full_amax = channel_split_scales(cmax, ChannelSplit(1.0))
    assert torch.equal(full_scale, pow2_scales(cmax)[0]) and torch.equal(full_amax, (cmax * full_scale).amax())
    assert 0.5 <= float(mlp.linear_fc2.fp8_step_amax[0]) < 1.0  # fc2 input amax is normalised
    with pytest.raises(ValueError, match="weight_share"):
        ChannelSplit(1.5)


# Per-part accuracy with an aligned outlier channel (megatron/model/swiglu_outliers.py; hidden 256, FFN 512,
# 1024 tokens of which 8 excite the outlier). SQNR_dB = 10 log10(sum ref^2 / sum (ref - fp8)^2) against a
# float64 autograd reference of plain SwiGLU. Parts: the whole output; fc2's output restricted to the other
# channels (the outlier is quantized with everything else, its term is dropped from fc2's GEMM after
# quantization); fc1's weight gradient on the other channels' gate rows and up rows; fc2's weight gradient on
# the other channels' input columns. A first training step without the rare tokens sets the delayed scales,
# so under delayed scaling the outlier arrives suddenly.
SETUP = OutlierSetup()
_BASELINES: dict = {}


def _parts(ratio, variant, recipe):
    mlp, calibration, measured = outlier_mlp(SETUP, ratio)
    return part_sqnr(mlp, measured, variant, recipe, calibration=calibration)


def _baseline(recipe):
    """The same FP8 path without the outlier: the format's own noise on every part."""
    key = (recipe.format, recipe.scaling)
    if key not in _BASELINES:
        _BASELINES[key] = _parts(None, CHANNEL, recipe)
    return _BASELINES[key]


@pytest.mark.parametrize("scaling", [Fp8Scaling.DELAYED, Fp8Scaling.TENSORWISE])
@pytest.mark.parametrize("ratio", [1e3, 1e4, 1e5])
def test_channel_form_keeps_every_part_of_the_other_channels(ratio, scaling):
    """With E4M3 everywhere, whose own noise here is ~24 dB, every part keeps >= 20 dB. With the hybrid
    recipe, E5M2 gradients alone put fc1's weight gradient at ~21 dB with no outlier at all, so there the bar
    is relative: the outlier may cost each part at most 1 dB over that no-outlier value. The full fold
    (weight_share 1) fails both from 1e4 on; plain FP8 too (see the negative control below)."""
    e4m3 = Fp8Recipe(scaling=scaling, format="e4m3")
    got = _parts(ratio, CHANNEL, e4m3)
    assert all(got[p] >= 20 for p in PARTS), got
    hybrid = Fp8Recipe(scaling=scaling)
    got, clean = _parts(ratio, CHANNEL, hybrid), _baseline(hybrid)
    assert all(got[p] >= clean[p] - 1.0 for p in PARTS), (got, clean)
    assert got["output"] >= 20, got


def test_full_fold_and_plain_fp8_lose_the_other_channels_that_the_whole_output_hides():
    """Negative control of the per-part measurement at a 1e5x outlier (tensorwise scaling): folding the whole
    1/s into fc2's weight (the paper's form, our former code) crushes the other weight columns, plain FP8 the
    other input channels; the whole-output SQNR stays high for both, the parts show it."""
    recipe = Fp8Recipe(scaling=Fp8Scaling.TENSORWISE)
    full_fold, plain = _parts(1e5, ChannelSplit(1.0), recipe), _parts(1e5, PLAIN, recipe)
    for got in (full_fold, plain):
        assert got["output"] > 25 and got["fwd others"] < 10, got
    assert full_fold["dW1 gate"] < 10 and full_fold["dW1 up"] < 10, full_fold  # via fc2's input gradient
    assert plain["dW3 others"] < 10, plain  # via fc2's quantized input


def test_sudden_outlier_under_delayed_scaling_defeats_the_token_form():
    """fc2 alone in FP8, delayed scaling set on a batch where the aligned channel is quiet, then a 1000x
    outlier. The token form divides `up` by its per-token max, so an aligned channel's Swish(g) * g / max|g|
    is still linear in g: unbounded, clipped by the stale scale like plain FP8. The channel form scales fc2's
    input from the exact amax of this very batch (current scaling for free)."""
    mlp, calibration, measured = outlier_mlp(SETUP, 1e3)
    got = {v: sudden_outlier_sqnr(mlp, calibration, measured, v) for v in (CHANNEL, TOKEN, PLAIN)}
    assert got[CHANNEL] >= 25 and got[TOKEN] < 10 and got[PLAIN] < 10, got
    clean, calibration, measured = outlier_mlp(SETUP, None)
    for v in (CHANNEL, TOKEN, PLAIN):  # without the outlier every form is an ordinary FP8 MLP
        assert sudden_outlier_sqnr(clean, calibration, measured, v) >= 20, v


def test_outlier_demo_table():
    """tools/fp8_outlier_demo.py (bf16 autocast, fc1 and fc2 FP8): the same story in the whole output."""
    demo = load_tool("fp8_outlier_demo")
    table = demo.sqnr_table(Fp8Scaling.DELAYED, ratio=1000, hidden=256, ffn=512, tokens=1024, rare=8)
    clean, outlier = table["no outlier"], table["outlier"]
    assert clean["plain FP8"] > 20 and abs(clean["smooth channel"] - clean["plain FP8"]) < 1.0, table
    assert outlier["plain FP8"] < 6 and outlier["smooth token"] < 10, table  # clipped by the stale scale
    assert outlier["smooth channel"] > clean["plain FP8"] - 3, table  # stays near the no-outlier value
    assert outlier["fc2 BF16"] > 20, table


# ------------------------------------------------------------------------------------- training
def _final(result) -> float:
    return sum(result.losses[-5:]) / 5


def test_smooth_swiglu_trains_like_bf16():
    common = dict(train_iters=20, eval_iters=0)
    bf16 = pretrain(parse_config(tiny_argv("--bf16", **common)))
    for granularity in ("channel", "token"):
        run = pretrain(parse_config(tiny_argv(*FP8, "--smooth-swiglu", "--smooth-swiglu-granularity", granularity,
                                              **common)))
        assert all(m.smooth_swiglu.enabled for m in (layer.mlp for layer in run.model.decoder.layers))
        assert _final(run) < run.losses[0] - 1.5, granularity  # learns clearly
        assert abs(_final(run) - _final(bf16)) / _final(bf16) < 0.01, (granularity, _final(run), _final(bf16))


def test_smooth_swiglu_resumes_exactly(tmp_path):
    assert_resume_is_exact(tmp_path, (*FP8, "--smooth-swiglu"), 2, train_iters=4, eval_interval=2, eval_iters=1)


def test_fp8_mlp_fc2_bf16_trains_and_smoothing_becomes_a_no_op(capfd):
    run = pretrain(parse_config(tiny_argv(*FP8, "--fp8-mlp-fc2-bf16", "--smooth-swiglu", train_iters=12,
                                          eval_iters=0)))
    for layer in run.model.decoder.layers:
        assert type(layer.mlp.linear_fc2) is nn.Linear and isinstance(layer.mlp.linear_fc1, Fp8Linear)
        assert not layer.mlp.smooth_swiglu.enabled
    assert "smooth-swiglu: off in layers [0, 1], whose fc2 is not FP8" in capfd.readouterr().err
    assert _final(run) < run.losses[0] - 1.0


# ------------------------------------------------------------------------------------------ export
def test_folded_plain_model_matches_smooth_model():
    torch.manual_seed(0)
    smooth_cfg = ModelConfig(**BASE, smooth_swiglu=G.CHANNEL)
    smooth = GPTModel(smooth_cfg).eval()
    tokens = torch.randint(0, 128, (2, 32))
    scales = calibrate_smooth_swiglu_scales(smooth, tokens)
    assert set(scales) == {0, 1} and all(s.shape == (128,) for s in scales.values())
    plain_cfg = ModelConfig(**BASE)
    folded = GPTModel(plain_cfg).eval()
    folded.load_state_dict(fold_smooth_swiglu_scales(smooth.state_dict(), plain_cfg, scales))
    assert not torch.equal(folded.decoder.layers[0].mlp.linear_fc2.weight,
                           smooth.decoder.layers[0].mlp.linear_fc2.weight)
    with torch.no_grad():
        torch.testing.assert_close(folded(tokens), smooth(tokens), rtol=1e-5, atol=1e-5)
        # The folded fc2 input is normalised per channel on the calibration batch: max in [0.5, 1).
        h_max = calibrate_smooth_swiglu_scales(folded, tokens)
        assert all(torch.equal(s, torch.ones(128)) for s in h_max.values())
    # Without scales the export is the identity: smooth weights are plain SwiGLU weights.
    same = fold_smooth_swiglu_scales(smooth.state_dict(), smooth_cfg)
    assert all(torch.equal(same[k], v) for k, v in smooth.state_dict().items())


@pytest.mark.parametrize("rows", [64, 24])  # row blocks, and a count that 16 does not divide
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_channel_maxima_equal_the_eager_ones(rows, dtype):
    """`channel_maxima` compiled (|h| in fp32, over row blocks first) gives the eager maxima bit for bit, NaN and inf
    included: |.| and max round nothing."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(2, rows // 2, 40, generator=g) * 2.0 ** torch.randint(-30, 30, (2, rows // 2, 40), generator=g))
    h = h.to(dtype)
    h[0, 1, 3], h[1, 2, 5], h[0, 0, 7] = float("nan"), float("-inf"), -0.0
    compiled = torch.compile(channel_maxima, dynamic=False, fullgraph=True)(h)
    eager = channel_maxima(h)
    assert compiled.dtype == eager.dtype == torch.float32
    assert torch.equal(compiled.nan_to_num(nan=-1.0), eager.nan_to_num(nan=-1.0))
    assert compiled[3].isnan() and compiled[5] == float("inf")
