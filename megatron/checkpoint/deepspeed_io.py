"""DeepSpeed's checkpoints in our folders: the save and load glue of the DeepSpeed engines, the names of the files
DeepSpeed writes, and the allowlist that lets them be read with `torch.load(weights_only=True)`.

Layout under --save (our tracker and folder names, DeepSpeed's files inside):
    latest_checkpointed_iteration.txt            our tracker: the newest complete checkpoint
    latest                                       DeepSpeed's tracker (same tag), for its tools
    iter_0000100/
        mp_rank_00_model_states.pt               weights + {"megatron": scheduler, RNG, FP8 state}; one
                                                 mp_rank_<tp> per TP rank (a pipeline: stage x TP + TP rank)
                                                 (ZeRO-3: zero_pp_rank_<dp>_mp_rank_00_model_states.pt)
        zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt   one per rank: its ZeRO partition (ZeRO >= 1)
        train_state.json, config.json            as in our own layout
        manifest.json                            every file's size and CRC-32, as in our own layout
    zero_to_fp32.py                              DeepSpeed's script to consolidate the partitions (it reads `latest`)
Atomicity as in `store.save_checkpoint`: every rank writes into a hidden temporary tag,
rank 0 fsyncs the files, adds our JSON files and renames the folder, then replaces the trackers.
A crash before the rename leaves the previous checkpoint and trackers untouched. Assumes a file
system shared by all ranks, as DeepSpeed's own loader does (rank r reads the files rank 0 wrote).
"""
from __future__ import annotations

import functools

import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron import comm
from megatron.checkpoint import manifest
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.verify import verify_file

DS_MODEL_FILE = "mp_rank_00_model_states.pt"
DS_TRACKER_FILE = "latest"
CLIENT_KEY = "megatron"  # our client state (scheduler, RNG, FP8 state) inside the model-states files


def _fsync_tree(folder) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            ckpt.fsync_path(path)
    for path in sorted(p for p in folder.rglob("*") if p.is_dir()):
        ckpt.fsync_path(path)
    ckpt.fsync_path(folder)


def save_checkpoint(engine, save_dir: str, iteration: int, client_state: dict, train_state: dict,
                    config: dict, verify_group: Any = None, verify: bool = False) -> None:
    """Collective: every rank writes its part; rank 0 commits the folder and the trackers. With `verify`
    (`--verify-checkpoint`) every rank reads back each file DeepSpeed wrote for it and compares it with the state
    DeepSpeed handed to `torch.save`; the ranks agree over `verify_group` (a CPU group) before anything is committed."""
    root = Path(save_dir)
    rank0 = dist.get_rank() == 0
    tmp_tag = f"{ckpt.TMP_PREFIX}{iteration:07d}"  # same name on every rank (DeepSpeed checks it)
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        ckpt.sweep_stale_saves(root)
    comm.barrier(comm.world_group())
    staging = root / tmp_tag
    written = engine.checkpoint_engine.written = [] if verify else None
    entries = engine.checkpoint_engine.entries = {}
    failed = engine.checkpoint_engine.failed = []
    try:
        # A write error is held (`failed`) until DeepSpeed's own barriers are behind every rank: raised where it
        # happened, it would leave this rank out of a barrier the others wait in.
        engine.save_checkpoint(str(root), tag=tmp_tag, client_state={CLIENT_KEY: client_state}, save_latest=False)
        # DeepSpeed's save ends with a barrier: every rank's files are complete here.
        if entries and not failed:
            try:
                manifest.write_part(staging, f"rank_{dist.get_rank():05d}",
                                    {str(Path(path).relative_to(staging)): entry for path, entry in entries.items()})
            except OSError as exc:
                failed.append(exc)
    finally:
        engine.checkpoint_engine.entries = engine.checkpoint_engine.failed = None
    _agree_written(staging, failed, verify_group)
    if verify:
        _verify_written(root / tmp_tag, written, verify_group)
        engine.checkpoint_engine.written = None
    comm.barrier(comm.world_group())  # every rank's manifest entries are in before rank 0 merges them
    if rank0:
        tmp = root / tmp_tag
        _fsync_tree(tmp)
        ckpt.commit_checkpoint(root, tmp, iteration, train_state, config,
                               pointers={DS_TRACKER_FILE: ckpt.iteration_dir(root, iteration).name})
    comm.barrier(comm.world_group())


def load_checkpoint(engine, load_dir: str, load_optimizer: bool, module_only: bool,
                    iteration: Optional[int] = None) -> Optional[dict]:
    """Restore weights (and optimizer partitions) in place; return our part like `load_checkpoint_files`.

    The dict has 'payload' (scheduler, RNG, FP8 state), 'train_state', 'config' and 'path'; weights and
    optimizer are already in the engine when it returns. None: no checkpoint.
    """
    iteration = ckpt.read_tracker(load_dir) if iteration is None else iteration
    if iteration is None:
        return None
    folder = ckpt.iteration_dir(load_dir, iteration)
    if not any(folder.glob("*" + DS_MODEL_FILE)):  # ZeRO-3 writes one zero_pp_rank_<dp>_<name> per rank
        raise ckpt.CheckpointError(f"{Path(load_dir) / ckpt.TRACKER_FILE} points at iteration {iteration} but "
                                   f"{folder} holds no DeepSpeed *{DS_MODEL_FILE}; restore that folder or fix the "
                                   "tracker")
    load_path, client = engine.load_checkpoint(str(load_dir), tag=folder.name, load_module_strict=True,
                                               load_optimizer_states=load_optimizer, load_lr_scheduler_states=False,
                                               load_module_only=module_only)
    if load_path is None:
        raise ckpt.CheckpointError(f"DeepSpeed could not load the checkpoint in {folder}")
    train_state = ckpt.read_json(folder / "train_state.json")
    config_path = folder / "config.json"
    config = ckpt.read_json(config_path) if config_path.exists() else {}
    return {"payload": (client or {}).get(CLIENT_KEY, {}), "train_state": train_state, "config": config,
            "path": folder}


def _agree_written(staging: Path, failed: list, group: Any) -> None:
    """If any rank could not write its files, every rank raises (the failing one its own error, ENOSPC named as such)
    and the staging folder is removed: the previous checkpoint stays the newest, and the run may go on."""
    if not ckpt.any_rank_failed(bool(failed), group):
        return
    comm.barrier(comm.world_group())  # every rank knows before the folder goes
    if failed:
        with ckpt.checkpoint_write_errors(staging):
            raise failed[0]
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise ckpt.CheckpointError(f"another rank could not write its part of the checkpoint into {staging.parent} (see "
                               "that rank's error); the previous checkpoint is intact")


def _verify_written(staging: Path, written: list, group: Any) -> None:
    """Every rank checks the files it wrote; if any rank's check fails, every rank raises and nothing is committed."""
    error = None
    try:
        if not written and dist.get_rank() == 0:  # rank 0 always writes the model states; others may write none
            raise ckpt.CheckpointError(f"--verify-checkpoint: DeepSpeed wrote no file through its checkpoint engine "
                                       f"into {staging}; nothing could be checked")
        for path, state in written:
            verify_file(Path(path), state, deepspeed_safe_globals)
    except ckpt.CheckpointError as exc:
        error = exc
    if ckpt.any_rank_failed(error is not None, group):
        comm.barrier(comm.world_group())  # every rank has stopped reading before the folder goes
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise error or ckpt.CheckpointError(f"--verify-checkpoint: another rank's files in {staging} do not hold what "
                                            "was written (see that rank's error); nothing was committed")


def deepspeed_safe_globals() -> list:
    """The DeepSpeed classes its checkpoint files pickle besides tensors and plain containers.

    All are data holders: a namedtuple of two ints, an Enum, and the (static) loss scaler, whose
    state is a dict of numbers. Allowing exactly these keeps `weights_only=True` (no code objects).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler]


@functools.lru_cache(maxsize=None)
def _weights_only_checkpoint_engine() -> type:
    """DeepSpeed's TorchCheckpointEngine loading with `weights_only=True` (and DeepSpeed's allowlist), writing through
    the CRC-32 of our manifest, and holding write errors while `save_checkpoint` runs (see there)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        written: Optional[list] = None  # (path, state) of each save while `save_checkpoint` verifies
        entries: Optional[dict] = None  # path -> manifest entry of each file saved by `save_checkpoint`
        failed: Optional[list] = None  # within `save_checkpoint`: this rank's write errors, held (see there)

        def save(self, state_dict, path: str):
            if self.failed:  # one error is enough: the checkpoint will not be committed
                return
            try:
                with manifest.ChecksumFile(Path(path)) as f:  # TorchCheckpointEngine.save, through the CRC-32
                    torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)
            except (OSError, RuntimeError) as exc:  # torch's zip writer reports a short write as RuntimeError
                if self.failed is None:
                    raise
                self.failed.append(exc)
                return
            if self.entries is not None:
                self.entries[path] = f.entry()
            if self.written is not None:
                self.written.append((path, state_dict))

        def makedirs(self, path, exist_ok=False):
            try:
                return super().makedirs(path, exist_ok=exist_ok)
            except OSError as exc:
                if self.failed is None:
                    raise
                self.failed.append(exc)

        def load(self, path: str, map_location=None):
            try:
                with torch.serialization.safe_globals(deepspeed_safe_globals()):
                    return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as exc:  # pickle.UnpicklingError for code objects, RuntimeError/OSError for corruption
                raise ckpt.unreadable(path, exc) from exc

    return WeightsOnlyCheckpointEngine


def use_weights_only_loading(engine) -> None:
    """Make DeepSpeed read checkpoints with `torch.load(weights_only=True)`, as our own loader does.

    DeepSpeed's TorchCheckpointEngine loads with `weights_only=False`, i.e. it would run code pickled
    into a checkpoint. We swap in a subclass that loads with `weights_only=True` and an allowlist of
    DeepSpeed's few data classes. Other checkpoint engines (fast/decoupled writers, DataStates) are
    refused rather than left unchecked.
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise ValueError(f"DeepSpeed checkpoint engine {type(current).__name__} is not supported: megatron-fp8 loads "
                         "checkpoints with weights_only=True; remove the `checkpoint.writer` / `datastates` section")
    weights_only = _weights_only_checkpoint_engine()
    safe = weights_only.__new__(weights_only)
    safe.__dict__.update(current.__dict__)  # same settings (serialization format) as the one DeepSpeed built
    engine.checkpoint_engine = safe
    _hold_recovery_script_errors(engine, safe)


def _hold_recovery_script_errors(engine, safe) -> None:
    """Rank 0 copies zero_to_fp32.py into each checkpoint: its write errors are held in `safe.failed` too."""
    copy_script = getattr(engine, "_copy_recovery_script", None)
    if copy_script is not None:
        def copy_recovery_script(save_path, _copy=copy_script):
            try:
                return _copy(save_path)
            except OSError as exc:
                if safe.failed is None:
                    raise
                safe.failed.append(exc)
        engine._copy_recovery_script = copy_recovery_script
