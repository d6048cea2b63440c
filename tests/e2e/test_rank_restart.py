"""A rank killed mid-run under `torchrun --max-restarts`: the restarted attempt forms its process group (each attempt's
keys under their own prefix in torchrun's store), resumes from the newest checkpoint on its own (`--load` = `--save`)
and ends with the weights, optimizer state and FP8 scaling state of a run that never failed, bitwise, for each engine
and layout. The surviving rank of the first attempt leaves with one line naming the rank that died, whether its
collective failed first or torchrun's SIGTERM reached it first."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.config import REPO, tiny_argv
from tests.support.launch import launch_checked, torchrun_command
from tests.support.training import bitwise_differences, checkpoint_tensors

RUN = dict(save_interval=2, train_iters=6, micro_batch_size=2, global_batch_size=8, eval_iters=0, eval_interval=1000,
           log_interval=1)
# FP8 layers and FP8 moments; the optimizer eager (its bitwise equality holds either way; compiling it takes 20 s)
FP8 = ("--fp8-format", "hybrid", "--optimizer", "fp8adam", "--no-fp8-optimizer-compile")
slow = pytest.mark.slow
LAYOUTS = {
    "torch-dp2": (),
    "zero1": ("--deepspeed", "--zero-stage", "1"),
    "zero3": pytest.param(("--deepspeed", "--zero-stage", "3"), marks=slow),
    "tp2": pytest.param(("--tensor-model-parallel-size", "2"), marks=slow),
    "pipeline": pytest.param(("--deepspeed", "--zero-stage", "1", "--pipeline-model-parallel-size", "2"), marks=slow),
    "fsdp2-torch-dist": pytest.param(("--use-torch-fsdp2", "--ckpt-format", "torch_dist"), marks=slow),
    "fsdp2-async-save": pytest.param(("--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--async-save"), marks=slow),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_it_never_failed(tmp_path, layout):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    argv = tiny_argv(*FP8, *layout, **RUN)
    # rank 1 is killed (SIGKILL) as iteration 3 starts, one iteration after the checkpoint of iteration 2
    cmd = torchrun_command(2, "--max-restarts", "1", "tests/support/kill_rank.py", "1", "3", "--",
                           *argv, "--save", str(killed), "--load", str(killed))
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "loaded checkpoint" in log and "at iteration 2" in log, log[-4000:]
    # the survivor of the first attempt left with one line naming rank 1, not gloo's traceback: its failed collective's
    # line, or the SIGTERM line when torchrun's SIGTERM came first (megatron/sigterm.py)
    lines = [ln for ln in log.splitlines() if ln.startswith("[rank 0] error: ")]
    assert len(lines) == 1 and ("another rank died or stopped answering: rank 1 stopped answering (no heartbeat for "
                                "2 s)" in lines[0] or "stopped by SIGTERM" in lines[0]
                                and ": rank 1 stopped answering (no heartbeat for 2 s);" in lines[0]), log[-4000:]
    assert "[rank0]: Traceback" not in log, log[-4000:]
    launch_checked(2, [*argv, "--save", str(clean), "--load", str(clean)], stdout_tail=0, stderr_tail=3000)
    different = bitwise_differences(checkpoint_tensors(killed, RUN["train_iters"]),
                                    checkpoint_tensors(clean, RUN["train_iters"]))
    assert not different, different[:10]
