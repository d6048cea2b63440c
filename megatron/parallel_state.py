"""Process groups of a run, built once at initialization and passed down explicitly.

Ranks are laid out as Megatron does. Without pipeline parallelism: the
`tp` consecutive ranks [i*tp, ..., i*tp + tp - 1] form tensor-parallel group i (they hold the shards
of one model replica, so they should share a node), and the ranks with the same TP rank form a
data-parallel group (they hold the same shard: DDP all-reduces gradients there). The FP8 amax group
is every rank holding a piece or a replica of the same logical tensors: with PP = 1, the whole
TP x DP world. With pipeline parallelism (DeepSpeed, TP = 1) see `_pipeline_parallel_state`. Model code
never reads process-group globals: these objects are passed down.

`host_group` spans every rank on gloo: host-side flags (the loop's exit checks) are reduced there as CPU
tensors, without a device synchronisation (a CPU tensor may not go through an NCCL/HCCL group at all).
With MEGATRON_FORCE_COLLECTIVES=1 a single process still joins a one-rank process group, so that every
collective of the run goes through the backend (see `megatron/comm.py`).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron import comm
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
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    tensor_parallel_group: Optional[object] = None  # None when tensor_parallel_size == 1
    # Every rank that holds a piece or a replica of the same FP8 tensors: the amax reduction group.
    amax_group: Optional[object] = None
    pipeline_parallel_size: int = 1
    pipeline_parallel_rank: int = 0  # the stage
    # Every rank, on gloo: CPU flags are reduced here without touching the accelerator.
    host_group: Optional[object] = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def _destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def finish_distributed_run(exit_code: int) -> None:
    """End a multi-process run without interpreter finalization; never returns.

    `destroy_process_group` unregisters the groups, but the gloo/DeepSpeed objects still referenced from
    Python (DeepSpeed's module globals, our modules) keep their worker threads alive until interpreter
    finalization frees them in arbitrary order. A C++ thread that needs the GIL then is ended by Python
    (pthread_exit), which aborts the process ("terminate called without an active exception", SIGABRT,
    exit -6) after a run that had finished fine; we saw it rarely on CPU CI. So a finished distributed run
    waits for every rank at a barrier, tears the groups down, flushes its logs and leaves with
    `os._exit`. Checkpoints and TensorBoard files are already closed and synced when this is called.
    """
    import logging as _logging
    import sys

    if dist.is_initialized():
        try:
            if exit_code == 0:
                comm.barrier(comm.world_group())  # no rank tears down while another still communicates
            dist.destroy_process_group()
        except Exception as exc:  # a failing peer must not turn a clean exit into a hang or a new error
            logger.warning("process-group teardown: %s", exc)
    _logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize_parallel_state(cfg: ParallelConfig, accelerator: Accelerator) -> ParallelState:
    """Join the process group started by torchrun/the deepspeed launcher, if any, and build groups."""
    world = world_size_from_env()
    if world == 1 and not dist.is_initialized() and not comm.collectives_forced():
        return ParallelState()
    if not dist.is_initialized():
        backend = cfg.distributed_backend or accelerator.distributed_backend
        timeout = datetime.timedelta(minutes=10)
        if world == 1:  # forced collectives: a one-rank group; a HashStore needs no address or port
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
        # Tear the groups down before the interpreter does: gloo's threads otherwise may be destroyed while
        # still joinable at exit ("terminate called without an active exception", SIGABRT).
        atexit.register(_destroy_process_groups)
    rank, world = dist.get_rank(), dist.get_world_size()
    host_group = _host_group(world)
    if cfg.pipeline_model_parallel_size > 1:
        return _pipeline_parallel_state(rank, world, cfg.pipeline_model_parallel_size, host_group)
    tp = cfg.tensor_model_parallel_size
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by --tensor-model-parallel-size {tp}")
    dp = world // tp
    # Every rank must create every group, in the same order (torch.distributed's rule for new_group).
    world_group = dist.new_group(list(range(world)))
    tp_group = dp_group = None
    for i in range(dp):
        ranks = list(range(i * tp, (i + 1) * tp))
        group = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            tp_group = group
    for j in range(tp):
        ranks = list(range(j, world, tp))
        group = dist.new_group(ranks) if tp > 1 else world_group
        if rank in ranks:
            dp_group = group
    logger.info("initialized torch.distributed: rank %d of %d (tensor parallel %d x data parallel %d)",
                rank, world, tp, dp)
    return ParallelState(world_size=world, rank=rank, data_parallel_size=dp, data_parallel_rank=rank // tp,
                         data_parallel_group=dp_group, tensor_parallel_size=tp, tensor_parallel_rank=rank % tp,
                         tensor_parallel_group=tp_group, amax_group=world_group, host_group=host_group)


def _host_group(world: int) -> object:
    """The default group when it is gloo already, else a gloo group over every rank (created by all ranks)."""
    if "gloo" in str(dist.get_backend()).split(","):
        return dist.group.WORLD
    return dist.new_group(list(range(world)), backend="gloo")


def _pipeline_parallel_state(rank: int, world: int, pp: int, host_group: object) -> ParallelState:
    """PP stages x DP replicas (TP = 1), laid out as DeepSpeed's PipeModelDataParallelTopology(pp, 1, dp):
    rank = stage * dp + replica. The ranks of one stage hold the same layers: they form its data-parallel
    group and its FP8 amax group (other stages hold other tensors)."""
    if world % pp:
        raise ValueError(f"world size {world} is not divisible by --pipeline-model-parallel-size {pp}")
    dp = world // pp
    stage_group = None
    for stage in range(pp):  # every rank creates every group, in the same order
        ranks = list(range(stage * dp, (stage + 1) * dp))
        group = dist.new_group(ranks)
        if rank in ranks:
            stage_group = group
    logger.info("initialized torch.distributed: rank %d of %d (pipeline stage %d of %d x data parallel %d)",
                rank, world, rank // dp, pp, dp)
    return ParallelState(world_size=world, rank=rank, data_parallel_size=dp, data_parallel_rank=rank % dp,
                         data_parallel_group=stage_group, amax_group=stage_group,
                         pipeline_parallel_size=pp, pipeline_parallel_rank=rank // dp, host_group=host_group)
