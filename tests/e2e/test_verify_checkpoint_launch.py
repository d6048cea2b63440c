"""`--verify-checkpoint` under DeepSpeed, where DeepSpeed writes the files: every rank reads back each file it wrote
(model states, its ZeRO partition) and the ranks agree before rank 0 commits. A rank whose file does not hold what
DeepSpeed handed to torch.save stops every rank, and nothing is committed."""
from __future__ import annotations

import pytest

from megatron.checkpoint import store as ckpt
from tests.support.config import REPO, tiny_argv
from tests.support.launch import launch, launch_checked

pytest.importorskip("deepspeed")

FROZEN = dict(train_iters=2, save_interval=2, eval_iters=0, micro_batch_size=2, global_batch_size=8)
# Rank 1 writes its ZeRO partition with one value changed: what a bad disk or a broken serializer would leave.
CORRUPT = r'''
import os, runpy, sys, torch
real = torch.save
def save(obj, f, *args, **kwargs):
    if os.environ.get("RANK") == "1" and str(getattr(f, "path", f)).endswith("optim_states.pt"):  # a ChecksumFile
        state = obj["optimizer_state_dict"]
        key = next(k for k in ("single_partition_of_fp32_groups", "fp32_flat_groups") if k in state)
        groups = list(state[key])
        groups[0] = groups[0].clone()
        groups[0].view(-1)[0] += 1
        obj = dict(obj, optimizer_state_dict=dict(state, **{key: groups}))
    return real(obj, f, *args, **kwargs)
torch.save = save
sys.argv = [%r] + sys.argv[1:]
runpy.run_path(%r, run_name="__main__")
''' % (str(REPO / "pretrain_gpt.py"), str(REPO / "pretrain_gpt.py"))


@pytest.mark.parametrize("switches", [("--zero-stage", "1"), ("--zero-stage", "3"),
                                      ("--zero-stage", "1", "--pipeline-model-parallel-size", "2")],
                         ids=["ZeRO-1", "ZeRO-3", "pipeline"])
def test_deepspeed_checkpoints_are_verified_and_committed(tmp_path, switches):
    argv = tiny_argv("--deepspeed", *switches, "--verify-checkpoint", save=tmp_path, **FROZEN)
    launch_checked(2, argv, stdout_tail=0, stderr_tail=3000)
    assert ckpt.read_tracker(tmp_path) == 2


def test_a_partition_that_differs_stops_every_rank_and_commits_nothing(tmp_path):
    script = tmp_path / "corrupt.py"
    script.write_text(CORRUPT)
    argv = tiny_argv("--deepspeed", "--zero-stage", "1", "--verify-checkpoint", save=tmp_path / "run", **FROZEN)
    out = launch(2, argv, str(script))
    assert out.returncode != 0
    assert "optim_states.pt does not hold what was written" in out.stderr, out.stderr[-3000:]
    assert "another rank's files" in out.stderr, out.stderr[-3000:]
    assert ckpt.read_tracker(tmp_path / "run") is None and not list((tmp_path / "run").glob("*iter_*"))


def test_tensor_parallel_shards_are_verified_and_committed(tmp_path):
    """The torch engine at TP=2: each rank verifies its own shard before the shared commit."""
    argv = tiny_argv("--tensor-model-parallel-size", "2", "--verify-checkpoint", save=tmp_path, **FROZEN)
    launch_checked(2, argv, stdout_tail=0, stderr_tail=3000)
    assert ckpt.read_tracker(tmp_path) == 2 and ckpt.model_file(ckpt.iteration_dir(tmp_path, 2), 1).exists()
