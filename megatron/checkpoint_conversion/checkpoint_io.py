"""Rebuild a `GPTModel` (and its config slices) from one of our checkpoints, and write converted ones.

Tools that only need the weights (export, evaluation, generation) use `load_gpt_checkpoint`: it
finds the checkpoint (a run's `--save` folder through its tracker file, a run folder plus an
iteration, or an `iter_XXXXXXX` folder itself), of any layout the trainer writes (single process, TP
shards, DeepSpeed ZeRO 0-3, pipeline stages: `layouts.py` merges them), with `torch.load(weights_only=True)`,
rebuilds `ModelConfig`/`DataConfig`/`TrainingConfig` from the checkpoint's `config.json` (the
resolved `MegatronConfig.to_dict()`, never a pickled Namespace) and loads the weights strictly.
Optimizer, RNG and FP8 scaling state are ignored.

`save_converted_checkpoint` writes iteration 0 in the layout of `megatron.checkpoint.store`,
so `pretrain_gpt.py --load DIR` (optionally with `--finetune`) starts from converted weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron.checkpoint import store as ckpt
from megatron.checkpoint.configs import config_from_dict, data_config_from_dict, model_config_from_dict
from megatron.checkpoint.layouts import read_checkpoint, resolve_checkpoint_dir
from megatron.checkpoint.train_state import TrainState
from megatron.config import (
    CheckpointConfig, DataConfig, LoggingConfig, LrDecayStyle, MegatronConfig, ModelConfig, OptimizerConfig,
    ParallelConfig, SchedulerConfig, TrainingConfig,
)
from megatron.model import GPTModel

__all__ = ["LoadedCheckpoint", "load_gpt_checkpoint", "read_checkpoint", "resolve_checkpoint_dir",
           "save_converted_checkpoint"]


@dataclass
class LoadedCheckpoint:
    """A model rebuilt from a checkpoint, with the config slices the tools need."""

    model: GPTModel
    model_config: ModelConfig
    data_config: DataConfig
    training_config: Optional[TrainingConfig]
    iteration: int
    path: Path
    train_state: dict
    raw_config: dict


def load_gpt_checkpoint(load: str | Path, iteration: Optional[int] = None,
                        device: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Rebuild the `GPTModel` of a checkpoint in eval mode, FP32 weights as saved, on `device`."""
    path = resolve_checkpoint_dir(load, iteration)
    payload, config, train_state = read_checkpoint(path)
    model_config = model_config_from_dict(config, path)
    data_config = data_config_from_dict(config, path)
    training = config.get("training")
    training_config = config_from_dict(TrainingConfig, training, path) if training else None
    model = GPTModel(model_config)
    ckpt.load_model_state(model, payload["model"], path)
    model.to(device).eval()
    return LoadedCheckpoint(model=model, model_config=model_config, data_config=data_config,
                            training_config=training_config, iteration=int(payload.get("iteration", train_state.get("iteration", 0))),
                            path=path, train_state=train_state, raw_config=config)


def converted_megatron_config(model: ModelConfig, data: DataConfig) -> MegatronConfig:
    """A `MegatronConfig` for a checkpoint made by conversion: the model and tokenizer are real, the
    training slices are placeholders (nothing was trained; the next run's flags define them)."""
    return MegatronConfig(
        model=model, optimizer=OptimizerConfig(lr=0.0),
        scheduler=SchedulerConfig(lr=0.0, min_lr=0.0, decay_style=LrDecayStyle.CONSTANT, warmup_iters=0,
                                  decay_iters=0),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=1, data_parallel_size=1, train_iters=0),
        checkpoint=CheckpointConfig(), logging=LoggingConfig(), data=data, parallel=ParallelConfig())


def save_converted_checkpoint(save_dir: str | Path, state: dict[str, torch.Tensor], model: ModelConfig,
                              data: DataConfig, source: str) -> Path:
    """Write `state` as iteration 0 of `save_dir` (weights only: no optimizer, RNG or FP8 state)."""
    with torch.device("meta"):  # shapes only: fail here rather than at the next training launch
        expected = {k: tuple(v.shape) for k, v in GPTModel(model).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        wrong = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        raise ckpt.CheckpointError(f"converted tensors do not fit GPTModel({model}): "
                                   + ", ".join(f"{k}: {got.get(k)} vs {expected.get(k)}" for k in wrong[:6]))
    payload = {"model": {k: v.detach().contiguous() for k, v in state.items()}, "converted_from": source}
    return ckpt.save_checkpoint(save_dir, 0, payload, TrainState().to_dict(),
                                converted_megatron_config(model, data).to_dict())
