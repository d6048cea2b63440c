"""SwiGLU diagnostics: alignment and outlier statistics, recording only on logging steps, jump warnings,
TensorBoard scalars of a tiny run, and tools/analyze_swiglu.py on its checkpoints."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import load_tool, tiny_argv
from megatron.arguments import parse_config
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.swiglu_diagnostics import (ActivationRecorder, JumpDetector, alignment_summary,
                                               outlier_summary, up_gate_alignment)
from megatron.training.loop import pretrain
from megatron.training.swiglu_hooks import SwiGLUHooks

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
                  seq_length=32, max_position_embeddings=32, padded_vocab_size=128, kv_channels=16)


def test_alignment_is_abs_cosine_of_up_and_gate_rows():
    gate = torch.randn(4, 16)
    up = torch.stack([gate[0] * 3, -gate[1], torch.zeros(16), torch.randn(16)])
    up[3] -= (up[3] @ gate[3]) / (gate[3] @ gate[3]) * gate[3]  # orthogonal to its gate row
    cos = up_gate_alignment(torch.cat([gate, up]))
    torch.testing.assert_close(cos, torch.tensor([1.0, 1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    summary = alignment_summary(cos)
    assert summary["align_max"] == pytest.approx(1.0) and summary["align_count_gt_0.5"] == 2
    assert outlier_summary(torch.tensor([1.0, 2.0, 100.0])) == {"act_max": 100.0, "outlier_ratio": 50.0}
    assert outlier_summary(torch.zeros(3))["outlier_ratio"] == 0.0


def test_recorder_records_only_while_armed():
    torch.manual_seed(0)
    model = GPTModel(CFG)
    tokens = torch.randint(0, 128, (2, 32))
    recorder = ActivationRecorder(model)
    model(tokens)
    assert recorder.collect() == [None, None]  # not armed: nothing computed
    recorder.arm()
    expected = []
    handle = model.decoder.layers[1].mlp.linear_fc1.register_forward_hook(
        lambda m, i, out: expected.append(out.detach()))
    model(tokens)
    handle.remove()
    maxima = recorder.collect()
    gate, up = expected[0].chunk(2, dim=-1)
    torch.testing.assert_close(maxima[1], (F.silu(gate) * up).abs().amax(dim=(0, 1)))
    assert not recorder.armed and all(not m.linear_fc1._forward_hooks for m in recorder.mlps)


def test_jump_detector_needs_history_and_a_doubling():
    jumps = JumpDetector(factor=2.0, min_points=3)
    assert [jumps.update("k", v) for v in (1.0, 1.1, 50.0)] == [None, None, None]  # too little history
    assert jumps.update("k", 2.0) is None  # median(1, 1.1, 50) = 1.1 and 2.0 < 2.2: the median ignores 50
    assert jumps.update("k", 10.0) == 1.55  # median(1, 1.1, 50, 2) = 1.55 and 10 > 3.1
    assert jumps.update("other", 100.0) is None  # series are independent


def test_hooks_warn_when_a_layer_aligns(caplog):
    torch.manual_seed(0)
    model = GPTModel(CFG)
    hooks = SwiGLUHooks(model, CFG, diagnostics=True)
    tokens = torch.randint(0, 128, (2, 32))
    caplog.set_level(logging.WARNING, logger="megatron")
    for iteration in (5, 10, 15, 20):
        hooks.before_step(iteration, 5)
        model(tokens)
        if iteration == 20:  # layer 1's channel 3: up row := gate row (the paper's w1 = w2 alignment)
            hooks.recorder.collect()
            with torch.no_grad():
                w = model.decoder.layers[1].mlp.linear_fc1.weight
                w[128 + 3] = w[3] * 40
            hooks.before_step(iteration, 5)
            model(tokens)
        values, text = hooks.log_values(iteration, 5)
    assert values["swiglu/layer1/align_max"] == pytest.approx(1.0)
    assert values["swiglu/layer1/outlier_ratio"] > values["swiglu/layer0/outlier_ratio"]
    assert "layer 1" in text
    assert "align_max of layer 1 jumped" in caplog.text and "outlier_ratio of layer 1 jumped" in caplog.text
    assert "layer 0 jumped" not in caplog.text
    assert hooks.log_values(21, 5) == ({}, "")  # nothing between log intervals


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny FP8 + Smooth-SwiGLU run with TensorBoard and 3 checkpoints (iterations 4, 8, 12)."""
    root = tmp_path_factory.mktemp("swiglu_run")
    pretrain(parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", "--smooth-swiglu", train_iters=12,
                                    eval_iters=0, log_interval=4, save_interval=4, save=root / "ckpt",
                                    tensorboard_dir=root / "tb")))
    return root


def test_diagnostics_reach_tensorboard(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tiny_run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for layer in (0, 1):
        for key in ("act_max", "outlier_ratio", "align_max", "align_p99", "align_count_gt_0.5"):
            assert f"swiglu/layer{layer}/{key}" in tags, sorted(t for t in tags if "swiglu" in t)
    assert [e.step for e in acc.Scalars("swiglu/layer0/outlier_ratio")] == [4, 8, 12]


def test_no_swiglu_diagnostics_flag_turns_them_off():
    config = parse_config(tiny_argv("--no-swiglu-diagnostics"))
    assert config.logging.log_swiglu_diagnostics is False
    hooks = SwiGLUHooks(GPTModel(CFG), CFG, diagnostics=config.logging.log_swiglu_diagnostics)
    hooks.before_step(5, 5)
    assert hooks.log_values(5, 5) == ({}, "")


def test_analyze_swiglu_tool_reads_a_run(tiny_run, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    tool = load_tool("analyze_swiglu")
    rows = tool.analyze(tiny_run / "ckpt")
    assert [it for it, _ in rows] == [4, 8, 12] and set(rows[0][1]) == {0, 1}
    assert all(0 < s["align_p99"] <= s["align_max"] <= 1 for _, layers in rows for s in layers.values())
    png = tiny_run / "align.png"
    tool.main([str(tiny_run / "ckpt"), "--top-k", "3", "--png", str(png)])
    out = capsys.readouterr().out
    assert "top 3 aligned channels at iteration 12" in out and out.count("channel") >= 3
    assert png.stat().st_size > 1000
    single = tool.analyze(tiny_run / "ckpt" / "iter_0000008")
    assert [it for it, _ in single] == [8]
