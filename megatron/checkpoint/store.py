"""Checkpoints in Megatron's folder layout, written atomically and loaded without running code.

Layout under `--save`:
    latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    iter_0000100/
        mp_rank_00/model_optim_rng.pt      model, optimizer, scheduler, RNG, FP8 state, SwiGLU jump history
                                           (tensors + plain data)
        train_state.json                   iteration, consumed samples and tokens, skip/NaN counters
        config.json                        the resolved MegatronConfig (never a pickled Namespace)
        manifest.json                      every file's size and CRC-32 (manifest.py), checked before a resume

Atomicity: everything is written into a hidden temporary folder, fsynced, then renamed to its
final `iter_*` name; only then is the pointer file replaced (also via rename). A crash at any
moment leaves the previous checkpoint and pointer intact; leftovers are swept at the next save.
Loading uses `torch.load(weights_only=True)`, which refuses pickled code objects.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from megatron import comm
from megatron.checkpoint import manifest

CHECKPOINT_VERSION = 1
TRACKER_FILE = "latest_checkpointed_iteration.txt"
TMP_PREFIX = ".tmp_iter_"
OLD_PREFIX = TMP_PREFIX + "old_"  # the previous copy of an iteration being re-saved
_OLD_NAME = re.compile(re.escape(OLD_PREFIX) + r"(\d+)_\d+")
_ITER_NAME = re.compile(r"iter_(\d{7})")

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used with the current flags; the message says why and what to do."""


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def model_file(ckpt_dir: Path, mp_rank: int = 0) -> Path:
    return ckpt_dir / f"mp_rank_{mp_rank:02d}" / "model_optim_rng.pt"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> dict:
    """Write `data` as JSON, fsynced; its manifest entry."""
    text = json.dumps(data, indent=2, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return manifest.entry_of_bytes(text)


# ---------------------------------------------------------------------------------------------- RNG
def get_rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": [int(x) for x in random.getstate()[1]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np_s = state["numpy"]
    np.random.set_state(("MT19937", np_s["keys"].numpy().astype(np.uint32), np_s["pos"],
                         np_s["has_gauss"], np_s["cached_gaussian"]))
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------- save
def _disk_full(exc: BaseException) -> bool:
    text = str(exc)
    return (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in text \
        or "unexpected pos" in text  # torch's zip writer reports a short write this way


@contextlib.contextmanager
def checkpoint_write_errors(staging: Path) -> Iterator[None]:
    """Turn a failed write into a CheckpointError naming the folder (ENOSPC said as such) and remove the partial
    staging folder; the previous checkpoint and the tracker are untouched (nothing is committed yet)."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if _disk_full(exc):
            try:
                free = f"{shutil.disk_usage(staging.parent).free / 2**20:.0f} MiB free now"
            except OSError:
                free = "free space unknown"
            raise CheckpointError(f"no space left on device (ENOSPC) while writing a checkpoint into {staging.parent} "
                                  f"({free}); the previous checkpoint is intact. Free space or point --save "
                                  "elsewhere, then resume with --load") from exc
        raise CheckpointError(f"could not write a checkpoint into {staging.parent}: {exc.__class__.__name__}: "
                              f"{str(exc)[:300]}; the previous checkpoint is intact") from exc


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, payload: dict, train_state: dict,
                    config: dict, mp_rank: int = 0,
                    _before_commit: Optional[Callable[[Path], None]] = None,
                    verify: Optional[Callable[[Path, Any], None]] = None) -> Path:
    """Write checkpoint `iteration` atomically and point the tracker file at it.

    `payload` holds tensors and plain data only. `_before_commit` is a test hook called with the
    temporary folder just before the rename (to simulate a crash mid-save). `verify(file, written)`
    (`--verify-checkpoint`, verify.py) checks the file before the commit; when it raises, nothing is committed.
    """
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_saves(root)
    tmp = root / f"{TMP_PREFIX}{iteration:07d}_{os.getpid()}"
    try:
        write_model_file(tmp, mp_rank, payload, iteration, verify)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_checkpoint(root, tmp, iteration, train_state, config, _before_commit=_before_commit)


def write_model_file(staging: Path, mp_rank: int, payload: dict, iteration: int,
                     verify: Optional[Callable[[Path, Any], None]] = None) -> None:
    """`payload` (with the format version and iteration) as `staging`'s model file of `mp_rank`, fsynced, its size
    and CRC-32 left for the manifest, then checked by `verify` when given. A write error removes `staging`
    (`checkpoint_write_errors`); a failed check is raised as it is, for the caller to agree with the other ranks
    before removing anything."""
    target = model_file(staging, mp_rank)
    body = dict(payload, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration)
    with checkpoint_write_errors(staging):
        target.parent.mkdir(parents=True)
        with manifest.ChecksumFile(target) as f:
            torch.save(body, f)
        fsync_path(target.parent)
        manifest.write_part(staging, target.parent.name, {str(target.relative_to(staging)): f.entry()})
    if verify is not None:
        verify(target, body)


def any_rank_failed(failed_here: bool, group: Any) -> bool:
    """Whether any rank of `group` (a CPU group: the host group) failed, so that every rank takes the same branch and
    none waits for a commit that will not come. `group` None: this rank alone."""
    failed = torch.tensor([1.0 if failed_here else 0.0])
    comm.all_reduce(failed, group, comm.ReduceOp.MAX)
    return failed.item() > 0


def recover_interrupted_resave(root: Path) -> None:
    """Put back the previous copy of an iteration whose re-save was killed between its two renames.

    Re-saving iteration N moves iter_N aside (`.tmp_iter_old_N_<pid>`) before the new copy takes its name. A crash
    in between leaves no iter_N: the aside copy is then the only one, and is renamed back. When iter_N exists the
    new copy was committed and the aside one is stale. Safe when several ranks call it at once (a rename that
    another rank already did is skipped).
    """
    for old in sorted(root.glob(OLD_PREFIX + "*")):
        match = _OLD_NAME.fullmatch(old.name)
        if match is None:
            continue
        final = iteration_dir(root, int(match.group(1)))
        if final.exists():
            continue
        try:
            os.rename(old, final)
        except FileNotFoundError:  # another rank recovered it first
            continue
        fsync_path(root)
        logger.warning("recovered %s from %s: a re-save of that iteration was interrupted before its commit", final, old)


def sweep_stale_saves(root: Path) -> None:
    """Remove the temporary folders of earlier saves that crashed before their commit (after recovering the
    previous copy of an interrupted re-save: it is never deleted before its replacement is committed)."""
    recover_interrupted_resave(root)
    for stale in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def commit_checkpoint(root: Path, staging: Path, iteration: int, train_state: dict, config: dict,
                      pointers: Optional[dict[str, str]] = None,
                      _before_commit: Optional[Callable[[Path], None]] = None) -> Path:
    """Make a fully written staging folder the checkpoint of `iteration`, then move the pointer(s).

    Every writer (one process, each TP rank, DeepSpeed's ranks) fills `staging` first; one process
    then calls this: JSON files, fsync, rename to `iter_XXXXXXX`, and only then the tracker file (and
    any extra `pointers`, file name -> content, such as DeepSpeed's `latest`), each replaced atomically.
    """
    with checkpoint_write_errors(staging):
        manifest.finish(staging, {"train_state.json": write_json(staging / "train_state.json", train_state),
                                  "config.json": write_json(staging / "config.json", config)})
        fsync_path(staging)
    if _before_commit is not None and not getattr(_before_commit, "between_renames", False):
        _before_commit(staging)
    final = iteration_dir(root, iteration)
    if final.exists():  # re-saving the same iteration: move the old one aside, then replace it
        old = root / f"{OLD_PREFIX}{iteration:07d}_{os.getpid()}"
        os.rename(final, old)
        if _before_commit is not None and getattr(_before_commit, "between_renames", False):
            _before_commit(old)  # test hook: a crash with the old copy aside and the new one not yet in place
        os.rename(staging, final)
        fsync_path(root)
        shutil.rmtree(old, ignore_errors=True)  # only now: the new copy is committed
    else:
        os.rename(staging, final)
    fsync_path(root)
    for name, text in {TRACKER_FILE: str(iteration), **(pointers or {})}.items():
        tmp = root / f"{name}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / name)
    fsync_path(root)
    logger.info("saved checkpoint at iteration %d to %s", iteration, final)
    return final


# --------------------------------------------------------------------------------------------- load
def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; a missing or damaged one is a CheckpointError naming it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint folder is incomplete; resume from another "
                              f"iteration (write it into {TRACKER_FILE})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc}); resume from another iteration (write it into "
                              f"{TRACKER_FILE}) or restore the file") from None
def complete_iterations(root: Path) -> list[int]:
    """Iterations with a committed folder (`iter_*` names are given only to fully written folders)."""
    found = []
    for path in root.glob("iter_*"):
        match = _ITER_NAME.fullmatch(path.name)
        if match and (path / "train_state.json").exists():
            found.append(int(match.group(1)))
    return sorted(found)


def read_tracker(load_dir: str | os.PathLike) -> Optional[int]:
    """The iteration in `latest_checkpointed_iteration.txt`, or None when there is no checkpoint.

    Recovers an interrupted re-save first. Without a tracker but with committed `iter_*` folders (the tracker was
    deleted or lost), the newest of them is the checkpoint, with a warning: starting from scratch would overwrite
    them.
    """
    root = Path(load_dir)
    if root.is_dir():
        recover_interrupted_resave(root)
    tracker = root / TRACKER_FILE
    if not tracker.exists():
        found = complete_iterations(root) if root.is_dir() else []
        if not found:
            return None
        logger.warning("%s is missing but %s holds checkpoints of iterations %s: resuming from the newest, %d (write "
                       "another iteration into %s to resume from it; use a new --save folder to start from scratch)",
                       tracker, root, found, found[-1], TRACKER_FILE)
        return _healthy_iteration(root, found[-1])
    text = tracker.read_text().strip()
    if text == "release":
        raise CheckpointError(f"{tracker} says 'release': release checkpoints are not supported yet; "
                              "point --load at a training checkpoint folder")
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} is corrupt (content {text[:40]!r}); it must hold an iteration "
                              "number: fix or delete it") from None
    return _healthy_iteration(root, iteration)


def is_healthy(root: Path, iteration: int) -> bool:
    state_file = iteration_dir(root, iteration) / "train_state.json"
    try:
        return json.loads(state_file.read_text()).get("healthy", True) is not False
    except (OSError, ValueError):
        return True  # missing or damaged: the loader names the problem


def _healthy_iteration(root: Path, iteration: int) -> int:
    """`iteration`, unless its checkpoint was saved while the divergence guard saw the run going wrong: then the
    newest healthy one before it (with a warning), or `iteration` itself when there is none."""
    if is_healthy(root, iteration):
        return iteration
    healthy = [i for i in complete_iterations(root) if i < iteration and is_healthy(root, i)]
    if not healthy:
        logger.warning("checkpoint %d under %s was saved while the run was diverging and no healthy one precedes "
                       "it: loading it anyway", iteration, root)
        return iteration
    logger.warning("checkpoint %d under %s was saved while the run was diverging (train_state.json: healthy false): "
                   "resuming from the newest healthy one, %d", iteration, root, healthy[-1])
    return healthy[-1]


def unreadable(path: str | os.PathLike, exc: BaseException) -> CheckpointError:
    """The error for a checkpoint file `torch.load(weights_only=True)` refused: objects other than tensors and plain
    data (pickled code), or a file that is damaged or cut short (a node lost mid-write, a bad disk)."""
    detail = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
        return CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain data "
                               f"({detail}); checkpoints may only hold tensors and plain data")
    try:
        size = f"{os.path.getsize(path):,} bytes"
    except OSError:
        size = "size unknown"
    return CheckpointError(f"cannot read {path} ({size}): the file is damaged or truncated ({detail}). Restore it, or "
                           f"resume from an older checkpoint by writing its iteration into {TRACKER_FILE}")


def load_checkpoint_files(load_dir: str | os.PathLike, mp_rank: int = 0,
                          iteration: Optional[int] = None) -> Optional[dict]:
    """Load the checkpoint of `iteration` (None: the newest) under `load_dir`: {'payload', 'train_state', 'config',
    'path'} or None."""
    iteration = read_tracker(load_dir) if iteration is None else iteration
    if iteration is None:
        return None
    ckpt = iteration_dir(load_dir, iteration)
    path = model_file(ckpt, mp_rank)
    if not path.exists():
        raise CheckpointError(f"{Path(load_dir) / TRACKER_FILE} points at iteration {iteration} but {path} "
                              "does not exist; restore that folder or fix the tracker file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError for code objects, RuntimeError/OSError for corruption
        raise unreadable(path, exc) from exc
    train_state = read_json(ckpt / "train_state.json")
    config = read_json(ckpt / "config.json") if (ckpt / "config.json").exists() else {}
    return {"payload": payload, "train_state": train_state, "config": config, "path": ckpt}


def load_model_state(model: torch.nn.Module, state: dict, source: Path) -> None:
    """`load_state_dict(strict=True)` with errors that show both shapes and the missing/extra keys."""
    check_model_state(model, state, source)
    model.load_state_dict(state, strict=True)


def check_model_state(model: torch.nn.Module, state: dict, source: Path) -> None:
    """CheckpointError naming the keys and shapes where `state` does not fit `model` (a sharded model's state
    dict holds each parameter's full shape)."""
    own = model.state_dict()
    problems = []
    for key, tensor in state.items():
        if key in own and tuple(own[key].shape) != tuple(tensor.shape):
            problems.append(f"  {key}: checkpoint {tuple(tensor.shape)} vs model {tuple(own[key].shape)}")
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        problems.append(f"  missing in checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if unexpected:
        problems.append(f"  not in model: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    if problems:
        raise CheckpointError(f"checkpoint {source} does not match the model built from the current flags:\n"
                              + "\n".join(problems)
                              + "\nUse the same --num-layers/--hidden-size/... as the run that saved it.")
