"""Smooth-SwiGLU: exact re-parametrisation in FP32, FP8 accuracy with an outlier, training, TP scales, export."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import load_tool, tiny_argv
from megatron.arguments import parse_config
from megatron.config import ModelConfig, SmoothSwiGLUGranularity as G
from megatron.fp8 import Fp8Linear, Fp8Recipe, Fp8Scaling, fp8_optimizer_step
from megatron.model import GPTModel
from megatron.model.smooth_swiglu import (calibrate_smooth_swiglu_scales, channel_maxima,
                                          fold_smooth_swiglu_scales, pow2_scales, token_maxima)
from megatron.model.transformer import MLP
from megatron.training.loop import pretrain
from test_fp8_helpers import sqnr_db

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
            seq_length=32, max_position_embeddings=32, padded_vocab_size=128, kv_channels=16)
FP8 = ("--bf16", "--fp8-format", "hybrid")


def _mlp(smooth=None, bias=False, like: MLP | None = None) -> MLP:
    mlp = MLP(ModelConfig(**BASE, smooth_swiglu=smooth, add_bias_linear=bias))
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
    ref = Fp8Linear(32, 16, bias=False, recipe=lin.recipe)
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
    assert lin.fp8_weight_quantizations == 2  # a new FP8 weight at every call, never the step cache


@pytest.mark.parametrize("scaling", [Fp8Scaling.DELAYED, Fp8Scaling.TENSORWISE])
@pytest.mark.parametrize("smooth", [G.CHANNEL, G.TOKEN])
def test_fp8_smooth_mlp_tracks_fp32(scaling, smooth):
    torch.manual_seed(0)
    plain = _mlp()
    x = torch.randn(4, 32, 64)
    expected = _output_and_grads(plain, x)
    mlp = _fp8(_mlp(smooth, like=plain), Fp8Recipe(scaling=scaling))
    for _ in range(2):  # the second step uses the delayed scales of the first
        mlp.zero_grad()
        got = _output_and_grads(mlp, x)
        fp8_optimizer_step(mlp)
    for name, e, g in zip(["y", "dx", "fc1", "fc2"], expected, got):
        assert sqnr_db(g, e) > 20, (name, sqnr_db(g, e))


def test_channel_form_requantizes_fc2_weight_per_micro_batch_and_reuses_its_amax():
    torch.manual_seed(0)
    mlp = _fp8(_mlp(G.CHANNEL), Fp8Recipe())
    x = torch.randn(2, 16, 64)
    for _ in range(3):  # three micro-batches of one optimizer step
        mlp(x).sum().backward()
    assert mlp.linear_fc1.fp8_weight_quantizations == 1  # cached once per step
    assert mlp.linear_fc2.fp8_weight_quantizations == 3  # W3 * s^-1 changes with every micro-batch
    # The cast's amax handed to fc2 is the max of h*s, derived from the per-channel reduction alone.
    gate, up = mlp.linear_fc1(x).detach().chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    cmax = channel_maxima(h)
    scale, _ = pow2_scales(cmax)
    assert torch.equal((cmax * scale).amax(), (h * scale).abs().amax())
    assert 0.5 <= float(mlp.linear_fc2.fp8_step_amax[0]) < 1.0  # fc2 input amax is normalised


def test_outlier_collapses_plain_fp8_but_not_smooth_channel():
    demo = load_tool("fp8_outlier_demo")
    table = demo.sqnr_table(Fp8Scaling.DELAYED, ratio=1000, hidden=256, ffn=512, tokens=1024, rare=8)
    clean, outlier = table["no outlier"], table["outlier"]
    assert clean["plain FP8"] > 20 and abs(clean["smooth channel"] - clean["plain FP8"]) < 1.0, table
    assert outlier["plain FP8"] < 6, table  # clipped by the stale delayed scale: SQNR collapses
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
    args = (*FP8, "--smooth-swiglu")
    common = dict(train_iters=4, eval_interval=2, eval_iters=1)
    straight = pretrain(parse_config(tiny_argv(*args, **common)))
    pretrain(parse_config(tiny_argv(*args, save=tmp_path / "c", exit_interval=2, **common)))
    resumed = pretrain(parse_config(tiny_argv(*args, load=tmp_path / "c", **common)))
    assert straight.losses[2:] == resumed.losses
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_fp8_mlp_fc2_bf16_trains_and_smoothing_becomes_a_no_op(capfd):
    run = pretrain(parse_config(tiny_argv(*FP8, "--fp8-mlp-fc2-bf16", "--smooth-swiglu", train_iters=12,
                                          eval_iters=0)))
    for layer in run.model.decoder.layers:
        assert type(layer.mlp.linear_fc2) is nn.Linear and isinstance(layer.mlp.linear_fc1, Fp8Linear)
        assert not layer.mlp.smooth_swiglu.enabled
    assert "smooth-swiglu: off in layers [0, 1], whose fc2 is not FP8" in capfd.readouterr().err
    assert _final(run) < run.losses[0] - 1.0


# ----------------------------------------------------------------------------- tensor parallel
def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        up = torch.randn(3, 5, 64) * torch.logspace(-1, 1, 64)  # the full [b, s, F] on every rank
        shard = up.chunk(2, dim=-1)[rank]  # this rank's FFN channels (column-parallel fc1)
        torch.save({"local": token_maxima(shard), "reduced": token_maxima(shard, dist.group.WORLD),
                    "full": token_maxima(up)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_token_scales_max_reduced_over_tp_group_match_one_rank(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert torch.equal(r["reduced"], r["full"])
        assert torch.equal(pow2_scales(r["reduced"])[0], pow2_scales(r["full"])[0])
    assert not torch.equal(ranks[0]["local"], ranks[1]["local"])  # without the reduction ranks disagree


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
