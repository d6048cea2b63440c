"""Data pipeline: Megatron `.bin/.idx` datasets, GPT samples, blends, preprocessing.

* `indexed_dataset`: the mmap token format (reader `MMapIndexedDataset`, writer `MMapIndexedDatasetBuilder`);
* `manifest`: the file that makes a `.bin/.idx` pair's publication atomic and records its token-id range;
* `token_range`: every token id checked against the tokenizer before training (manifest, or one cached scan);
* `errors`: `DataError` and its kinds, printed by the entry points without a traceback;
* `gpt_dataset`: `GPTDataset` and `build_train_valid_test_datasets(cfg.data, tokenizer, ...)`;
* `gpt_index`: its document / sample / shuffle indices, built in bounded memory straight into the cache;
* `blended_dataset`: weighted blends; `index_cache`: the cached index arrays;
* `preprocess`, `text_input`, `parquet_input`: raw JSONL/text, Parquet and Arrow to `.bin/.idx`
  (tools/preprocess_data.py);
* `split_size`: a split's documents, tokens and samples per pass (the start-up lines, evaluate.py --split);
* `provider`, `mock`: batches, samplers and the synthetic dataset (separate owners).
"""
import importlib

# Exported lazily: importing one submodule (the index builder in a memory-limited child, the tools) must not
# import them all (gpt_dataset pulls in megatron.config, and with it torch).
_EXPORTS = {"BlendedDataset": "blended_dataset", "GPTDataset": "gpt_dataset",
            "build_train_valid_test_datasets": "gpt_dataset", "MMapIndexedDataset": "indexed_dataset",
            "MMapIndexedDatasetBuilder": "indexed_dataset"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
