"""A rank killed mid-run under `torchrun --max-restarts`: the restarted attempt forms its process group (each attempt's
keys under their own prefix in torchrun's store), resumes from the newest checkpoint on its own (`--load` = `--save`)
and ends with the weights of a run that never failed, bitwise."""
from __future__ import annotations

import os
import subprocess

import torch

from tests.support.config import REPO, tiny_argv
from tests.support.launch import launch_checked, torchrun_command

RUN = dict(save_interval=2, train_iters=6, micro_batch_size=2, global_batch_size=8, eval_iters=0, eval_interval=1000,
           log_interval=1)


def _weights(folder) -> dict:
    from megatron.checkpoint.layouts import read_checkpoint, resolve_checkpoint_dir

    payload, _, train_state = read_checkpoint(resolve_checkpoint_dir(folder))
    assert train_state["iteration"] == RUN["train_iters"]
    return payload["model"]


def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_it_never_failed(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    # rank 1 is killed (SIGKILL) as iteration 3 starts, one iteration after the checkpoint of iteration 2
    cmd = torchrun_command(2, "--max-restarts", "1", "tests/support/kill_rank.py", "1", "3", "--",
                           *tiny_argv(save=killed, load=killed, **RUN))
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "loaded checkpoint" in log and "at iteration 2" in log, log[-4000:]
    # the survivor of the first attempt left with one line, not gloo's traceback
    assert ("[rank 0] error: a collective failed because another rank died or stopped answering: rank 1 stopped "
            "answering (no heartbeat for 2 s)") in log, log[-4000:]
    assert "[rank0]: Traceback" not in log, log[-4000:]
    launch_checked(2, tiny_argv(save=clean, load=clean, **RUN))
    got, want = _weights(killed), _weights(clean)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
