"""Data pipeline: Megatron `.bin/.idx` datasets, GPT samples, blends, preprocessing.

* `indexed_dataset`: the mmap token format (reader `MMapIndexedDataset`, writer `MMapIndexedDatasetBuilder`);
* `manifest`: the file that makes a `.bin/.idx` pair's publication atomic and records its token-id range;
* `token_range`: every token id checked against the tokenizer before training (manifest, or one cached scan);
* `errors`: `DataError` and its kinds, printed by the entry points without a traceback;
* `gpt_dataset`: `GPTDataset` and `build_train_valid_test_datasets(cfg.data, tokenizer, ...)`;
* `blended_dataset`: weighted blends; `index_cache`: the cached index arrays;
* `preprocess`, `text_input`: raw JSONL/text to `.bin/.idx` (tools/preprocess_data.py);
* `provider`, `mock`: batches, samplers and the synthetic dataset (separate owners).
"""
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

__all__ = ["BlendedDataset", "GPTDataset", "MMapIndexedDataset", "MMapIndexedDatasetBuilder",
           "build_train_valid_test_datasets"]
