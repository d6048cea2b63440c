"""Optimizer factory: Megatron's parameter groups, AdamW or Fp8AdamW driven by flags, inside the loop."""
import logging

import torch

from megatron.arguments import parse_config
from megatron.model import GPTModel
from megatron.optimizer import build_optimizer
from megatron.optimizer.fp8_adam import Fp8AdamW
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.training import assert_resume_is_exact


def test_no_weight_decay_on_norms_and_biases():
    cfg = parse_config(tiny_argv(weight_decay=0.1))
    model = GPTModel(cfg.model)
    opt = build_optimizer(model, cfg.optimizer)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 2 * 2 + 1  # two norms per layer + final norm
    # CPU parameters: foreach (the fused kernel is chosen for CUDA parameters: tests/unit/test_gpu.py)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_fp8adam_from_flags_logs_its_rule(caplog):
    cfg = parse_config(tiny_argv("--fp8-optimizer", fp8_optimizer_block_size=128))
    with caplog.at_level(logging.INFO):
        opt = build_optimizer(GPTModel(cfg.model), cfg.optimizer)
    assert isinstance(opt, Fp8AdamW)
    assert "m=e4m3/block128 v=e5m2/block128" in caplog.text and "FP32 states for 5 tensors" in caplog.text


def test_fp8adam_trains_like_adamw_and_stores_one_byte_moments():
    adam = pretrain(parse_config(tiny_argv("--bf16", train_iters=40, eval_iters=0, adam_beta2=0.95)))
    fp8 = pretrain(parse_config(tiny_argv("--bf16", "--fp8-optimizer", train_iters=40, eval_iters=0, adam_beta2=0.95)))
    a, f = sum(adam.losses[-5:]) / 5, sum(fp8.losses[-5:]) / 5
    assert abs(f - a) / a < 0.05, (a, f)
    assert f < fp8.losses[0] - 1.5


def test_fp8adam_exact_resume(tmp_path):
    assert_resume_is_exact(tmp_path, ("--fp8-optimizer",), 4, train_iters=8, eval_iters=0)
