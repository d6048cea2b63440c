"""Sharded checkpoints (`--ckpt-format torch_dist`, Megatron-LM's spelling): every rank writes its own shards of the
model and the optimizer state through `torch.distributed.checkpoint` (DCP), into our folder layout and commit.

    iter_0000100/
        dcp/.metadata                    DCP's index of every tensor's shards (written by rank 0)
        dcp/__<rank>_0.distcp            each rank's shards
        extras.pt                        rank 0's plain state: LR schedule, RNG, FP8 scaling state, SwiGLU history
        train_state.json, config.json, manifest.json

The state DCP holds is one flat dict: `model/<parameter name>` (the FSDP2 DTensors), `optimizer/state/<parameter
name>/<exp_avg | exp_avg_sq | step>` and `optimizer/param_groups` (the groups' hyper-parameters and parameter
names, as JSON). Under tensor parallelism each tensor is the TP ranks' pieces end to end along their dimension (a
DTensor on the tp x dp mesh, training/fsdp2_mesh.py; Fp8AdamW's per-tensor scales one per piece); `untangled` turns
that into the full model's layout. Written into a staging folder and committed by rank 0 as every other layout is
(store.py: a crash at any moment leaves the previous checkpoint the newest); each rank records its own files in the
manifest.

Read back three ways: sharded into an FSDP2 model at any data-parallel size (DCP reshards: each rank reads the
pieces of the saved shards its own shards overlap); whole, without a process group, for every tool and every
other engine (`read_full`: the full tensors of each key, which layouts.py and full_state.py hand on as any other
layout's).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from megatron.checkpoint import manifest
from megatron.checkpoint import store as ckpt
from megatron.config import ModelConfig
from megatron.parallel.layout import merge_shards, shard_spec

DCP_DIR = "dcp"
EXTRAS_FILE = "extras.pt"
MODEL, STATE, GROUPS = "model/", "optimizer/state/", "optimizer/param_groups"


def is_dcp(folder: Path) -> bool:
    return (Path(folder) / DCP_DIR / ".metadata").exists()


def flat_state(model_state: dict[str, Any], optim_state: Optional[dict]) -> dict[str, Any]:
    """The flat dict DCP stores (module docstring), from torch.distributed.checkpoint's named state dicts."""
    flat: dict[str, Any] = {MODEL + name: value for name, value in model_state.items()}
    if optim_state is not None:
        for name, entry in optim_state["state"].items():
            for key, value in entry.items():
                flat[f"{STATE}{name}/{key}"] = value
        flat[GROUPS] = json.dumps(optim_state["param_groups"])
    return flat


def nested_state(flat: dict[str, Any]) -> tuple[dict[str, Any], Optional[dict]]:
    """`flat_state`'s inverse: (model state, optimizer state or None)."""
    model = {key[len(MODEL):]: value for key, value in flat.items() if key.startswith(MODEL)}
    if GROUPS not in flat:
        return model, None
    state: dict[str, dict] = {}
    for key, value in flat.items():
        if key.startswith(STATE):
            name, _, entry = key[len(STATE):].rpartition("/")
            state.setdefault(name, {})[entry] = value
    groups = flat[GROUPS]
    return model, {"state": state, "param_groups": json.loads(groups) if isinstance(groups, str) else groups}


def checkpoint_exception() -> type[BaseException]:
    """DCP's CheckpointException: a BaseException, which gathers every rank's failure so that each rank raises it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP save or load raises: Python's errors, and DCP's CheckpointException."""
    return Exception, checkpoint_exception()


def first_failure(exc: BaseException) -> BaseException:
    """The error behind a DCP CheckpointException (the lowest failed rank's, e.g. an OSError with its errno, named
    after the rank when it is another's); any other error as it is."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return exc
    rank = min(failures)
    cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    if isinstance(cause, OSError):
        return OSError(cause.errno, f"rank {rank}: {cause.strerror or cause}")
    return RuntimeError(f"rank {rank}: {cause.__class__.__name__}: {cause}")


def write_sharded(staging: Path, flat: dict[str, Any], rank: int, group: Any) -> None:
    """This rank's part of a DCP save into `staging` (a collective over `group`), its files in the manifest. A write
    that fails on any rank fails on every rank alike (DCP gathers the errors), as a CheckpointError."""
    import torch.distributed.checkpoint as dcp

    target = staging / DCP_DIR
    with ckpt.checkpoint_write_errors(staging):
        try:
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(target, sync_files=True), process_group=group)
        except checkpoint_exception() as exc:
            raise first_failure(exc) from None
        record_rank_files(staging, rank)


def record_rank_files(staging: Path, rank: int) -> None:
    """The manifest entries of the DCP files `rank` wrote (its shards; rank 0 also the index), read back once."""
    target = staging / DCP_DIR
    mine = sorted(target.glob(f"__{rank}_*.distcp")) + ([target / ".metadata"] if rank == 0 else [])
    manifest.write_part(staging, f"dcp_rank{rank}", {
        str(path.relative_to(staging)): {"bytes": path.stat().st_size, "crc32": manifest.file_crc32(path)}
        for path in mine})


def read_sharded(folder: Path, flat: dict[str, Any], group: Any) -> None:
    """Load `folder`'s DCP state into `flat`'s tensors in place (each rank its shards; a collective: DCP gathers
    every rank's read errors, so each rank raises the same CheckpointError)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(flat, storage_reader=dcp.FileSystemReader(folder / DCP_DIR), process_group=group)
    except dcp_errors() as exc:  # a damaged or missing shard file: DCP's CheckpointException wraps the OS/pickle error
        exc = first_failure(exc)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise ckpt.CheckpointError(f"cannot read the sharded checkpoint {folder / DCP_DIR} ({exc.__class__.__name__}: "
                                   f"{first}). Restore its files, or resume from an older checkpoint by writing its "
                                   f"iteration into {ckpt.TRACKER_FILE}") from exc


def saved_model_shapes(saved: dict[str, Any], tp: int, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    """The shapes of one tensor-parallel rank's pieces of the saved parameters (from `saved_keys`; saved at tensor
    parallel size `tp`), as storage-free tensors for store.check_model_state."""
    out = {}
    for key, meta in saved.items():
        if key.startswith(MODEL):
            name, shape = key[len(MODEL):], list(meta.size)
            spec = shard_spec(name, model_config)
            if spec is not None and tp > 1:
                shape[spec.dim] //= tp
            out[name] = torch.empty(shape, device="meta")
    return out


def saved_keys(folder: Path) -> dict[str, Any]:
    """The saved keys and their DCP metadata (tensor shapes and dtypes; plain values)."""
    import torch.distributed.checkpoint as dcp

    try:
        return dict(dcp.FileSystemReader(folder / DCP_DIR).read_metadata().state_dict_metadata)
    except Exception as exc:  # a damaged .metadata: pickle and OS errors alike
        raise ckpt.unreadable(folder / DCP_DIR / ".metadata", exc) from exc


def read_full(folder: Path, prefix: str = "") -> dict[str, Any]:
    """Every saved key (starting with `prefix`) as a full tensor or its plain value, read on this process alone (no
    process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat: dict[str, Any] = {}
    for key, meta in saved_keys(folder).items():
        if not key.startswith(prefix):
            continue
        flat[key] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                     if isinstance(meta, TensorStorageMetadata) else "")
    try:
        with warnings.catch_warnings():  # DCP warns that it reads in one process: what is asked here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=dcp.FileSystemReader(folder / DCP_DIR), no_dist=True)
    except dcp_errors() as exc:
        raise ckpt.unreadable(folder / DCP_DIR, first_failure(exc)) from None
    return flat


def saved_tensor_parallel(folder: Path) -> int:
    """The tensor-parallel size of the run that saved `folder` (its config.json)."""
    config = ckpt.read_json(Path(folder) / "config.json")
    return int(config.get("parallel", {}).get("tensor_model_parallel_size", 1) or 1)


def untangled(name: str, tensor: torch.Tensor, tp: int, model_config: ModelConfig) -> torch.Tensor:
    """Saved at tensor parallel size `tp`, a sharded tensor is its TP ranks' pieces end to end along their dimension
    (what each rank holds, as one global tensor): the full model's layout again (SwiGLU's fc1 is [gate_r | up_r] per
    rank, [gate | up] whole: parallel/layout.py)."""
    spec = shard_spec(name, model_config)
    if spec is None or tp == 1:
        return tensor
    return merge_shards(list(tensor.chunk(tp, dim=spec.dim)), spec)


def full_model(folder: Path, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's full state dict (every tool's weights)."""
    tp = saved_tensor_parallel(folder)
    return {name: untangled(name, value, tp, model_config)
            for name, value in nested_state(read_full(folder, MODEL))[0].items()}


def full_optimizer(folder: Path, model_config: ModelConfig) -> Optional[dict]:
    """The optimizer state keyed by parameter name ({"state": {name: {moment: full tensor}}, "param_groups"}), None
    when it was not saved."""
    saved = nested_state(read_full(folder, "optimizer/"))[1]
    tp = saved_tensor_parallel(folder)
    if saved is not None and tp > 1:
        for name, entry in saved["state"].items():
            _per_piece_values(name, entry, tp, model_config)
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    entry[key] = untangled(name, value, tp, model_config)
    return saved


def _per_piece_values(name: str, entry: dict, tp: int, model_config: ModelConfig) -> None:
    """A tensor-parallel parameter's Fp8AdamW moment with one scale per tensor was saved with one scale per TP piece
    ((tp,): training/fsdp2_mesh.py): its codes become FP32 values piece by piece (the optimizer's own `dequantize`),
    in place of codes and scales. Blockwise scales ((rows, row length / block)) are pieces of the parameter's
    layout and stay."""
    from megatron.optimizer.fp8_state_quant import dequantize

    spec = shard_spec(name, model_config)
    for moment in [key for key in entry if key + "_scale_inv" in entry]:
        scale = entry[moment + "_scale_inv"]
        if spec is None or scale.dim() != 1:
            continue
        pieces = [dequantize(piece.reshape(-1), s.reshape(1), piece.numel()).view(piece.shape)
                  for piece, s in zip(entry[moment].chunk(tp, dim=spec.dim), scale.float())]
        entry[moment] = torch.cat(pieces, dim=spec.dim)
        del entry[moment + "_scale_inv"]


def write_extras(staging: Path, extras: dict, iteration: int) -> None:
    """Rank 0's plain state beside the shards, fsynced and in the manifest."""
    target = staging / EXTRAS_FILE
    with ckpt.checkpoint_write_errors(staging):
        with manifest.ChecksumFile(target) as f:
            torch.save(dict(extras, checkpoint_version=ckpt.CHECKPOINT_VERSION, iteration=iteration), f)
        manifest.write_part(staging, "extras", {EXTRAS_FILE: f.entry()})


def read_extras(folder: Path) -> dict:
    path = Path(folder) / EXTRAS_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ckpt.CheckpointError(f"{path} is missing: the sharded checkpoint {folder} is incomplete; resume from "
                                   f"another iteration (write it into {ckpt.TRACKER_FILE})") from None
    except Exception as exc:
        raise ckpt.unreadable(path, exc) from exc


def prepare_staging(root: Path, iteration: int, rank: int, host_group: Any) -> Path:
    """Rank 0 sweeps the stale staging folders of crashed saves and creates this save's (one name for every rank);
    every rank returns its path once it exists (a collective). A folder that cannot be created fails the save on
    every rank, nothing written."""
    staging = root / f"{ckpt.TMP_PREFIX}{iteration:07d}_dcp"
    error: Optional[ckpt.CheckpointError] = None
    if rank == 0:
        try:
            with ckpt.checkpoint_write_errors(staging):
                root.mkdir(parents=True, exist_ok=True)
                ckpt.sweep_stale_saves(root)
                staging.mkdir()
        except ckpt.CheckpointError as exc:
            error = exc
    if ckpt.any_rank_failed(error is not None, host_group):
        raise error or ckpt.CheckpointError(f"rank 0 could not create the staging folder {staging} (see its error); "
                                            "the previous checkpoint is intact")
    return staging


def save_sharded_checkpoint(save_dir: str, iteration: int, flat: dict[str, Any], extras: Optional[dict],
                            train_state: dict, config: dict, rank: int, group: Any, host_group: Any) -> None:
    """Write checkpoint `iteration` as DCP shards (every rank) and rank 0's extras into one staging folder, then rank 0
    commits it (store.commit_checkpoint: the tracker moves last). A failure on any rank fails the save on every
    rank, the staging folder removed and the previous checkpoint the newest."""
    import shutil

    from megatron import comm

    root = Path(save_dir)
    staging = prepare_staging(root, iteration, rank, host_group)
    error: Optional[ckpt.CheckpointError] = None
    try:
        write_sharded(staging, flat, rank, group)
        if rank == 0:
            write_extras(staging, extras or {}, iteration)
    except ckpt.CheckpointError as exc:
        error = exc
    if ckpt.any_rank_failed(error is not None, host_group):
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise error or ckpt.CheckpointError(f"another rank could not write its shards of iteration {iteration} into "
                                            f"{save_dir} (see its error); the previous checkpoint is intact")
    if rank == 0:
        ckpt.commit_checkpoint(root, staging, iteration, train_state, config)
    comm.barrier(host_group)
