"""Process groups of a run, built once at initialization and passed down explicitly.

Today: data parallelism over all ranks (torch.distributed, DDP). Tensor and pipeline parallel
groups are added here by the distributed work; model code never reads process-group globals.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron.accelerator import Accelerator
from megatron.config import ParallelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    world_size: int = 1
    rank: int = 0
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_group: Optional[object] = None
    # Every rank that holds a piece or a replica of the same FP8 tensors: the amax reduction group.
    amax_group: Optional[object] = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize_parallel_state(cfg: ParallelConfig, accelerator: Accelerator) -> ParallelState:
    """Join the process group started by torchrun/the deepspeed launcher, if any, and build groups."""
    world = world_size_from_env()
    if world == 1 and not dist.is_initialized():
        return ParallelState()
    if cfg.tensor_model_parallel_size != 1 or cfg.pipeline_model_parallel_size != 1:
        raise ValueError("--tensor-model-parallel-size / --pipeline-model-parallel-size > 1 are not supported yet")
    if not dist.is_initialized():
        backend = cfg.distributed_backend or accelerator.distributed_backend
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    logger.info("initialized torch.distributed: rank %d of %d", rank, world)
    return ParallelState(world_size=world, rank=rank, data_parallel_size=world, data_parallel_rank=rank,
                         data_parallel_group=group, amax_group=group)
