"""torch DDP (2 processes, gloo): DP=2 equals one process with twice the gradient accumulation."""
import socket
import subprocess
import sys

import pytest
import torch

from megatron.training import checkpointing as ckpt
from tests.conftest import REPO, tiny_argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(nproc: int, save_dir, extra=()) -> subprocess.CompletedProcess:
    argv = tiny_argv(*extra, micro_batch_size=2, global_batch_size=8, train_iters=4, eval_iters=1,
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


@pytest.mark.isa_sensitive
def test_dp2_equals_single_process_with_double_accumulation(tmp_path):
    single = _run(1, tmp_path / "single")
    ddp = _run(2, tmp_path / "ddp")
    l1, l2 = _losses(single.stderr), _losses(ddp.stderr)
    assert len(l1) == len(l2) == 4
    for a, b in zip(l1, l2):
        assert abs(a - b) / a < 1e-4, (l1, l2)
    w1 = ckpt.load_checkpoint_files(tmp_path / "single")["payload"]["model"]
    w2 = ckpt.load_checkpoint_files(tmp_path / "ddp")["payload"]["model"]
    for key in w1:
        # Adam divides by sqrt(v): gradients equal to fp32 rounding can still move a weight by ~1e-5.
        assert torch.allclose(w1[key], w2[key], rtol=1e-3, atol=5e-5), (key, (w1[key] - w2[key]).abs().max())
