"""torch DDP (2 processes, gloo): DP=2 equals one process with twice the gradient accumulation."""
import socket
import subprocess
import sys

import pytest

from megatron.training import checkpointing as ckpt
from tests.conftest import REPO, tiny_argv
from tests.run_noise import assert_losses_within_noise, assert_weights_within_noise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(nproc: int, save_dir, micro_batch_size: int = 2) -> subprocess.CompletedProcess:
    argv = tiny_argv(micro_batch_size=micro_batch_size, global_batch_size=8, train_iters=4, eval_iters=1,
                     eval_interval=4, lr_warmup_iters=0, save=save_dir, log_interval=1)
    if nproc == 1:
        cmd = [sys.executable, "pretrain_gpt.py", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), "pretrain_gpt.py", *argv]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(log: str) -> list[float]:
    return [float(line.split("lm loss: ")[1].split(" ")[0]) for line in log.splitlines() if "lm loss: " in line]


# Bounded by the run's own rounding noise (tests/run_noise.py): the control is one process with micro-batches of 1
# and 8 accumulation steps, the same math as both runs in a third summation order.
@pytest.mark.isa_sensitive
def test_dp2_equals_single_process_with_double_accumulation(tmp_path):
    single = _run(1, tmp_path / "single")
    ddp = _run(2, tmp_path / "ddp")
    control = _run(1, tmp_path / "control", micro_batch_size=1)
    l1, l2 = _losses(single.stderr), _losses(ddp.stderr)
    assert len(l1) == len(l2) == 4
    assert_losses_within_noise(l2, l1, _losses(control.stderr))
    assert_weights_within_noise(*(ckpt.load_checkpoint_files(tmp_path / name)["payload"]["model"]
                                  for name in ("ddp", "single", "control")))
