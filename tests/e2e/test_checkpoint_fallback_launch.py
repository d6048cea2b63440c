"""A damaged newest checkpoint of a 2-rank DeepSpeed ZeRO-1 run, resumed with real processes: the rank whose share of
the CRC-32 reading holds the flipped file finds it, both ranks fall back to the checkpoint before it, and the run
ends with the weights and optimizer partitions of the run that never met the damage, bitwise."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.checkpoint import manifest
from megatron.checkpoint import store as ckpt
from tests.support.config import tiny_argv
from tests.support.launch import launch_checked

pytest.importorskip("deepspeed")

RUN = dict(save_interval=2, micro_batch_size=2, global_batch_size=8, eval_iters=0, eval_interval=1000, log_interval=1)
PARTITION = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _states(folder) -> dict:
    return {p.name: torch.load(p, map_location="cpu", weights_only=False) for p in sorted(folder.glob("*.pt"))}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return True  # DeepSpeed's bookkeeping objects (paths, versions): not training state


def test_a_bit_flip_in_the_newest_checkpoint_falls_back_on_every_rank_and_ends_bitwise(tmp_path):
    run = tmp_path / "run"
    argv = ("--deepspeed", "--zero-stage", "1")
    launch_checked(2, tiny_argv(*argv, save=run, train_iters=6, **RUN), stdout_tail=0, stderr_tail=3000)
    newest = ckpt.iteration_dir(run, 6)
    files = json.loads((newest / manifest.MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in newest.iterdir() if p.name != manifest.MANIFEST_FILE)
    # by sorted name, the partition of DP rank 0 is the second file of rank 1's share of the CRC-32 reading
    assert sorted(files)[1::2][1] == PARTITION
    want = _states(newest)
    (run / ckpt.TRACKER_FILE).write_text("4")  # as if the run had died after iteration 4's save ...
    damaged = ckpt.iteration_dir(run, 4) / PARTITION
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # ... and the disk flipped one bit of its newest checkpoint
    damaged.write_bytes(bytes(data))
    out = launch_checked(2, tiny_argv(*argv, save=run, load=run, train_iters=6, **RUN), stdout_tail=0,
                         stderr_tail=3000)
    log = out.stdout + out.stderr
    assert f"checkpoint of iteration 4 under {run} is damaged: {damaged} fails its checksum" in log, log[-3000:]
    assert "resuming from iteration 2, the newest checkpoint" in log and "at iteration 2" in log, log[-3000:]
    got = _states(ckpt.iteration_dir(run, 6))
    assert got.keys() == want.keys()
    assert all(_same(got[name], want[name]) for name in want), "the resumed run's iteration 6 differs"
