"""Launching `pretrain_gpt.py` from tests: one process, or several under torchrun on free ports (gloo on CPU).

BASE is the tiny run most multi-process tests compare (4 iterations of 8 samples as 2 micro-batches of 2 per rank
at DP = 2, or 4 in one process; validation at the end). The torch engine's one-process BASE run and its noise
control are session fixtures (tests/conftest.py: `torch_reference`, `torch_control`), so every module that compares
against them (torch DDP, DeepSpeed ZeRO 0-3) launches them once per session.
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys

from tests.conftest import REPO, tiny_argv

BASE = dict(micro_batch_size=2, global_batch_size=8, train_iters=4, eval_iters=1, eval_interval=4, lr_warmup_iters=0,
            log_interval=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(nproc: int, *switches, script: str = "pretrain_gpt.py", **overrides) -> str:
    """`script` on BASE with `overrides` (underscores: train_iters=8; None drops a flag); its stderr (the log)."""
    argv = tiny_argv(*switches, **{**BASE, **overrides})
    if nproc == 1:
        cmd = [sys.executable, script, *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), script, *argv]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stderr


def losses(log: str) -> list[float]:
    """The training losses of a log, in order."""
    return [float(m) for m in re.findall(r"\| lm loss: (\S+) \|", log)]
