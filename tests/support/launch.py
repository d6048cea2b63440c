"""Starting processes from tests: free ports, torchrun and deepspeed-launcher commands, `pretrain_gpt.py` runs.

Runs of our scripts (`launch`, `launch_checked`, `run`, `pretrain_cli`) are forked from the session's preloaded
interpreter (tests/support/forkserver.py): the processes torchrun would start, without paying the interpreter's
start and imports per process. Tests of the launchers themselves build real commands (`torchrun_command`,
`deepspeed_command`, `pretrain_command`) and run them with `run_checked`.

BASE is the tiny run most multi-process tests compare (4 iterations of 8 samples as 2 micro-batches of 2 per rank
at DP = 2, or 4 in one process; validation at the end). The torch engine's one-process BASE run and its noise
control are session fixtures (tests/conftest.py: `torch_reference`, `torch_control`), so every module that compares
against them (torch DDP, DeepSpeed ZeRO 0-3) launches them once per session.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

from bench.common import free_port
from tests.support.config import REPO, tiny_argv

BASE = dict(micro_batch_size=2, global_batch_size=8, train_iters=4, eval_iters=1, eval_interval=4, lr_warmup_iters=0,
            log_interval=1)


def torchrun_command(nproc: int, *target: str, port: int | None = None) -> list[str]:
    """torchrun with `nproc` processes on this machine (on `port`, else a free one), running `target`: a script
    and its arguments, or `-m`, a module and its arguments."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port() if port is None else port), *target]


def deepspeed_command(options: Sequence[str], *target: str, port: int | None = None) -> list[str]:
    """The deepspeed launcher with its `options` (`--num_gpus 2`, `--hostfile F --no_ssh ...`), on `port` (else a
    free one), running `target`: a script and its arguments."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", *options, "--master_port",
            str(free_port() if port is None else port), *target]


def pretrain_command(nproc: int, argv: Sequence[str], script: str = "pretrain_gpt.py", *,
                     port: int | None = None) -> list[str]:
    """`script` with `argv` ("-m NAME": the module NAME): in this interpreter for one process, under torchrun for
    several (on `port`, else a free one)."""
    target = script.split(" ", 1) if script.startswith("-m ") else [script]
    if nproc == 1:
        return [sys.executable, *target, *argv]
    return torchrun_command(nproc, *target, *argv, port=port)


def _tail(text: str, chars: int) -> str:
    return text[-chars:] if chars else ""


def _assert_exit_0(out: subprocess.CompletedProcess, stdout_tail: int, stderr_tail: int) -> None:
    assert out.returncode == 0, _tail(out.stdout, stdout_tail) + _tail(out.stderr, stderr_tail)


def run_checked(cmd: Sequence[str], *, env: dict | None = None, timeout: float = 300, stdout_tail: int = 2000,
                stderr_tail: int = 4000) -> subprocess.CompletedProcess:
    """`cmd` in the repository folder, output captured as text; asserts exit code 0, the message being the last
    `stdout_tail` characters of stdout and `stderr_tail` of stderr (0: none of that stream)."""
    out = subprocess.run(list(cmd), cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    _assert_exit_0(out, stdout_tail, stderr_tail)
    return out


def launch(nproc: int, argv: Sequence[str], script: str = "pretrain_gpt.py", *, env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """`script argv` in `nproc` processes (one gloo world on a free port when nproc > 1), environment `env` (this
    process's unless given), forked from the session's preloaded interpreter; exit code unchecked."""
    from tests.support import forkserver

    return forkserver.launch(nproc, script, list(argv), port=free_port(), env=env, timeout=timeout)


def launch_checked(nproc: int, argv: Sequence[str], script: str = "pretrain_gpt.py", *, env: dict | None = None,
                   timeout: float = 300, stdout_tail: int = 2000, stderr_tail: int = 4000
                   ) -> subprocess.CompletedProcess:
    """`launch`, asserting exit code 0 (the message as in `run_checked`)."""
    out = launch(nproc, argv, script, env=env, timeout=timeout)
    _assert_exit_0(out, stdout_tail, stderr_tail)
    return out


def run(nproc: int, *switches, script: str = "pretrain_gpt.py", base: dict = BASE, **overrides) -> str:
    """`script` on `base` (BASE unless given) with `overrides` (underscores: train_iters=8; None drops a flag),
    in `nproc` processes; its stderr (the log)."""
    argv = tiny_argv(*switches, **{**base, **overrides})
    return launch_checked(nproc, argv, script).stderr


def base_run_weights(save) -> dict:
    """The full model's weights (through the one checkpoint reader) of a BASE run's newest checkpoint, which must be
    its last iteration."""
    from megatron.checkpoint.layouts import read_checkpoint, resolve_checkpoint_dir

    payload, _, train_state = read_checkpoint(resolve_checkpoint_dir(save))
    assert train_state["iteration"] == BASE["train_iters"]
    return {key: value.detach() for key, value in payload["model"].items()}


def pretrain_cli(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`pretrain_gpt.py argv` in one process, exit code unchecked; `env` adds to this process's environment."""
    return launch(1, argv, env={**os.environ, **(env or {})}, timeout=timeout)
