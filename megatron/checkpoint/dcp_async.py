"""`--async-save` (Megatron-LM's spelling) for sharded checkpoints: the loop blocks only while the state is copied,
the files are written in the background, and the checkpoint is committed once every rank has written its part.

`AsyncSaver.start` takes the snapshot: `torch.distributed.checkpoint.async_save` copies every rank's shards to host
memory before it returns (training then changes the weights in place; the host copies are kept from one save to the
next and copied into again), and writes them from a thread; its
collectives run on a process group of their own (gloo), never beside the training's on the same group. Rank 0's
extras (LR schedule, RNG, FP8 state) are written at once: they are small. `poll` (the loop calls it after every
iteration, and waits on it before the next save and at the end of training) asks every rank, in one all-reduce on
the host group, whether its part is written; once all are, rank 0 commits as every save commits (store.py: the
staging folder takes its `iter_*` name, then the tracker moves). Until then the previous checkpoint stays the newest:
a crash, a kill or a dead rank during the background write loses nothing but this checkpoint, whose staging folder
the next save sweeps away. A write that fails on any rank fails the save on every rank (a CheckpointError from
`poll`, which the loop counts as a failed save).
"""
from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron import comm
from megatron.checkpoint import dcp_io
from megatron.checkpoint import store as ckpt

logger = logging.getLogger("megatron")


@dataclass
class _Pending:
    future: Any
    root: Path
    staging: Path
    iteration: int
    train_state: dict
    config: dict
    started: float
    written: bool = False  # this rank's part is written and in the manifest
    error: Optional[BaseException] = None


def _stager() -> Any:
    """DCP's stager, one for the run: it keeps the host copy of each tensor it staged (keyed by the tensor's storage),
    so a later snapshot copies into memory already mapped instead of allocating it again (the first snapshot of a
    1B-parameter state spends most of its time faulting fresh pages in). Pinned where CUDA is there."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


class AsyncSaver:
    """At most one sharded save in flight; every rank holds one (module docstring)."""

    def __init__(self, rank: int, host_group: Any) -> None:
        import torch.distributed as dist

        self.rank, self.host_group = rank, host_group
        # DCP's own collectives (plan, finish) run from the writing thread: on a group of their own.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: Optional[_Pending] = None
        self.stager = _stager()
        self.blocked_seconds = 0.0  # the loop's time in `start` (the snapshot), for the log and benchmarks

    def start(self, save_dir: str, iteration: int, flat: dict[str, Any], extras: Optional[dict], train_state: dict,
              config: dict) -> None:
        """Snapshot this rank's shards and write them in the background (a collective)."""
        import torch.distributed.checkpoint as dcp

        self.poll(wait=True)  # the previous save is committed (or has failed) first
        began = time.perf_counter()
        root = Path(save_dir)
        staging = dcp_io.prepare_staging(root, iteration, self.rank, self.host_group)
        error: Optional[BaseException] = None
        if self.rank == 0:
            try:
                dcp_io.write_extras(staging, extras or {}, iteration)
            except ckpt.CheckpointError as exc:  # fails the save on every rank at the next poll
                error = exc
        writer = dcp.FileSystemWriter(staging / dcp_io.DCP_DIR, sync_files=True)
        future = dcp.async_save(flat, storage_writer=writer, process_group=self.group, async_stager=self.stager)
        self.pending = _Pending(future, root, staging, iteration, dict(train_state), dict(config), began, error=error)
        self.blocked_seconds = time.perf_counter() - began
        logger.info("checkpoint of iteration %d: state copied in %.3f s, written in the background (--async-save)",
                    iteration, self.blocked_seconds)

    def poll(self, wait: bool = False) -> Optional[int]:
        """Commit the save in flight once every rank has written it (`wait`: block until then); the iteration
        committed, or None. A collective whenever a save is in flight (every rank has one then)."""
        p = self.pending
        if p is None:
            return None
        if not p.written and (wait or p.future.done()):
            self._finish_part(p)
        flags = torch.tensor([0.0 if p.written else 1.0, 1.0 if p.error is not None else 0.0])
        comm.all_reduce(flags, self.host_group, comm.ReduceOp.MAX)
        if flags[1] > 0:
            self.pending = None
            if self.rank == 0:
                shutil.rmtree(p.staging, ignore_errors=True)
            detail = f": {p.error.__class__.__name__}: {str(p.error)[:300]}" if p.error is not None else \
                " (see its error)"
            raise ckpt.CheckpointError(f"the background write of checkpoint {p.iteration} into {p.root} failed on a "
                                       f"rank{detail}; the previous checkpoint is intact")
        if flags[0] > 0:
            return None
        if self.rank == 0:
            ckpt.commit_checkpoint(p.root, p.staging, p.iteration, p.train_state, p.config)
        comm.barrier(self.host_group)
        self.pending = None
        logger.info("checkpoint of iteration %d committed %.1f s after its snapshot", p.iteration,
                    time.perf_counter() - p.started)
        return p.iteration

    def _finish_part(self, p: _Pending) -> None:
        """Wait for this rank's write, then record its files in the manifest."""
        try:
            p.future.result()
            dcp_io.record_rank_files(p.staging, self.rank)
        except dcp_io.dcp_errors() as exc:  # the writer's error, whatever it is, fails this save on every rank
            p.error = dcp_io.first_failure(exc)
        p.written = True
