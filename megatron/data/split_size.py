"""How much data a split holds: documents, tokens, and the samples of one pass before any token is read again.

A `GPTDataset` of T tokens yields (T - 1) // L samples of L + 1 tokens per pass; its shuffle mixes samples within
an epoch only, so its first `one_pass` samples are distinct. A blend's pass ends where its first part starts its
second pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class SplitSize:
    """The data behind one split. `documents`/`tokens`/`one_pass` are None for --mock-data (fresh samples forever)."""

    samples: int  # samples the split's index holds (what the run can read)
    documents: Optional[int] = None
    tokens: Optional[int] = None
    one_pass: Optional[int] = None  # distinct samples before any token of the split is read again

    def passes(self, samples: int) -> Optional[float]:
        if self.one_pass is None:
            return None
        return float("inf") if self.one_pass == 0 else samples / self.one_pass


def _gpt_size(ds, seq_length: int) -> SplitSize:
    start, end = ds.documents
    tokens = ds.tokens
    # e passes over T tokens give (e * T - 1) // L samples of L + 1 tokens (megatron/data/gpt_index.py)
    return SplitSize(len(ds), end - start, tokens, max(0, (tokens - 1) // seq_length))


def split_size(ds, seq_length: int, scan: int = 0) -> SplitSize:
    """The size of a GPTDataset, of a blend of them, or of mock data.

    A blend's pass ends where its first part starts its second pass: exactly, where that happens within the first
    `scan` samples of the blend (found in its index); otherwise from the parts' shares (a log line's estimate)."""
    if hasattr(ds, "indexed_dataset"):
        return _gpt_size(ds, seq_length)
    if not hasattr(ds, "dataset_index"):
        return SplitSize(len(ds))
    counts = ds.counts
    sizes = [None if part is None else _gpt_size(part, seq_length) for part in ds.datasets]
    # Each part's samples come in its shuffle order, epoch by epoch: its sample one_pass is its second pass's first.
    limits = np.array([0 if size is None else size.one_pass for size in sizes], dtype=np.int64)
    head = slice(0, min(scan, len(ds)))
    repeats = np.flatnonzero(np.asarray(ds.dataset_sample_index[head]) >= limits[np.asarray(ds.dataset_index[head])])
    kept = [(size, int(n)) for size, n in zip(sizes, counts) if size is not None]
    if len(repeats):
        one_pass = int(repeats[0])
    else:
        one_pass = min((size.one_pass * len(ds) // n for size, n in kept if n), default=0)
    return SplitSize(len(ds), sum(size.documents for size, _ in kept), sum(size.tokens for size, _ in kept), one_pass)
