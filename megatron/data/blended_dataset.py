"""Blending several datasets with weights (`--data-path 0.3 A 0.7 B`).

Sample i of the blend is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`. The
assignment keeps every prefix of the run on the weights: after n samples, dataset k has been drawn
within about one sample of `n * w_k` (at most `(1 + K * w_k) / 2` off for K datasets), so the
weights hold over any stretch of training, not only on average.

Megatron-LM gets this with a greedy C++ loop (each step picks the dataset lagging furthest behind
its target). We compute an equivalent error-minimising schedule without a loop over samples:
dataset k's j-th sample is due at "time" `(j + 0.5) / w_k`, and the blend takes all due times in
order (a stable sort, ties going to the earlier dataset). It is deterministic and O(n log n) in numpy;
the exact tie-breaking differs from Megatron's loop, so the order is not bit-identical to it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for a blend of `size` samples."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    w = w / w.sum()
    due, owner, rank = [], [], []
    for k, wk in enumerate(w):
        if wk == 0:
            continue
        # Dataset k never takes more than size * w_k + 1 + K/2 of the first `size` samples.
        count = int(np.ceil(size * wk)) + len(w) + 1
        j = np.arange(count, dtype=np.int64)
        due.append((j + 0.5) / wk)
        owner.append(np.full(count, k, dtype=np.int16))
        rank.append(j)
    order = np.argsort(np.concatenate(due), kind="stable")[:size]
    return np.concatenate(owner)[order], np.concatenate(rank)[order]


class BlendedDataset:
    """Map-style blend of datasets that each return `{"text": ...}`."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        counts = np.bincount(np.asarray(dataset_index), minlength=len(datasets))
        for k, (ds, needed) in enumerate(zip(self.datasets, counts)):
            if needed and (ds is None or len(ds) < needed):
                raise ValueError(f"blended dataset {k} has {0 if ds is None else len(ds)} samples, "
                                 f"the blend needs {needed}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a blend of {len(self)} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
