"""Processes that tests start themselves: torch.multiprocessing workers joining a gloo group over TCP, and a PID
that no process holds any more."""
from __future__ import annotations

import subprocess


def init_gloo(rank: int, port: int, world_size: int) -> None:
    """In a worker of `torch.multiprocessing.spawn`: join the gloo process group of `world_size` ranks on
    127.0.0.1:`port` (a `tests.support.launch.free_port` picked by the parent)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
