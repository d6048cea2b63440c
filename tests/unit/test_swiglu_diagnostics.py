"""SwiGLU diagnostics: alignment and outlier statistics, recording only on logging steps, jump warnings over a
bounded window whose history survives a resume, TensorBoard scalars of a tiny run, and tools/analyze_swiglu.py on
its checkpoints."""
from __future__ import annotations

import contextlib
import json
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron.arguments import parse_config
from megatron.config import LLAMA, ModelConfig
from megatron.model import GPTModel
from megatron.model.swiglu_diagnostics import (ActivationRecorder, JumpDetector, alignment_summary,
                                               outlier_summary, up_gate_alignment)
from megatron.checkpoint.store import CheckpointError, model_file
from megatron.training.loop import pretrain
from megatron.training.swiglu_hooks import STATE_KEY, SwiGLUHooks
from tests.support.config import load_tool, tiny_argv

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
                  seq_length=32, max_position_embeddings=32, padded_vocab_size=128, kv_channels=16,
                  **LLAMA)


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


def test_recorder_hooks_compiled_blocks_once_for_all_layers():
    """Every layer's fc1 gets the same hook, which dynamo does not trace (a graph break on the armed iterations):
    traced, its per-layer bookkeeping compiled the block once more per layer, 80 times for a 70B model."""
    model = GPTModel(CFG)
    recorder = ActivationRecorder(model)
    recorder.arm()
    hooks = [list(m.linear_fc1._forward_hooks.values()) for m in recorder.mlps]
    assert all(len(h) == 1 for h in hooks) and len({h[0].__func__ for h in hooks}) == 1
    assert getattr(hooks[0][0].__func__, "_torchdynamo_disable", False)
    recorder.collect()


def test_jump_detector_needs_history_and_a_doubling():
    jumps = JumpDetector(factor=2.0, min_points=3)
    assert [jumps.update("k", v) for v in (1.0, 1.1, 50.0)] == [None, None, None]  # too little history
    assert jumps.update("k", 2.0) is None  # median(1, 1.1, 50) = 1.1 and 2.0 < 2.2: the median ignores 50
    assert jumps.update("k", 10.0) == 1.55  # median(1, 1.1, 50, 2) = 1.55 and 10 > 3.1
    assert jumps.update("other", 100.0) is None  # series are independent


def test_window_keeps_a_plateau_reference_through_spikes():
    """After a long plateau a spike warns; spikes inside the window do not move the median (fewer than W/2 of
    them), so the next spike warns too; and the history holds W points, not the whole run."""
    jumps = JumpDetector(factor=2.0, min_points=3, window=32)
    assert all(jumps.update("k", 1.0) is None for _ in range(500))
    assert len(jumps.history["k"]) == 32
    assert jumps.update("k", 2.5) == 1.0
    assert jumps.update("k", 100.0) == 1.0
    assert jumps.update("k", 1.0) is None and jumps.update("k", 2.01) == 1.0


def test_window_follows_a_slow_drift_that_the_whole_run_median_warns_about():
    """A value rising 2% per log point (2^(1/16) = 4.4% is the bound for W = 32, see JumpDetector): the windowed
    median follows it, never warning; over the whole history (the previous behaviour) the median lags half the
    run behind and every late point warns."""
    drift = [1.02 ** i for i in range(300)]
    windowed = JumpDetector(window=32)
    assert [i for i, v in enumerate(drift) if windowed.update("k", v) is not None] == []
    whole_run = JumpDetector(window=len(drift))
    warned = [i for i, v in enumerate(drift) if whole_run.update("k", v) is not None]
    assert len(warned) > 200 and warned[-1] == len(drift) - 1
    fast = JumpDetector(window=32)  # doubling within W/2 log points is a jump
    assert any(fast.update("k", 1.06 ** i) is not None for i in range(100))


def test_state_round_trip_continues_the_same_judgements(tmp_path):
    """state_dict -> JSON -> a new detector (and through torch.save/weights_only load): the continuation gives the
    same answers as the detector that never stopped; a smaller window keeps the newest points; bad data is named."""
    torch.manual_seed(0)
    series = {k: (1 + torch.rand(50, dtype=torch.float64)).tolist() for k in ("0/align_max", "1/outlier_ratio")}
    series["0/align_max"][45] = float("inf")  # judged, not kept
    before = JumpDetector(window=16)
    for i in range(40):
        for key, values in series.items():
            before.update(key, values[i])
    state = before.state_dict()
    assert all(isinstance(v, float) for values in state["history"].values() for v in values)
    after = JumpDetector(window=16)
    after.load_state_dict(json.loads(json.dumps(state, allow_nan=False)))
    torch.save({"s": state}, tmp_path / "s.pt")
    reloaded = JumpDetector(window=16)
    reloaded.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True)["s"])
    judged = []
    for i in range(40, 50):
        for key, values in series.items():
            values[i] *= 3 if i in (42, 48) else 1  # some jumps to judge
            expected = before.update(key, values[i])
            assert after.update(key, values[i]) == expected and reloaded.update(key, values[i]) == expected
            judged.append(expected)
    assert sum(j is not None for j in judged) == 5  # 2 series x 2 tripled points, and the inf
    narrow = JumpDetector(window=4)
    narrow.load_state_dict(state)
    assert list(narrow.history["1/outlier_ratio"]) == state["history"]["1/outlier_ratio"][-4:]
    for bad in ({"history": {"k": [1.0, float("nan")]}}, {"history": {"k": "1.0"}}, {"k": [1.0]}, [1.0]):
        with pytest.raises(ValueError, match="jump-detector state"):
            JumpDetector().load_state_dict(bad)


def test_hooks_state_belongs_to_the_watching_rank_and_to_watched_layers():
    torch.manual_seed(0)
    model = GPTModel(CFG)
    tokens = torch.randint(0, 128, (2, 32))
    hooks = SwiGLUHooks(model, CFG, diagnostics=True)
    for iteration in (1, 2, 3):
        hooks.before_step(iteration, 1)
        model(tokens)
        hooks.log_values(iteration, 1)
    state = hooks.state()
    assert sorted(state["history"]) == ["0/align_max", "0/outlier_ratio", "1/align_max", "1/outlier_ratio"]
    assert SwiGLUHooks(model, CFG, diagnostics=False).state() is None  # a rank (or run) without diagnostics
    one_stage = type("Stage", (), {"decoder": type("D", (), {"layers": model.decoder.layers[:1]})()})()
    resumed = SwiGLUHooks(one_stage, CFG, diagnostics=True)  # rank 0 of a 2-stage pipeline watches layer 0 only
    resumed.load_state(state, "ckpt")
    assert resumed.state() == {"history": {k: v for k, v in state["history"].items() if k.startswith("0/")}}
    fresh = SwiGLUHooks(model, CFG, diagnostics=True)
    fresh.load_state(None, "ckpt")  # an older checkpoint: empty history, no error
    assert fresh.state() == {"history": {}}
    with pytest.raises(CheckpointError, match=f"ckpt.*'{STATE_KEY}' entry is damaged"):
        fresh.load_state({"history": {"0/align_max": ["x"]}}, "ckpt")


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


@contextlib.contextmanager
def megatron_log():
    """The "megatron" logger's records (a handler of its own: the runs reconfigure the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("megatron")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def test_a_jump_right_after_a_resume_warns_at_the_first_log_point(tmp_path):
    """pretrain_gpt.py, 6 iterations saved, the checkpoint edited as the stability lab's injection does (one
    channel per layer: up row := c x gate row, |cos| = 1), resumed for one iteration: the first log point after the
    resume warns. Negative control: the same resume from a copy without the saved history does not."""
    import pretrain_gpt
    from megatron.stability.inject import inject_aligned_channels

    common = dict(log_interval=1, eval_iters=0, eval_interval=None)
    assert pretrain_gpt.main(tiny_argv(train_iters=6, save=tmp_path / "with", **common)) == 0
    payload_file = model_file(tmp_path / "with" / "iter_0000006")
    payload = torch.load(payload_file, weights_only=True)
    history = payload[STATE_KEY]["history"]
    # What is saved is what the logging rank judged with: 6 log points per series, the last one being the alignment
    # of the saved weights (measured after step 6, the step that was saved).
    assert {len(v) for v in history.values()} == {6}
    for layer in (0, 1):
        fc1 = payload["model"][f"decoder.layers.{layer}.mlp.linear_fc1.weight"]
        assert history[f"{layer}/align_max"][-1] == float(up_gate_alignment(fc1).max())
        # The premise: random rows are far from aligned, so an injected |cos| ~ 1 is more than twice the median.
        assert max(history[f"{layer}/align_max"]) < 0.5
    shutil.copytree(tmp_path / "with", tmp_path / "without")
    del payload[STATE_KEY]
    torch.save(payload, model_file(tmp_path / "without" / "iter_0000006"))
    for root in ("with", "without"):
        inject_aligned_channels(tmp_path / root, c=4.0, channels=1)
    runs = {}
    for root in ("with", "without"):
        with megatron_log() as records:
            assert pretrain_gpt.main(tiny_argv(train_iters=7, load=tmp_path / root, **common)) == 0
        runs[root] = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "jumped" in r.getMessage()]
    assert any(m.startswith("iteration 7: SwiGLU align_max of layer 0 jumped") for m in runs["with"]), runs["with"]
    assert any(m.startswith("iteration 7: SwiGLU align_max of layer 1 jumped") for m in runs["with"]), runs["with"]
    assert runs["without"] == []
