"""Perplexity of a checkpoint on an indexed dataset (as training evaluates) or on a text/JSONL file.

Indexed data (`.bin/.idx`) is read through the training pipeline itself: the same `GPTDataset`
samples of `seq_length + 1` tokens (same seed, same shuffle), the same `make_batch` (loss mask,
`--eod-mask-loss`, position-id and attention-mask resets as the checkpoint was trained with) and the
same token-weighted mean over the first N samples as `Trainer.evaluate`. With N = the run's
`eval_iters * global_batch_size` the result is the run's validation loss; by default N is every
sample of one pass over the data. While N fits in one epoch the first N samples do not depend on N,
so smaller N evaluate a prefix of the same ordering.

Raw text is tokenized document by document (one JSONL object or one text line each), an
end-of-document token is appended after each document (as `preprocess_data.py --append-eod` does)
and one is put first, and the stream is cut into disjoint windows of `seq_length` predicted tokens:
every token is scored once. Bits per byte (UTF-8 bytes of the documents) is reported too, since it
compares across tokenizers where perplexity does not.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from megatron.accelerator import bf16_autocast
from megatron.config import DataConfig
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.provider import make_batch
from megatron.data.text_input import iter_documents
from megatron.evaluation.scoring import rolling_windows, score_windows


@dataclass(frozen=True)
class PerplexityResult:
    loss: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    samples: int
    bytes: Optional[int] = None  # UTF-8 bytes of the text (raw-text evaluation only)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> Optional[float]:
        if not self.bytes:
            return None
        return self.loss * self.tokens / (math.log(2) * self.bytes)

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), perplexity=self.perplexity, bits_per_byte=self.bits_per_byte)


def _tokens_in(prefixes: Sequence[str]) -> int:
    return sum(int(MMapIndexedDataset(p).sizes.sum(dtype=np.int64)) for p in prefixes)


def one_epoch_samples(prefixes: Sequence[str], seq_length: int) -> int:
    """Samples of `seq_length + 1` tokens in one pass over `prefixes` (the default N)."""
    return (_tokens_in(prefixes) - 1) // seq_length


def indexed_perplexity(model: nn.Module, data_path: Sequence[str], data: DataConfig, tokenizer, seq_length: int,
                       seed: int, num_samples: Optional[int] = None, micro_batch_size: int = 4,
                       bf16: bool = False) -> PerplexityResult:
    """Token-weighted loss over the first `num_samples` samples of `data_path` (a prefix or a blend)."""
    from megatron.data.gpt_dataset import build_train_valid_test_datasets, parse_blend

    prefixes, _ = parse_blend(data_path, "--data-path")
    if num_samples is None:
        num_samples = one_epoch_samples(prefixes, seq_length)
    if num_samples < 1:
        raise ValueError(f"--data-path {' '.join(data_path)} holds fewer than seq_length + 1 = {seq_length + 1} "
                         "tokens: nothing to evaluate")
    # The data sits in the "valid" slot so the samples are built exactly as a run's validation set.
    cfg = dataclasses.replace(data, data_path=(), train_data_path=(), valid_data_path=tuple(data_path),
                              test_data_path=())
    _, dataset, _ = build_train_valid_test_datasets(cfg, tokenizer, seq_length, seed, (0, num_samples, 0))
    return dataset_perplexity(model, dataset, num_samples, data, tokenizer, micro_batch_size, bf16)


def split_perplexity(model: nn.Module, data: DataConfig, split: str, tokenizer, seq_length: int, seed: int,
                     num_samples: Optional[int] = None, micro_batch_size: int = 4,
                     bf16: bool = False) -> PerplexityResult:
    """Token-weighted loss over the first `num_samples` samples (default: one pass) of the run's `split` ("train",
    "valid" or "test"), cut from `data` as training cut it (`--split` over `--data-path`, or the per-split paths):
    the same samples the run's own evaluations read."""
    from megatron.data.gpt_dataset import SPLIT_NAMES, build_train_valid_test_datasets
    from megatron.data.split_size import split_size

    k = SPLIT_NAMES.index(split)

    def build(n: int):
        wanted = [0, 0, 0]
        wanted[k] = n
        return build_train_valid_test_datasets(data, tokenizer, seq_length, seed, tuple(wanted))[k]

    # A GPT index holds whole epochs: one built for a single sample holds the split's first pass already, and the
    # first samples of an epoch do not depend on how many were asked for. A blend's index holds what was asked.
    dataset = build(num_samples or 1)
    if dataset is None:
        raise ValueError(f"the run's {split} split holds no data (--split {data.split}): nothing to evaluate")
    if num_samples is None:
        num_samples = split_size(dataset, seq_length).one_pass
        if num_samples and hasattr(dataset, "dataset_index"):  # a blend: its exact pass, found in its index
            dataset = build(num_samples + 1)
            num_samples = min(num_samples, split_size(dataset, seq_length, scan=len(dataset)).one_pass)
    if num_samples < 1:
        raise ValueError(f"the run's {split} split holds fewer than seq_length + 1 = {seq_length + 1} tokens: nothing "
                         f"to evaluate (--split {data.split})")
    return dataset_perplexity(model, dataset, num_samples, data, tokenizer, micro_batch_size, bf16)


@torch.no_grad()
def dataset_perplexity(model: nn.Module, dataset, num_samples: int, data: DataConfig, tokenizer,
                       micro_batch_size: int = 4, bf16: bool = False) -> PerplexityResult:
    """Token-weighted loss over the first `num_samples` samples of a built dataset, batched as training batches."""
    device = next(model.parameters()).device
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, num_samples, micro_batch_size):
        rows = [dataset[i]["text"] for i in range(start, min(start + micro_batch_size, num_samples))]
        batch = make_batch(torch.from_numpy(np.stack(rows)), tokenizer.eod, data).to(device)
        autocast = bf16_autocast(device.type, bf16)
        with autocast:
            per_token = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        masked = (per_token * batch.loss_mask).sum()
        total += torch.stack([masked.double().cpu(), batch.loss_mask.sum().double().cpu()])
    count = int(total[1].item())
    return PerplexityResult(loss=float(total[0] / total[1].clamp(min=1.0)), tokens=count, samples=num_samples)


def text_token_stream(path: str, tokenizer, json_key: str = "text",
                      max_documents: Optional[int] = None) -> tuple[list[int], int, int]:
    """([eod] + doc1 + [eod] + doc2 + [eod] ..., number of documents, UTF-8 bytes) of a text/JSONL file."""
    stream, docs, size = [tokenizer.eod], 0, 0
    for doc in iter_documents(path, [json_key]):
        if max_documents is not None and docs >= max_documents:
            break
        text = doc[json_key]
        stream += tokenizer.tokenize(text) + [tokenizer.eod]
        docs += 1
        size += len(text.encode("utf-8"))
    if docs == 0:
        raise ValueError(f"{path} holds no documents (blank file, or no {json_key!r} key: see --json-key)")
    return stream, docs, size


def text_perplexity(model: nn.Module, path: str, tokenizer, seq_length: int, json_key: str = "text",
                    batch_size: int = 4, max_documents: Optional[int] = None, bf16: bool = False) -> PerplexityResult:
    """Perplexity of every token of a text/JSONL file (see the module docstring for the construction)."""
    stream, _, size = text_token_stream(path, tokenizer, json_key, max_documents)
    windows = rolling_windows(stream, seq_length)
    scores = score_windows(model, windows, batch_size, bf16=bf16)
    tokens = len(stream) - 1
    return PerplexityResult(loss=-sum(s for s, _ in scores) / tokens, tokens=tokens, samples=len(windows),
                            bytes=size)
