"""Which checkpoint a resume loads: the newest one whose files match its manifest, agreed by every rank.

The tracker's iteration (or the newest healthy one before it: `store.read_tracker`) is checked first against its
manifest (`manifest.problems`: every file present at its written size, the CRC-32 reading shared by the ranks of the
host group). When any rank finds a problem, every rank logs one line naming the file and what is wrong, the folder is
left untouched, and the next older complete healthy checkpoint is checked in turn; `--no-checkpoint-fallback`
refuses instead. A folder without a manifest (older versions, upstream Megatron or DeepSpeed) loads as it is.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron import comm
from megatron.checkpoint import manifest
from megatron.checkpoint.store import (
    TRACKER_FILE,
    CheckpointError,
    complete_iterations,
    is_healthy,
    iteration_dir,
    read_tracker,
)

logger = logging.getLogger("megatron")


def _problems_of_all_ranks(folder: Path, group: Any) -> list[str]:
    """Each rank checks its share of `folder`'s files; every rank gets the problems any rank found."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if comm.is_active(group) else (0, 1)
    found = manifest.problems(folder, rank, world) if folder.is_dir() else f"{folder} is missing"
    return sorted({p for p in comm.all_gather_object(found, group) if p})


def resume_iteration(load_dir: str, fallback: bool, group: Any = None) -> Optional[int]:
    """The iteration to resume from under `load_dir` (None: no checkpoint). Collective over `group` (the host
    group): every rank returns the same iteration or raises the same error."""
    newest = read_tracker(load_dir)
    if newest is None:
        return None
    root = Path(load_dir)
    older = [i for i in reversed(complete_iterations(root)) if i < newest and is_healthy(root, i)]
    rejected = []
    for iteration in [newest, *older]:
        found = _problems_of_all_ranks(iteration_dir(root, iteration), group)
        if not found:
            if rejected:
                logger.warning("resuming from iteration %d, the newest checkpoint under %s whose files match its "
                               "manifest (rejected: %s); the rejected folders are left as they are", iteration, root,
                               ", ".join(str(i) for i, _ in rejected))
            return iteration
        if not fallback:
            raise CheckpointError(f"checkpoint of iteration {iteration} under {root} is damaged: {found[0]}. "
                                  "--no-checkpoint-fallback is set: restore the file, or write an older iteration into "
                                  f"{root / TRACKER_FILE}, or drop the flag to resume from the newest intact one")
        logger.error("checkpoint of iteration %d under %s is damaged: %s; trying the next older one", iteration, root,
                     "; ".join(found))
        rejected.append((iteration, found[0]))
    raise CheckpointError(f"no checkpoint under {root} matches its manifest ("
                          + "; ".join(f"iteration {i}: {problem}" for i, problem in rejected)
                          + "); restore the files or start a new run in a new --save folder")
