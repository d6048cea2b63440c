"""One reader for every checkpoint layout the trainer writes: the merged full-model (TP=1, PP=1) state dict.

An iteration folder (`iter_XXXXXXX/`) holds one of these layouts; `detect_layout` tells which from its files:

    layout            files                                                  weights come from
    single            mp_rank_00/model_optim_rng.pt                          its "model" entry
    tensor_parallel   mp_rank_00/.., mp_rank_01/.., ...                      every rank's shard, merged by
                                                                             `megatron.parallel.layout`
    deepspeed         mp_rank_<t>_model_states.pt (ZeRO 0, 1, 2), one per    its "module" entry (full weights at
                      TP rank t                                              TP = 1, else TP shards, merged)
    deepspeed_zero3   zero_pp_rank_<r>_mp_rank_00_model_states.pt + optim    the fp32 partitions, consolidated by
                      partitions                                             DeepSpeed's zero_to_fp32 functions
    pipeline          layer_<i>-model_<t>-model_states.pt per pipeline       embedding (0), transformer layers
                      layer i and TP rank t                                  (1..L), final norm + head (L+1); TP
                                                                             shards merged per layer
    torch_dist        dcp/.metadata + dcp/__<rank>_0.distcp, extras.pt       every rank's shards, read whole by
                      (FSDP2's sharded checkpoints, dcp_io.py)               torch.distributed.checkpoint

Tensor parallelism under DeepSpeed keeps the layout's name (the files say how many TP ranks wrote it): DeepSpeed
numbers its files by "model-parallel rank", which is the TP rank without a pipeline and stage x TP + TP rank in
a pipeline's mp_rank_XX_model_states.pt (its layer files name the TP rank alone, `model_<t>`).

Every file is read with `torch.load(weights_only=True)` (DeepSpeed's few data classes allowed, nothing that
runs code); the DeepSpeed layouts need the deepspeed package only for ZeRO-3's consolidation.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from megatron.checkpoint import dcp_io
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.configs import model_config_from_dict
from megatron.checkpoint.deepspeed_io import CLIENT_KEY, DS_MODEL_FILE, deepspeed_safe_globals
from megatron.config import ModelConfig
from megatron.parallel.layout import merge_state_dicts

SINGLE, TENSOR_PARALLEL, DEEPSPEED, DEEPSPEED_ZERO3, PIPELINE, TORCH_DIST = (
    "single", "tensor_parallel", "deepspeed", "deepspeed_zero3", "pipeline", "torch_dist")
_PIPE_LAYER = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")


def detect_layout(path: Path) -> str | None:
    """The layout of iteration folder `path`, or None when it holds no checkpoint we wrote."""
    if dcp_io.is_dcp(path):
        return TORCH_DIST
    if ckpt.model_file(path, 1).exists():
        return TENSOR_PARALLEL
    if ckpt.model_file(path).exists():
        return SINGLE
    if any(_PIPE_LAYER.fullmatch(p.name) for p in path.glob("layer_*-model_00-model_states.pt")):
        return PIPELINE
    if (path / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists():
        return DEEPSPEED_ZERO3
    if (path / DS_MODEL_FILE).exists():
        return DEEPSPEED
    return None


def _safe_globals() -> list:
    try:
        return deepspeed_safe_globals()
    except ImportError:  # no deepspeed installed: our own layouts need no extra classes
        return []


def load_file(file: Path) -> Any:
    """`torch.load(weights_only=True)` with DeepSpeed's data classes allowed; a clear error otherwise."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickled code objects, or a corrupt file
        raise ckpt.unreadable(file, exc) from exc


def deepspeed_model_files(path: Path) -> list[Path]:
    """mp_rank_00_model_states.pt, mp_rank_01_..., in rank order: one per TP rank of a DeepSpeed (ZeRO 0-2) run."""
    files = []
    while (path / f"mp_rank_{len(files):02d}_model_states.pt").exists():
        files.append(path / f"mp_rank_{len(files):02d}_model_states.pt")
    return files


def _tensor_parallel_shards(path: Path) -> Iterator[dict]:
    rank = 0
    while ckpt.model_file(path, rank).exists():
        yield load_file(ckpt.model_file(path, rank))
        rank += 1


def _pipeline_state(path: Path, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    """GPTModel keys from DeepSpeed's per-layer files: layer 0 is the embedding stage (its keys are already
    `embedding.*`), layers 1..L hold `layer.*` of transformer layer i-1, layer L+1 the final norm and head. With
    tensor parallelism each layer has one file per TP rank (`model_<t>`), merged like our TP shards."""
    num_layers = model_config.num_layers
    files: dict[int, dict[int, Path]] = {}
    for p in path.iterdir():
        if m := _PIPE_LAYER.fullmatch(p.name):
            files.setdefault(int(m.group(2)), {})[int(m.group(1))] = p
    expected = set(range(num_layers + 2))
    if set(files.get(0, {})) != expected:
        raise ckpt.CheckpointError(f"{path}: pipeline layer files {sorted(files.get(0, {}))} do not match a model of "
                                   f"{num_layers} transformer layers (expected layers 0..{num_layers + 1})")
    tp = len(files)
    if set(files) != set(range(tp)) or any(set(files[t]) != expected for t in files):
        raise ckpt.CheckpointError(f"{path}: pipeline layer files of TP ranks {sorted(files)} are incomplete: every "
                                   f"TP rank 0..{tp - 1} needs layers 0..{num_layers + 1}")
    shards = []
    for t in range(tp):
        state: dict[str, torch.Tensor] = {}
        for index, file in sorted(files[t].items()):
            for key, tensor in load_file(file).items():
                if index == 0:
                    name = key
                elif index <= num_layers:
                    name = f"decoder.layers.{index - 1}.{key.removeprefix('layer.')}"
                else:
                    name = key if key.startswith("output_layer.") else f"decoder.{key}"
                state[name] = tensor
        shards.append(state)
    return shards[0] if tp == 1 else merge_state_dicts(shards, model_config)


@contextlib.contextmanager
def _weights_only_torch_load() -> Iterator[None]:
    """Within the block, every torch.load reads weights only (DeepSpeed's consolidation asks for pickles)."""
    real = torch.load
    allowed = _safe_globals()

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            return real(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def _zero3_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise ckpt.CheckpointError(f"{path} is a DeepSpeed ZeRO-3 checkpoint: reading it needs the deepspeed "
                                   "package (pip install deepspeed)") from exc
    try:
        with _weights_only_torch_load():
            # DeepSpeed hands back Parameters (requires_grad=True): the readers want plain tensors.
            state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
            return {k: v.detach() for k, v in state.items()}
    except ckpt.CheckpointError:
        raise
    except Exception as exc:
        raise ckpt.CheckpointError(f"{path}: cannot consolidate the ZeRO-3 partitions: "
                                   f"{exc.__class__.__name__}: {str(exc)[:300]}") from exc


def _deepspeed_state(path: Path, model_config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """The "module" weights of every TP rank's mp_rank_<t>_model_states.pt, merged (one file: TP = 1), and our
    client state from TP rank 0's file."""
    modules, extras = [], {}
    for rank, file in enumerate(deepspeed_model_files(path)):
        data = load_file(file)
        if not data.get("module"):
            raise ckpt.CheckpointError(f"{file} holds no 'module' weights")
        modules.append(dict(data["module"]))
        if rank == 0:
            extras = data.get(CLIENT_KEY, {}) or {}
    state = modules[0] if len(modules) == 1 else merge_state_dicts(modules, model_config)
    return state, extras


def read_model_state(path: Path, model_config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(full-model state dict, our payload extras, layout name) of iteration folder `path`.

    The extras are what the run saved beside the weights (LR schedule, RNG, FP8 scaling state: rank 0's),
    when the layout has them.
    """
    layout = detect_layout(path)
    if layout is None:
        raise ckpt.CheckpointError(f"{path} holds no checkpoint file of a known layout (mp_rank_00/model_optim_rng.pt, "
                                   f"{DS_MODEL_FILE}, zero_pp_rank_0_mp_rank_00_model_states.pt or pipeline "
                                   "layer_*-model_00-model_states.pt)")
    if layout in (SINGLE, TENSOR_PARALLEL):
        shards = list(_tensor_parallel_shards(path))
        if any("model" not in s for s in shards):
            raise ckpt.CheckpointError(f"{path}: a mp_rank_XX/model_optim_rng.pt holds no 'model' state dict")
        state = shards[0]["model"] if len(shards) == 1 else merge_state_dicts([s["model"] for s in shards],
                                                                                model_config)
        return state, {k: v for k, v in shards[0].items() if k != "model"}, layout
    if layout == DEEPSPEED:
        return *_deepspeed_state(path, model_config), layout
    if layout == TORCH_DIST:
        return dcp_io.full_model(path, model_config), dcp_io.read_extras(path), layout
    extras: dict = {}
    # Our client state (LR schedule, RNG, FP8) sits in DeepSpeed's model-states file (rank 0's under ZeRO-3).
    model_states = path / (DS_MODEL_FILE if layout != DEEPSPEED_ZERO3 else "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if model_states.exists():
            extras = load_file(model_states).get(CLIENT_KEY, {}) or {}
    if layout == PIPELINE:
        return _pipeline_state(path, model_config), extras, layout
    return _zero3_state(path), extras, layout


def resolve_checkpoint_dir(load: str | Path, iteration: Optional[int] = None) -> Path:
    """The `iter_XXXXXXX` folder meant by `--load DIR [--iteration N]`; raises naming what is missing."""
    root = Path(load)
    if detect_layout(root) is not None:  # already an iteration folder
        if iteration is not None:
            raise ValueError(f"--load {root} is an iteration folder itself: drop --iteration, or pass its run folder")
        return root
    if not root.is_dir():
        raise FileNotFoundError(f"--load {root} does not exist")
    if iteration is None:
        iteration = ckpt.read_tracker(root)
        if iteration is None:
            raise FileNotFoundError(f"--load {root} holds no {ckpt.TRACKER_FILE} and no checkpoint files: pass a "
                                    "run's --save folder or one of its iter_* folders")
    path = ckpt.iteration_dir(root, iteration)
    if detect_layout(path) is None:
        available = sorted(p.name for p in root.glob("iter_*"))
        raise FileNotFoundError(f"{path} holds no checkpoint (iteration {iteration}); available: {available or 'none'}")
    return path


def read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(payload, config dict, train state) of an iteration folder of any layout (this file), loaded without
    running code; payload["model"] is the merged full-model state dict, payload["layout"] the layout's name."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ckpt.CheckpointError(f"{config_file} is missing: the model shape cannot be known without it")
    config = ckpt.read_json(config_file)
    state, extras, layout = read_model_state(path, model_config_from_dict(config, path))
    state_file = path / "train_state.json"
    train_state = ckpt.read_json(state_file) if state_file.exists() else {}
    return {**extras, "model": state, "layout": layout}, config, train_state
