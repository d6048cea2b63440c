"""Checkpoints of a tensor-parallel run: one `mp_rank_XX` shard per TP rank, committed together.

    iter_0000100/
        mp_rank_00/model_optim_rng.pt   TP rank 0's parameters, optimizer state, RNG, FP8 scaling state
        mp_rank_01/model_optim_rng.pt   TP rank 1's ...
        train_state.json, config.json

The ranks of data-parallel rank 0 write their shards into one shared temporary folder; after a barrier,
global rank 0 renames it to `iter_*` and replaces the tracker file, so a crash leaves either the complete
new checkpoint or the previous one (the same guarantee as `checkpointing.save_checkpoint` at TP = 1).
Each shard is loaded back by the rank with the same TP rank: loading at the same layout is exact.
Resharding (loading at another TP size) is not supported yet; `check_tensor_parallel_layout` refuses it
with a message naming --tensor-model-parallel-size instead of failing on a missing file or a shape.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from megatron import comm
from megatron.parallel_state import ParallelState
from megatron.training.checkpointing import (
    CHECKPOINT_VERSION,
    TMP_PREFIX,
    CheckpointError,
    commit_checkpoint,
    fsync_path,
    iteration_dir,
    model_file,
    read_tracker,
    sweep_stale_saves,
)

logger = logging.getLogger(__name__)


def save_tensor_parallel_checkpoint(save_dir: str | os.PathLike, iteration: int, payload: Optional[dict],
                                    train_state: dict, config: dict, parallel: ParallelState) -> None:
    """Collective (every rank calls it); `payload` is this rank's shard, used on data-parallel rank 0 only."""
    root = Path(save_dir)
    staging = root / f"{TMP_PREFIX}{iteration:07d}_tp{parallel.tensor_parallel_size}"
    if parallel.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        sweep_stale_saves(root)
        staging.mkdir()
    comm.barrier(comm.world_group())
    if parallel.data_parallel_rank == 0:
        target = model_file(staging, parallel.tensor_parallel_rank)
        target.parent.mkdir(parents=True)
        with open(target, "wb") as f:
            torch.save(dict(payload, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(target.parent)
    comm.barrier(comm.world_group())
    if parallel.rank == 0:
        commit_checkpoint(root, staging, iteration, train_state, config)
    comm.barrier(comm.world_group())


def check_tensor_parallel_layout(load_dir: str | os.PathLike, tensor_parallel_size: int) -> None:
    """Raise CheckpointError when the newest checkpoint under `load_dir` has another TP size."""
    iteration = read_tracker(load_dir)
    if iteration is None:
        return
    ckpt_dir = iteration_dir(load_dir, iteration)
    shards = sorted(p.name for p in ckpt_dir.glob("mp_rank_*"))
    if not shards:
        return  # not this layout; the loader reports what is missing
    saved = len(shards)
    config_file = ckpt_dir / "config.json"
    if config_file.exists():
        saved = json.loads(config_file.read_text()).get("parallel", {}).get("tensor_model_parallel_size", saved)
    if saved != tensor_parallel_size or len(shards) != tensor_parallel_size:
        raise CheckpointError(
            f"{ckpt_dir} was saved with --tensor-model-parallel-size {saved} ({len(shards)} mp_rank_* shards) but "
            f"this run uses --tensor-model-parallel-size {tensor_parallel_size}: resharding a checkpoint to another "
            f"tensor-parallel size is not supported yet; resume with --tensor-model-parallel-size {saved}")
