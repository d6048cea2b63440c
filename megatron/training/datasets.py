"""Choose and build the train/valid/test datasets of a run (mock data or indexed `.bin/.idx` data)."""
from __future__ import annotations

from typing import Optional

from megatron.config import MegatronConfig
from megatron.data.mock import MockGPTDataset


def build_datasets(config: MegatronConfig, tokenizer=None) -> tuple:
    """(train, valid, test, eod) sized for `--train-iters` and `--eval-iters` global batches.

    Validation and test always use the first `eval_iters` global batches of their split, so every
    evaluation of a run (and of a run it is compared with) sees the same samples.
    """
    t, d, m = config.training, config.data, config.model
    n_train = t.train_iters * t.global_batch_size
    n_eval = t.eval_iters * t.global_batch_size
    if d.mock_data:
        vocab = d.vocab_size
        return (MockGPTDataset(vocab, m.seq_length, n_train, t.seed),
                MockGPTDataset(vocab, m.seq_length, n_eval, t.seed, split=1) if n_eval else None,
                MockGPTDataset(vocab, m.seq_length, n_eval, t.seed, split=2) if n_eval else None,
                None)
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    from megatron.tokenizer import build_tokenizer

    if tokenizer is None:
        tokenizer = build_tokenizer(d)
    train, valid, test = build_train_valid_test_datasets(d, tokenizer, m.seq_length, t.seed,
                                                         (n_train, n_eval, n_eval))
    if train is None:
        raise ValueError("no training data: pass --data-path or --train-data-path (or --mock-data for a synthetic run)")
    return train, _none_if_empty(valid, n_eval), _none_if_empty(test, n_eval), tokenizer.eod


def _none_if_empty(ds: Optional[object], wanted: int) -> Optional[object]:
    return ds if (ds is not None and wanted > 0 and len(ds) > 0) else None
