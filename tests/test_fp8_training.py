"""FP8 inside the training loop: a tiny GPT trains like BF16, resumes exactly, logs statistics."""
import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear
from megatron.training.loop import pretrain
from tests.conftest import tiny_argv

FP8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max")


def test_fp8_loss_tracks_bf16():
    bf16 = pretrain(parse_config(tiny_argv("--bf16", train_iters=40)))
    fp8 = pretrain(parse_config(tiny_argv("--bf16", *FP8, train_iters=40)))
    b, f = sum(bf16.losses[-5:]) / 5, sum(fp8.losses[-5:]) / 5
    assert f < bf16.losses[0] - 1.5  # FP8 learns...
    assert abs(f - b) / b < 0.05, (b, f)  # ...and stays within 5% of BF16 on this tiny run
    assert abs(fp8.valid[-1][1] - bf16.valid[-1][1]) / bf16.valid[-1][1] < 0.05


def test_only_block_linears_are_fp8():
    model = pretrain(parse_config(tiny_argv("--bf16", *FP8, train_iters=1, eval_iters=0, lr_warmup_iters=0))).model
    fp8_names = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(fp8_names) == 8  # 2 layers x (qkv, proj, fc1, fc2)
    assert type(model.output_layer) is nn.Linear
    assert type(model.embedding.word_embeddings) is nn.Embedding
    assert "Fp8Linear" in repr(model)


def test_fp8_exact_resume(tmp_path):
    common = dict(train_iters=8, eval_interval=4, hidden_dropout=0.1)
    straight = pretrain(parse_config(tiny_argv("--bf16", *FP8, **common)))
    pretrain(parse_config(tiny_argv("--bf16", *FP8, save=tmp_path / "c", exit_interval=4, **common)))
    resumed = pretrain(parse_config(tiny_argv("--bf16", *FP8, load=tmp_path / "c", **common)))
    assert straight.losses[4:] == resumed.losses
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_checkpoint_from_another_recipe_says_what_differs(tmp_path):
    pretrain(parse_config(tiny_argv("--bf16", *FP8, save=tmp_path / "c", train_iters=2, eval_iters=0,
                                    lr_warmup_iters=0)))
    other = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "8", "--fp8-amax-compute-algo", "max")
    with pytest.raises(ValueError, match="amax_history_len"):
        pretrain(parse_config(tiny_argv("--bf16", *other, load=tmp_path / "c", train_iters=3, eval_iters=0,
                                        lr_warmup_iters=0)))


def test_fp8_stats_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pretrain(parse_config(tiny_argv("--bf16", *FP8, "--log-fp8-stats", train_iters=5, eval_iters=0,
                                    tensorboard_dir=tmp_path / "tb")))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("fp8/")]
    assert any("decoder.layers.0.mlp.linear_fc1/input" in t for t in tags), tags[:5]


def test_bf16_checkpoint_loads_into_fp8_run(tmp_path):
    """Weights are plain nn.Linear keys, so a BF16 run can continue in FP8 (scales start fresh)."""
    pretrain(parse_config(tiny_argv("--bf16", save=tmp_path / "c", train_iters=2, eval_iters=0, lr_warmup_iters=0)))
    result = pretrain(parse_config(tiny_argv("--bf16", *FP8, load=tmp_path / "c", train_iters=4, eval_iters=0,
                                             lr_warmup_iters=0)))
    assert result.state.iteration == 4
