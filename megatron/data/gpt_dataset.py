"""GPT pretraining samples over an indexed dataset, with Megatron's three indices.

A sample is `seq_length + 1` consecutive tokens of a stream made by concatenating documents, so
samples cross document boundaries and consecutive samples share one token (input/label shift).
Three arrays define the samples, as in Megatron-LM's GPTDataset:

* document index: the split's documents repeated for as many epochs as needed to produce the
  requested number of samples, each epoch independently shuffled;
* sample index: `[num_samples + 1, 2]` (position in the document index, token offset) of each
  sample start; sample i starts at token `i * seq_length` of the stream;
* shuffle index: a permutation of the samples, shuffled within each epoch, so every sample of an
  epoch is seen before any sample of the next.

Megatron builds the sample index with a C++ loop over samples; here the same positions come from
a `cumsum` over document lengths and a `searchsorted`, chunk by chunk, in dtypes as narrow as the
values allow, written to the cache as they are built (`megatron.data.gpt_index`: bounded memory at
2T tokens; bench/bench_index_build.py). Indices are cached by `megatron.data.index_cache`. Dataset selection (`--data-path`, `--split`, per-split
paths, blends) is in `build_train_valid_test_datasets`, which also checks every token id of every
file against the tokenizer (`megatron.data.token_range`) and says which file leaves a split empty.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import numpy as np

from megatron.config import DataConfig
from megatron.data.blended_dataset import BlendedDataset, samples_per_dataset, write_blending_indices
from megatron.data.errors import DataError
from megatron.data.gpt_index import (  # noqa: F401  (re-exported: the index functions' former home)
    build_gpt_indices,
    build_sample_index,
    build_shuffle_index,
    num_epochs_for,
    write_gpt_indices,
)
from megatron.data.index_cache import array_digest, load_or_build, resolve_cache_dir
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.token_range import check_token_ids

logger = logging.getLogger(__name__)

INDEX_FORMAT_VERSION = 1  # bump when the index construction changes: old cache entries are then ignored
SPLIT_NAMES = ("train", "valid", "test")
PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


class GPTDataset:
    """Map-style dataset: `ds[i] == {"text": int64 array of seq_length + 1 tokens}`."""

    def __init__(self, name: str, indexed_dataset: MMapIndexedDataset, documents: tuple[int, int],
                 seq_length: int, seed: int, num_samples: int, cache_dir: Optional[str] = None,
                 tokens: Optional[int] = None) -> None:
        """`tokens`: the documents' token count where the caller has it already (else counted when first asked)."""
        self.name = name
        self._tokens = tokens
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        start, end = documents
        self.documents = (start, end)
        if not 0 <= start < end <= len(indexed_dataset):
            raise DataError(f"document range [{start}, {end}) is empty or outside the "
                            f"{len(indexed_dataset)} documents of {indexed_dataset.path_prefix}")
        sizes = indexed_dataset.sizes
        if not sizes[start:end].any():
            raise DataError(f"documents [{start}, {end}) of {indexed_dataset.path_prefix} hold no tokens")
        description = {
            "class": "GPTDataset", "version": INDEX_FORMAT_VERSION,
            "path_prefix": os.path.abspath(indexed_dataset.path_prefix),
            "sizes_md5": array_digest(sizes), "documents": [start, end],
            "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
        }
        cache_dir = resolve_cache_dir(cache_dir, indexed_dataset.path_prefix)
        tag = f"{os.path.basename(indexed_dataset.path_prefix)}-{name}"
        arrays = load_or_build(cache_dir, tag, description, ("doc_idx", "sample_idx", "shuffle_idx"),
                               lambda sinks: write_gpt_indices(sizes, (start, end), seq_length, num_samples, seed,
                                                               sinks))
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"])

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    @property
    def tokens(self) -> int:
        """Tokens in one pass over the documents (a pass over the sizes table, at most once)."""
        if self._tokens is None:
            self._tokens = _tokens((self.indexed_dataset, self.documents))
        return self._tokens

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {len(self)} samples of the {self.name} dataset")
        i = int(self.shuffle_idx[idx])
        first, first_offset = (int(v) for v in self.sample_idx[i])
        last, last_offset = (int(v) for v in self.sample_idx[i + 1])
        get = self.indexed_dataset.get
        if first == last:
            tokens = get(int(self.doc_idx[first]), first_offset, last_offset - first_offset + 1)
        else:
            parts = [get(int(self.doc_idx[first]), first_offset)]
            parts += [get(int(d)) for d in self.doc_idx[first + 1:last]]
            parts.append(get(int(self.doc_idx[last]), 0, last_offset + 1))
            tokens = np.concatenate(parts)
        return {"text": tokens.astype(np.int64)}


def parse_split_weights(split: str) -> list[float]:
    """`--split 969,30,1` -> its (up to three) weights, validated."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split!r} must be comma-separated numbers, e.g. 969,30,1") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} needs up to three non-negative weights with a positive sum")
    return weights


def parse_split(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's `--split 969,30,1`: weights -> train/valid/test document ranges."""
    weights = (parse_split_weights(split) + [0.0, 0.0])[:3]
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_documents)))
    # Rounding may over- or undershoot: the last split absorbs the difference, as in Megatron.
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


def parse_blend(paths: Sequence[str], flag: str) -> tuple[list[str], Optional[list[float]]]:
    """`("0.3", "A", "0.7", "B")` -> prefixes and weights; unweighted paths give weights None."""
    paths = list(paths)
    try:
        float(paths[0])
    except ValueError:
        return paths, None
    if len(paths) % 2:
        raise ValueError(f"{flag} {' '.join(paths)}: give weight/prefix pairs (0.3 A 0.7 B) or prefixes only")
    weights, prefixes = paths[0::2], paths[1::2]
    try:
        values = [float(w) for w in weights]
    except ValueError:
        raise ValueError(f"{flag}: every other item must be a weight, got {weights}") from None
    if any(w < 0 for w in values) or sum(values) <= 0:
        raise ValueError(f"{flag}: weights must be non-negative with a positive sum, got {values}")
    return prefixes, values


def _check_tokenizer(ds: MMapIndexedDataset, tokenizer, data_cache_path: Optional[str]) -> None:
    """Every token id of `ds` must be one of the tokenizer's (read from the manifest or a cached scan)."""
    if tokenizer is None:
        return
    check_token_ids(ds, tokenizer.vocab_size, resolve_cache_dir(data_cache_path, ds.path_prefix),
                    f"the tokenizer ({type(tokenizer).__name__})")


def _tokens(part: tuple[MMapIndexedDataset, tuple[int, int]]) -> int:
    ds, (a, b) = part
    return int(ds.sizes[a:b].sum(dtype=np.int64))


def _describe_parts(parts: list[tuple[MMapIndexedDataset, tuple[int, int]]]) -> str:
    """Why each part of a split is empty, for messages: '{prefix}: documents [a, b) of N, T tokens'."""
    out = []
    for ds, (a, b) in parts:
        text = f"{ds.path_prefix}: documents [{a}, {b}) of its {len(ds)}, {_tokens((ds, (a, b)))} tokens"
        if len(ds) == 0 or not ds.sizes.any():
            text += (f" ({ds.path_prefix}.bin/.idx hold no tokens at all: was the input of tools/preprocess_data.py "
                     "empty?)")
        out.append(text)
    return "; ".join(out)


def _build_split(name: str, parts: list[tuple[MMapIndexedDataset, tuple[int, int]]],
                 weights: Optional[list[float]], seq_length: int, seed: int, num_samples: int,
                 cache_path: Optional[str]):
    """One split: a GPTDataset, a BlendedDataset of several, or None when there is nothing to build."""
    tokens = [_tokens(part) for part in parts]
    if weights is None:  # unweighted prefixes: blend in proportion to their tokens (plain concatenation)
        weights = [float(t) for t in tokens]
    kept = [(ds, docs, w, t) for (ds, docs), w, t in zip(parts, weights, tokens) if t > 0 and w > 0]
    if len(parts) > 1 and num_samples:
        for (ds, docs), t in zip(parts, tokens):
            if t == 0:
                logger.warning("the %s split of %s holds no tokens (documents [%d, %d) of its %d; --split): left out "
                               "of the blend", name, ds.path_prefix, docs[0], docs[1], len(ds))
    if not kept or num_samples == 0:
        return None
    if len(kept) == 1:
        ds, docs, _, t = kept[0]
        return GPTDataset(name, ds, docs, seq_length, seed, num_samples, cache_path, tokens=t)
    blend_weights = [w for _, _, w, _ in kept]
    description = {"class": "BlendedDataset", "version": INDEX_FORMAT_VERSION, "size": num_samples,
                   "weights": blend_weights,
                   "parts": [[os.path.abspath(ds.path_prefix), array_digest(ds.sizes), list(docs)]
                             for ds, docs, _, _ in kept]}
    first = kept[0][0].path_prefix
    arrays = load_or_build(resolve_cache_dir(cache_path, first), f"blend-{name}", description,
                           ("dataset_index", "dataset_sample_index"),
                           lambda sinks: write_blending_indices(blend_weights, num_samples, sinks))
    counts = samples_per_dataset(arrays["dataset_index"], len(kept))
    datasets = [GPTDataset(name, ds, docs, seq_length, seed, int(n), cache_path, tokens=t) if n else None
                for (ds, docs, _, t), n in zip(kept, counts)]
    return BlendedDataset(datasets, blend_weights, arrays["dataset_index"], arrays["dataset_sample_index"],
                          counts=counts)


def _split_weight(split: str, k: int) -> float:
    return (parse_split_weights(split) + [0.0, 0.0])[k]


def _report_empty_split(k: int, source: str, why: str, wanted: int, surprising: bool) -> None:
    """An empty train split is an error; an empty validation or test split is skipped, and says so.

    `surprising`: the flags asked for this split's data (a positive --split share, or a path), so its absence
    is a warning; a split left out on purpose (a 0 share for test, no --test-data-path) is only logged.
    """
    detail = f" ({why})" if why else ""
    if k == 0:
        fix = ("pass --train-data-path PREFIX" if not why else
               "pass data that holds tokens, or give training a share of --split (e.g. --split 969,30,1)")
        raise DataError(f"the training split is empty: {source}{detail}: {fix}")
    name = ("training", "validation", "test")[k]
    message = (f"{source} leaves the {name} split without data{detail}, but --eval-iters asks for {wanted} "
               f"{name} samples: {name} is skipped. Give it data (a share of --split such as 969,30,1, or "
               f"{PER_SPLIT_FLAGS[k]}), or pass --eval-iters 0 to silence this")
    if k == 1 or surprising:
        logger.warning(message)
    else:
        logger.info(message)


def build_train_valid_test_datasets(cfg: DataConfig, tokenizer, seq_length: int, seed: int,
                                    num_samples: tuple[int, int, int]) -> tuple:
    """(train, valid, test) datasets of at least `num_samples[k]` samples each (None: no data or 0 asked).

    `cfg.data_path` (one prefix or a weighted blend) is cut into splits by `cfg.split` over documents;
    or `cfg.train_data_path` / `valid_data_path` / `test_data_path` give each split its own data.
    """
    per_split = (cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path)
    if cfg.data_path and any(per_split):
        raise ValueError("--data-path and --train-data-path/--valid-data-path/--test-data-path are exclusive: "
                         "use --data-path with --split, or the per-split paths")
    if not cfg.data_path and not any(per_split):
        raise ValueError("no training data: pass --data-path PREFIX (or --train-data-path ...), "
                         "or --mock-data; tools/prepare_demo_data.py makes a small corpus")
    opened: dict[str, MMapIndexedDataset] = {}

    def open_prefix(prefix: str) -> MMapIndexedDataset:
        if prefix not in opened:
            opened[prefix] = MMapIndexedDataset(prefix)
            _check_tokenizer(opened[prefix], tokenizer, cfg.data_cache_path)
        return opened[prefix]

    out = []
    if cfg.data_path:
        prefixes, weights = parse_blend(cfg.data_path, "--data-path")
        datasets = [open_prefix(p) for p in prefixes]
        ranges = [parse_split(cfg.split, len(ds)) for ds in datasets]
        for k in range(3):
            parts = [(ds, r[k]) for ds, r in zip(datasets, ranges)]
            out.append(_build_split(SPLIT_NAMES[k], parts, weights, seq_length, seed, num_samples[k],
                                    cfg.data_cache_path))
            if out[k] is None and num_samples[k]:
                _report_empty_split(k, f"--data-path {' '.join(cfg.data_path)} --split {cfg.split}",
                                    _describe_parts(parts), num_samples[k], _split_weight(cfg.split, k) > 0)
        return tuple(out)
    for k, (paths, flag) in enumerate(zip(per_split, PER_SPLIT_FLAGS)):
        if not paths:
            out.append(None)
            if num_samples[k]:
                _report_empty_split(k, f"no {flag}", "", num_samples[k], False)
            continue
        prefixes, weights = parse_blend(paths, flag)
        parts = [(open_prefix(p), (0, len(open_prefix(p)))) for p in prefixes]
        out.append(_build_split(SPLIT_NAMES[k], parts, weights, seq_length, seed, num_samples[k], cfg.data_cache_path))
        if out[k] is None and num_samples[k]:
            _report_empty_split(k, f"{flag} {' '.join(paths)}", _describe_parts(parts), num_samples[k], True)
    return tuple(out)
