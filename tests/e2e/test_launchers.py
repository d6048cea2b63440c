"""The same DeepSpeed run started by torchrun, by the deepspeed launcher, and by it with a hostfile: same losses.

All on CPU with gloo, 2 processes on this machine, each run on its own free port. The deepspeed
launcher counts one CPU "accelerator" per NUMA node, so `--num_gpus 2` (alias `--num_accelerators`)
or a hostfile's `slots=2` sets the number of processes; it passes `--local_rank=N`, which our
parser accepts when it agrees with LOCAL_RANK.
"""
from pathlib import Path
import subprocess

import pytest

from tests.support.config import REPO, tiny_argv
from tests.support.launch import BASE, deepspeed_command, free_port, run_checked
from tests.support.logs import printed_losses

pytest.importorskip("deepspeed")

# The run of the session fixture `deepspeed_zero1` (tests/conftest.py), which torchrun starts.
ARGV = tiny_argv("--deepspeed", "--zero-stage", "1", **BASE)


def _printed_losses(log: str) -> list[str]:
    found = printed_losses(log)
    assert len(found) == BASE["train_iters"], log[-2000:]
    return found


def _losses(cmd: list[str]) -> list[str]:
    out = run_checked(cmd, stdout_tail=3000, stderr_tail=3000)
    # Logged lines reach stderr with torchrun and stdout with the deepspeed launcher (it pipes both).
    return _printed_losses(out.stdout + out.stderr)


@pytest.fixture(scope="module")
def torchrun_losses(deepspeed_zero1) -> list[str]:
    log, _ = deepspeed_zero1  # torchrun, 2 processes, ARGV plus --save (which does not change the losses)
    return _printed_losses(log)


def _leftover_segments(port: int) -> list[str]:
    """DeepSpeed's CPU shared-memory all-reduce segments of the run on `port` still in /dev/shm."""
    shm = Path("/dev/shm")
    return sorted(p.name for p in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*")) if shm.is_dir() else []


def test_deepspeed_launcher_equals_torchrun(torchrun_losses):
    """Also: the launcher's runs use DeepSpeed's shared-memory all-reduce on CPU (LOCAL_SIZE = WORLD_SIZE), whose
    /dev/shm segments DeepSpeed never unlinks; ours are unlinked once mapped (megatron/training/deepspeed_shm.py),
    so the run leaves none behind."""
    port = free_port()
    out = subprocess.run(deepspeed_command(["--num_gpus", "2"], "pretrain_gpt.py", *ARGV, port=port), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _printed_losses(out.stdout + out.stderr) == torchrun_losses  # the printed values, digit for digit
    assert "shared-memory all-reduce segments unlinked" in out.stdout + out.stderr
    assert _leftover_segments(port) == []


def test_deepspeed_launcher_with_a_hostfile_equals_torchrun(torchrun_losses, tmp_path):
    # One node: --no_ssh runs the processes of --node_rank 0 locally (on a cluster, run the same
    # command on every node with its own --node_rank, or drop --no_ssh and let the launcher use ssh).
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    launched = _losses(deepspeed_command(["--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0", "--master_addr",
                                          "127.0.0.1"], "pretrain_gpt.py", *ARGV))
    assert launched == torchrun_losses
