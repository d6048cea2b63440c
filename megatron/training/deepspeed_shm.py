"""DeepSpeed's shared-memory all-reduce buffers on CPU: unlinked once every rank has mapped them.

On the CPU accelerator, when every rank runs on one machine (the DeepSpeed launcher sets LOCAL_SIZE = WORLD_SIZE),
DeepSpeed's communication backend creates one POSIX shared-memory segment per rank for its low-latency
all-reduce, `/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>` (66 MB each with
DeepSpeed 0.19), and never unlinks them: without this module every such run leaves them behind in RAM-backed
/dev/shm (106 runs' segments hold 7.0 GiB).

The segment names are only needed while the ranks open each other's segments, which DeepSpeed does inside its
backend's construction (each rank waits there until it has mapped every peer's segment). So once every rank is
past that point (a barrier), each rank unlinks its own name: the mappings stay valid until the processes exit,
and the memory is returned then, also after a crash. On GPUs (NCCL) and Gaudi (HCCL) nothing is created and
this does nothing.
"""
from __future__ import annotations

import logging
import os

import torch.distributed as dist

from megatron import comm

logger = logging.getLogger("megatron")

_SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
_released = False


def shm_segment_path(rank: int) -> str:
    """The segment DeepSpeed's CPU backend creates for `rank` (its naming, from MASTER_ADDR and MASTER_PORT)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"/dev/shm/{_SEGMENT_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def _backend_uses_shm() -> bool:
    """The same answer on every rank: DeepSpeed's condition (CPU accelerator, all ranks on this machine)."""
    from deepspeed.accelerator import get_accelerator

    local = os.environ.get("LOCAL_SIZE", "")
    return get_accelerator().device_name() == "cpu" and local.isdigit() and int(local) == dist.get_world_size()


def release_deepspeed_shm() -> bool:
    """After DeepSpeed's communication backend is up (`deepspeed.init_distributed` or `deepspeed.initialize`), on
    every rank: a barrier, then unlink this rank's segment. Once per process; True when it unlinked a segment."""
    global _released
    if _released or not dist.is_initialized() or not _backend_uses_shm():
        return False
    comm.barrier(comm.world_group())  # every rank has mapped every segment: the names are no longer needed
    _released = True
    try:
        os.unlink(shm_segment_path(dist.get_rank()))
    except FileNotFoundError:
        return False
    logger.info("> DeepSpeed's CPU shared-memory all-reduce segments unlinked from /dev/shm once mapped by every "
                "rank (their memory is returned when the ranks exit)")
    return True
