"""A synthetic, learnable token dataset for `--mock-data` runs and tests.

Each sample is a pure function of (seed, index), so any sample can be regenerated at any time:
resuming at consumed sample N needs no state. Tokens follow a fixed random successor table with a
little noise, which a small model learns quickly: the loss falls clearly, unlike on uniform noise.
"""
from __future__ import annotations

import numpy as np


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int, split: int = 0,
                 noise: float = 0.1) -> None:
        if vocab_size < 4:
            raise ValueError(f"--vocab-size must be >= 4 for --mock-data, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.split = split  # 0 train, 1 valid, 2 test: same language, different samples
        self.noise = noise
        # The "language": each token has one likely successor.
        self.successor = np.random.default_rng(seed).permutation(vocab_size).astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng((self.seed, self.split, index))
        n = self.seq_length + 1
        random_tokens = rng.integers(0, self.vocab_size, size=n)
        use_random = rng.random(n) < self.noise
        text = np.empty(n, dtype=np.int64)
        text[0] = random_tokens[0]
        for i in range(1, n):  # tiny sequences in tests and demos; clarity over vectorisation
            text[i] = random_tokens[i] if use_random[i] else self.successor[text[i - 1]]
        return {"text": text}
