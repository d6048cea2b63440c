"""The index construction with whole int64 arrays, kept as the reference that the
chunked construction (`megatron.data.gpt_index`, `megatron.data.blended_dataset`) must reproduce value for
value. Used by tests/unit/test_index_memory.py and, for the memory table's `--old` rows, bench/bench_index_build.py."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose token stream yields `num_samples` samples of `seq_length + 1` tokens."""
    # Samples available from e epochs: (e * T - 1) // L (the last sample needs one extra token).
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.Generator) -> np.ndarray:
    """`documents` repeated `num_epochs` times, each repetition in its own random order."""
    tiled = np.broadcast_to(documents.astype(np.int32), (num_epochs, len(documents)))
    return rng.permuted(tiled, axis=1).reshape(-1)


def build_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """(position in `doc_idx`, offset) of the first token of samples 0..num_samples (inclusive)."""
    # cum[k] = stream position of the first token of doc_idx[k]; cum[-1] = stream length.
    cum = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=cum[1:])
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if num_samples and starts[-1] >= cum[-1]:
        raise ValueError(f"{num_samples} samples of {seq_length} tokens need more than the {cum[-1]} tokens given")
    # side="right" skips empty documents, as Megatron's loop does.
    position = np.searchsorted(cum, starts, side="right") - 1
    sample_idx = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_idx[:, 0] = position
    sample_idx[:, 1] = starts - cum[position]
    return sample_idx


def build_shuffle_index(num_samples: int, seq_length: int, tokens_per_epoch: int,
                        rng: np.random.Generator) -> np.ndarray:
    """A permutation of the samples that only mixes samples of the same epoch."""
    # Sample i belongs to the epoch holding its first token.
    num_epochs = (max(num_samples - 1, 0) * seq_length) // tokens_per_epoch + 1
    if num_epochs <= 1024:  # few epochs: one permutation each (faster than a global sort)
        first = -(-np.arange(num_epochs + 1, dtype=np.int64) * tokens_per_epoch // seq_length)
        first[-1] = num_samples
        shuffle = np.empty(num_samples, dtype=np.int64)
        for a, b in zip(first[:-1], first[1:]):
            shuffle[a:b] = a + rng.permutation(b - a)
        return shuffle
    # Many tiny epochs: sorting epoch + U[0, 1) keys shuffles inside epochs and keeps their order.
    epoch = np.arange(num_samples, dtype=np.int64) * seq_length // tokens_per_epoch
    return np.argsort(epoch + rng.random(num_samples))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                      seed: int) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices for at least `num_samples` samples (pure function)."""
    if seq_length <= 0:
        raise ValueError(f"--seq-length must be positive, got {seq_length}")
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError("the selected documents hold no tokens")
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    rng = np.random.default_rng(seed)
    doc_idx = build_document_index(documents, num_epochs, rng)
    sample_idx = build_sample_index(sizes, doc_idx, seq_length, total_samples)
    shuffle_idx = build_shuffle_index(total_samples, seq_length, tokens_per_epoch, rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


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
