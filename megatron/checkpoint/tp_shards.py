"""Checkpoints of a tensor-parallel run: one `mp_rank_XX` shard per TP rank, committed together.

    iter_0000100/
        mp_rank_00/model_optim_rng.pt   TP rank 0's parameters, optimizer state, RNG, FP8 scaling state
        mp_rank_01/model_optim_rng.pt   TP rank 1's ...
        train_state.json, config.json

The ranks of data-parallel rank 0 write their shards into one shared temporary folder; after a barrier,
global rank 0 renames it to `iter_*` and replaces the tracker file, so a crash leaves either the complete
new checkpoint or the previous one (the same guarantee as `checkpointing.save_checkpoint` at TP = 1).
Each shard is loaded back by the rank with the same TP rank: loading at the same layout is exact.
Loading at another TP size (or from another engine's layout) goes through `megatron.checkpoint.reshard`.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from megatron import comm
from megatron.checkpoint.store import (
    TMP_PREFIX,
    CheckpointError,
    any_rank_failed,
    commit_checkpoint,
    sweep_stale_saves,
    write_model_file,
)
from megatron.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def save_tensor_parallel_checkpoint(save_dir: str | os.PathLike, iteration: int, payload: Optional[dict],
                                    train_state: dict, config: dict, parallel: ParallelState,
                                    verify: Optional[Callable[[Path, Any], None]] = None) -> None:
    """Collective (every rank calls it); `payload` is this rank's shard, used on data-parallel rank 0 only.
    `verify(file, written)` (`--verify-checkpoint`) checks each shard before the commit."""
    root = Path(save_dir)
    staging = root / f"{TMP_PREFIX}{iteration:07d}_tp{parallel.tensor_parallel_size}"
    if parallel.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        sweep_stale_saves(root)
        staging.mkdir()
    comm.barrier(comm.world_group())
    error: Optional[CheckpointError] = None
    if parallel.data_parallel_rank == 0:
        try:
            write_model_file(staging, parallel.tensor_parallel_rank, payload, iteration, verify)
        except CheckpointError as exc:
            error = exc
    if any_rank_failed(error is not None, parallel.host_group):
        shutil.rmtree(staging, ignore_errors=True)
        raise error or CheckpointError(f"another tensor-parallel rank could not write or verify its shard in "
                                       f"{staging}; the previous checkpoint is intact (see that rank's error)")
    if parallel.rank == 0:
        commit_checkpoint(root, staging, iteration, train_state, config)
    comm.barrier(comm.world_group())
