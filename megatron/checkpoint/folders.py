"""What a run's `--load` and `--save` folders must be before it trains: nothing thrown away by a mistake.

- A `--load` folder that does not exist is an error, unless it is also `--save` (a run that resumes itself
  starts from scratch the first time): a mistyped `--load` would otherwise train from scratch and exit 0.
- A `--save` folder holding a checkpoint newer than where this run starts is refused, unless it is also `--load`
  (then that checkpoint is where it starts): training there from an older start would write older iterations
  over the tracker and leave the newer checkpoints unreachable.

And after each complete save, `--keep-last-n-checkpoints K` removes the older ones (`prune_checkpoints`).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from megatron.checkpoint.store import TRACKER_FILE, complete_iterations, iteration_dir

logger = logging.getLogger("megatron")


def _same(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def check_load_folder(load: Optional[str], save: Optional[str]) -> None:
    if load and not _same(load, save) and not Path(load).exists():
        raise FileNotFoundError(f"--load {load} does not exist: pass the folder that holds the checkpoint (the one "
                                f"with {TRACKER_FILE}), or leave --load out to start from scratch")


def check_save_folder(save: Optional[str], load: Optional[str], start_iteration: int) -> None:
    if not save or _same(load, save) or not Path(save).is_dir():
        return
    found = complete_iterations(Path(save))
    if found and found[-1] > start_iteration:
        raise ValueError(f"--save {save} holds checkpoints up to iteration {found[-1]}, newer than this run's start "
                         f"(iteration {start_iteration}): saving there would leave them unreachable. Resume that run "
                         f"with --load {save}, or pass a new --save folder")


def prune_checkpoints(save: str, keep: int, healthy: Optional[str]) -> list[int]:
    """Remove the checkpoints of `save` older than its `keep` newest complete ones, except `healthy` (the newest
    checkpoint known healthy: a run whose newest checkpoints were saved while diverging keeps a good one). Called
    on one rank after a save is complete. Each folder is first renamed out of the `iter_*` names, so a crash while
    deleting never leaves a half-removed folder that looks like a checkpoint. The iterations removed."""
    found = complete_iterations(Path(save))
    keep_healthy = Path(healthy).resolve() if healthy else None
    removed = []
    for iteration in found[:-keep] if len(found) > keep else []:
        folder = Path(iteration_dir(save, iteration))
        if keep_healthy is not None and folder.resolve() == keep_healthy:
            continue
        doomed = folder.with_name(f"{folder.name}.removing-{os.getpid()}")
        folder.rename(doomed)
        shutil.rmtree(doomed)
        removed.append(iteration)
    if removed:
        logger.info("--keep-last-n-checkpoints %d: removed the checkpoints of iterations %s from %s", keep,
                    ", ".join(map(str, removed)), save)
    return removed
