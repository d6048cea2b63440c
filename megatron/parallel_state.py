"""Process groups of a run, built once at initialization and passed down explicitly.

Ranks are laid out as DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp=tp, num_dp)` orders them
(axes pipe, data, model; the model axis fastest):

    rank = (stage * dp + replica) * tp + tp_rank

so the `tp` ranks of one model replica's stage are consecutive (they exchange activations every layer
and should share a node), and without pipeline parallelism this is Megatron's layout: tensor-parallel
group i is ranks [i*tp, ..., i*tp + tp - 1]. The ranks with the same stage and TP rank form a
data-parallel group (they hold the same shard: DDP or ZeRO reduce gradients there, and ZeRO partitions
the optimizer there). The FP8 amax group is every rank holding a piece or a replica of the same
logical tensors: with PP = 1 the whole TP x DP world, with PP > 1 the stage's TP x DP ranks (other
stages hold other tensors). Model code never reads process-group globals: these objects are passed down.

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

from megatron import comm, heartbeat, sigterm
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

    heartbeat.stop(exit_code)  # finished (a failure elsewhere from here on does not name it), or its exit code
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
    # --distributed-timeout-minutes: how long any collective waits, on every group (a group made without a
    # timeout would wait for a hung rank without end on gloo)
    timeout = datetime.timedelta(minutes=cfg.distributed_timeout_minutes)
    if not dist.is_initialized():
        backend = cfg.distributed_backend or accelerator.distributed_backend
        if world == 1:  # forced collectives: a one-rank group; a HashStore needs no address or port
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
            _init_elastic_attempt(backend, timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
        # Tear the groups down before the interpreter does: gloo's threads otherwise may be destroyed while
        # still joinable at exit ("terminate called without an active exception", SIGABRT).
        atexit.register(_destroy_process_groups)
    rank, world = dist.get_rank(), dist.get_world_size()
    host_group = _host_group(world, timeout)
    state = _build_parallel_state(rank, world, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                  host_group, timeout)
    # a collective that fails names the ranks whose heartbeat stopped (megatron/heartbeat.py)
    heartbeat.start(rank, world, f"megatron_attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'none')}")
    if world > 1:  # a launcher's SIGTERM: one line naming those ranks too (megatron/sigterm.py)
        sigterm.install()
    return state


def _init_elastic_attempt(backend: str, timeout: datetime.timedelta) -> None:
    """The process group of this torchrun attempt. torchrun's store outlives a failed attempt (`--max-restarts`):
    initialised from the environment, the restarted workers would read the dead attempt's keys and fail to connect
    (gloo's connectFullMesh to the old ports). Each attempt's keys get their own prefix in that store."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"megatron_attempt_{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


def _host_group(world: int, timeout: datetime.timedelta) -> object:
    """The default group when it is gloo already, else a gloo group over every rank (created by all ranks)."""
    if "gloo" in str(dist.get_backend()).split(","):
        return dist.group.WORLD
    return dist.new_group(list(range(world)), backend="gloo", timeout=timeout)


@dataclass(frozen=True)
class RankLayout:
    """Which global ranks form which group, for `pp` stages x `dp` replicas x `tp` TP ranks (module docstring)."""

    tp: int
    pp: int
    dp: int

    def rank(self, stage: int, replica: int, tp_rank: int) -> int:
        return (stage * self.dp + replica) * self.tp + tp_rank

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, TP rank) of global `rank`."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def tensor_parallel_groups(self) -> list[list[int]]:
        return [[self.rank(s, d, t) for t in range(self.tp)] for s in range(self.pp) for d in range(self.dp)]

    def data_parallel_groups(self) -> list[list[int]]:
        return [[self.rank(s, d, t) for d in range(self.dp)] for s in range(self.pp) for t in range(self.tp)]

    def stage_groups(self) -> list[list[int]]:
        """Every rank of a stage (its TP x DP ranks): the FP8 amax group under pipeline parallelism."""
        return [[self.rank(s, d, t) for d in range(self.dp) for t in range(self.tp)] for s in range(self.pp)]


def _new_groups(rank: int, rank_lists: list[list[int]], timeout: datetime.timedelta) -> Optional[object]:
    """Create a group for every list (all ranks must, in the same order), each with the run's collective `timeout`;
    return the one holding `rank`."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def _build_parallel_state(rank: int, world: int, tp: int, pp: int, host_group: object,
                          timeout: datetime.timedelta) -> ParallelState:
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp}")
    layout = RankLayout(tp=tp, pp=pp, dp=world // (tp * pp))
    stage, replica, tp_rank = layout.coordinates(rank)
    tp_group = _new_groups(rank, layout.tensor_parallel_groups(), timeout) if tp > 1 else None
    if pp == 1:
        world_group = _new_groups(rank, [list(range(world))], timeout)
        dp_group = world_group if tp == 1 else _new_groups(rank, layout.data_parallel_groups(), timeout)
        amax_group = world_group
    else:
        dp_group = _new_groups(rank, layout.data_parallel_groups(), timeout)
        # With TP = 1 a stage's ranks are exactly its data-parallel group.
        amax_group = dp_group if tp == 1 else _new_groups(rank, layout.stage_groups(), timeout)
    logger.info("initialized torch.distributed: rank %d of %d (pipeline stage %d of %d x data parallel %d x tensor "
                "parallel %d)", rank, world, stage, pp, layout.dp, tp)
    return ParallelState(world_size=world, rank=rank, data_parallel_size=layout.dp, data_parallel_rank=replica,
                         data_parallel_group=dp_group, tensor_parallel_size=tp, tensor_parallel_rank=tp_rank,
                         tensor_parallel_group=tp_group, amax_group=amax_group, pipeline_parallel_size=pp,
                         pipeline_parallel_rank=stage, host_group=host_group)
