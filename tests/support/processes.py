"""Processes that tests start themselves: torch.multiprocessing workers joining a gloo group over TCP, and a PID
that no process holds any more."""
from __future__ import annotations

import contextlib
import subprocess
from typing import Any, Iterator


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


@contextlib.contextmanager
def one_rank_world() -> Iterator[Any]:
    """A one-process gloo world (a HashStore: no address or port), torn down after the block. An in-process DeepSpeed
    run keeps its one-rank world for the rest of the test process (DeepSpeed holds on to it); within such a
    process that world is used as it is and left in place."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1, "a multi-rank process group is left over from an earlier test"
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
