"""From datasets to training batches: the data-parallel sampler, batch construction, iterators.

Data order is a pure function of the number of consumed samples (kept in the train state), which
is what makes resume exact: after loading a checkpoint the sampler starts at the same index the
uninterrupted run would have reached. Each global batch is split across data-parallel ranks as
Megatron does: consecutive chunks of `micro_batch_size * dp` samples, rank r taking slice r.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from megatron.config import DataConfig


class PretrainingSampler:
    """Yields the sample indices of this rank's micro-batches, starting at `consumed_samples`."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1) -> None:
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the dataset's {total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.dp = data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp)

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.micro_batch_size * self.dp
        for start in range(self.consumed_samples, self.total_samples - chunk + 1, chunk):
            first = start + self.rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))


def _collate(samples: list[dict]) -> torch.Tensor:
    return torch.from_numpy(np.stack([s["text"] for s in samples]).astype(np.int64))


def build_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 num_workers: int = 0) -> DataLoader:
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    # A private generator: creating a DataLoader iterator otherwise draws from the global torch RNG,
    # which would shift the dropout masks of a resumed run against the uninterrupted one.
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=_collate, num_workers=num_workers,
                      persistent_workers=False, generator=torch.Generator().manual_seed(0))


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod: Optional[int], eod_mask_loss: bool,
                                    reset_position_ids: bool, reset_attention_mask: bool
                                    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Loss mask, position ids and (only with `--reset-attention-mask`) a boolean attention mask.

    The attention mask is [b, 1, s, s], True where attention is allowed: causal, and with
    document resets no token attends across an end-of-document token.
    """
    b, s = tokens.shape
    loss_mask = torch.ones(b, s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).repeat(b, 1)
    attention_mask = None
    if reset_position_ids or reset_attention_mask:
        # Document id of each position: the number of EODs strictly before it.
        is_eod = (tokens == eod).long()
        doc_id = torch.cumsum(is_eod, dim=1) - is_eod
        if reset_position_ids:
            # Position = index minus the index where the current document started.
            idx = torch.arange(s).unsqueeze(0).expand(b, s)
            starts = torch.where(torch.cat([torch.ones(b, 1, dtype=torch.bool), is_eod[:, :-1].bool()], 1),
                                 idx, torch.zeros_like(idx))
            position_ids = idx - torch.cummax(starts, dim=1).values
        if reset_attention_mask:
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            same_doc = doc_id.unsqueeze(2) == doc_id.unsqueeze(1)
            attention_mask = (causal.unsqueeze(0) & same_doc).unsqueeze(1)
    return loss_mask, position_ids, attention_mask


@dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]

    def to(self, device: torch.device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.tokens), move(self.labels), move(self.loss_mask), move(self.position_ids),
                     move(self.attention_mask))


def make_batch(text: torch.Tensor, eod: Optional[int], cfg: DataConfig) -> Batch:
    """Split `seq_length + 1` token rows into inputs and shifted labels, with masks."""
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    loss_mask, position_ids, attention_mask = get_ltor_masks_and_position_ids(
        tokens, eod, cfg.eod_mask_loss, cfg.reset_position_ids, cfg.reset_attention_mask)
    return Batch(tokens, labels, loss_mask, position_ids, attention_mask)
