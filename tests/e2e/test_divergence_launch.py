"""The divergence guard end to end: `pretrain_gpt.py` runs that explode without a NaN stop before saving."""
import subprocess

import torch

from megatron.checkpoint import store as ckpt
from tests.support.config import tiny_argv
from tests.support.launch import pretrain_cli

RUN = dict(log_interval=1, eval_iters=0, lr_warmup_iters=0)


def _cli(*switches: str, **overrides) -> subprocess.CompletedProcess:
    return pretrain_cli(*tiny_argv(*switches, **{**RUN, **overrides}))


def test_an_exploding_run_stops_with_code_3_before_saving_and_names_the_healthy_checkpoint(tmp_path):
    """--lr 1e6: every number stays finite while the weights explode. Without the guard this run wrote the destroyed
    model as its newest checkpoint."""
    save = tmp_path / "ckpt"
    assert _cli(train_iters=4, save=save, save_interval=2).returncode == 0
    healthy = ckpt.load_checkpoint_files(save)["payload"]["model"]
    out = _cli(train_iters=12, save=save, load=save, save_interval=2, lr=1e6, min_lr=0)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "weights exploded" in out.stderr and f"healthy checkpoint is {save / 'iter_0000004'}" in out.stderr
    assert ckpt.read_tracker(save) == 4 and sorted(p.name for p in save.glob("iter_*"))[-1] == "iter_0000004"
    after = ckpt.load_checkpoint_files(save)["payload"]["model"]
    assert all(torch.equal(healthy[k], after[k]) for k in healthy)
    unguarded = _cli("--no-divergence-guard", train_iters=6, save=tmp_path / "off", save_interval=2, lr=1e6, min_lr=0)
    assert unguarded.returncode == 0  # the negative control: the flag really turns it off


def test_an_absurd_init_stops_before_the_first_step():
    out = _cli(train_iters=5, init_method_std=1e6)
    assert out.returncode == 3 and "at initialization" in out.stderr and "--init-method-std" in out.stderr
