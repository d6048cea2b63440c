"""Blending several datasets with weights (`--data-path 0.3 A 0.7 B`).

Sample i of the blend is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`. The
assignment keeps every prefix of the run on the weights: after n samples, dataset k has been drawn
within about one sample of `n * w_k` (at most `(1 + K * w_k) / 2` off for K datasets), so the
weights hold over any stretch of training, not only on average.

Megatron-LM gets this with a greedy C++ loop (each step picks the dataset lagging furthest behind
its target). We compute an equivalent error-minimising schedule without a loop over samples:
dataset k's j-th sample is due at "time" `(j + 0.5) / w_k`, and the blend takes all due times in
order (a stable sort, ties going to the earlier dataset). It is deterministic and O(n log n) in numpy;
the exact tie-breaking differs from Megatron's loop, so the order is not bit-identical to it. The due
times are sorted window by window (bounded memory at 488M samples), written to the cache as they come.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron.data.gpt_index import CHUNK, MemorySinks, SinkFactory, index_dtype


def _normalised(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    return w / w.sum()


def write_blending_indices(weights: Sequence[float], size: int, sinks: SinkFactory) -> np.ndarray:
    """Build (dataset_index, dataset_sample_index) for a blend of `size` samples into `sinks`; returns the
    number of samples drawn from each dataset.

    Dataset k's j-th sample is due at `(j + 0.5) / w_k`; the blend is the `size` earliest due times in a
    stable order (ties: the earlier dataset, then the earlier sample). They are taken window by window of
    about CHUNK due times, so memory stays bounded whatever `size`: a window holds the due times in
    [t0, t0 + CHUNK), computed exactly as a whole-array construction computes them, so the order is the same.
    """
    w = _normalised(weights)
    # Dataset k never takes more than size * w_k + 1 + K/2 of the first `size` samples.
    limits = [int(np.ceil(size * wk)) + len(w) + 1 if wk > 0 else 0 for wk in w]
    owner_dtype = np.dtype(np.int16 if len(w) < 2**15 else np.int32)
    index_sink = sinks.create("dataset_index", owner_dtype, (size,))
    sample_sink = sinks.create("dataset_sample_index", index_dtype(max(max(limits) - 1, 0)), (size,))
    counts = np.zeros(len(w), dtype=np.int64)
    t0, emitted = 0.0, 0
    while emitted < size:
        t1 = t0 + CHUNK
        due, owner, rank = [], [], []
        for k, wk in enumerate(w):
            if wk == 0:
                continue
            # Candidates from a float estimate, widened; the exact due times decide membership.
            lo = max(0, int(np.floor(t0 * wk - 0.5)) - 2)
            hi = min(limits[k], int(np.ceil(t1 * wk - 0.5)) + 2)
            if lo >= hi:
                continue
            j = np.arange(lo, hi, dtype=np.int64)
            d = (j + 0.5) / wk
            keep = (d >= t0) & (d < t1)
            due.append(d[keep])
            owner.append(np.full(int(keep.sum()), k, dtype=owner_dtype))
            rank.append(j[keep])
        if due:
            order = np.argsort(np.concatenate(due), kind="stable")[:size - emitted]
            chosen_owner, chosen_rank = np.concatenate(owner)[order], np.concatenate(rank)[order]
            index_sink.append(chosen_owner)
            sample_sink.append(chosen_rank)
            counts += np.bincount(chosen_owner, minlength=len(w))
            emitted += len(order)
        t0 = t1
    index_sink.close()
    sample_sink.close()
    return counts


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for a blend of `size` samples, in memory."""
    sinks = MemorySinks()
    write_blending_indices(weights, size, sinks)
    return sinks.arrays["dataset_index"], sinks.arrays["dataset_sample_index"]


def samples_per_dataset(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """How many samples the blend draws from each dataset (chunked: no intp copy of a long index)."""
    counts = np.zeros(num_datasets, dtype=np.int64)
    for start in range(0, len(dataset_index), CHUNK):
        counts += np.bincount(dataset_index[start:start + CHUNK], minlength=num_datasets)
    return counts


class BlendedDataset:
    """Map-style blend of datasets that each return `{"text": ...}`."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray, counts: Optional[np.ndarray] = None) -> None:
        """`counts`: `samples_per_dataset(dataset_index, ...)` where the caller has counted already."""
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        # the samples the blend draws from each dataset (a pass over the index, made once)
        self.counts = samples_per_dataset(dataset_index, len(datasets)) if counts is None else counts
        for k, (ds, needed) in enumerate(zip(self.datasets, self.counts)):
            if needed and (ds is None or len(ds) < needed):
                raise ValueError(f"blended dataset {k} has {0 if ds is None else len(ds)} samples, "
                                 f"the blend needs {needed}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a blend of {len(self)} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
