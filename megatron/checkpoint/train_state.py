"""Runtime counters of a run, saved in checkpoints as plain data (never stashed on args or the model)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consecutive_nan_iterations: int = 0
    # False when saved while the divergence guard saw the run going wrong (a resume then picks a healthy one)
    healthy: bool = True

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainState":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"train state in checkpoint has unknown fields {sorted(unknown)}; "
                             "was it written by a newer megatron-fp8?")
        return cls(**{k: (bool(v) if k == "healthy" else int(v)) for k, v in data.items()})
