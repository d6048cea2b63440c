"""Config slices rebuilt from a checkpoint's `config.json` (the resolved `MegatronConfig.to_dict()`, never a pickled
Namespace): what the readers need to interpret the files (the model's shapes) without building a model."""
from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any, Optional

from megatron.checkpoint.store import CheckpointError
from megatron.config import (
    DataConfig, ModelConfig, Normalization, PositionEmbedding, RecomputeGranularity, SmoothSwiGLUGranularity,
)

_MODEL_ENUMS: dict[str, type[enum.Enum]] = {
    "normalization": Normalization, "position_embedding_type": PositionEmbedding,
    "recompute_granularity": RecomputeGranularity, "smooth_swiglu": SmoothSwiGLUGranularity,
}


def config_from_dict(cls: type, data: dict[str, Any], source: Path, enums: Optional[dict] = None):
    """`cls(**data)` for a frozen config dataclass: enum values back to enums, lists to tuples."""
    enums = enums or {}
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        if name not in known:
            continue  # written by a newer version: a field we do not need to rebuild the model
        if name in enums and value is not None:
            value = enums[name](value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: cannot rebuild {cls.__name__} from its config.json ({err}); "
                                   "was the checkpoint written by megatron-fp8?") from None


def model_config_from_dict(config: dict[str, Any], source: Path) -> ModelConfig:
    if "model" not in config:
        raise CheckpointError(f"{source} has no model section in config.json: cannot rebuild the model "
                                   "(checkpoints written by pretrain_gpt.py always have one)")
    return config_from_dict(ModelConfig, config["model"], source, _MODEL_ENUMS)


def data_config_from_dict(config: dict[str, Any], source: Path) -> DataConfig:
    return config_from_dict(DataConfig, config.get("data", {}), source)


