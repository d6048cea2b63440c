"""Data fixtures: `.bin/.idx` pairs written by our builder or by hand in Megatron-LM's layout, learnable documents
of counting patterns, and the flags that train on them."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from megatron.config import DataConfig
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from tests.support.config import tiny_argv

VOCAB = 127  # NullTokenizer ids 0..126 plus eod 127: 128 ids, no padding
NULL = DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000)  # ids 0..999 as written, eod 1000
OLD_DOCS = [[1, 2, 3, 4]] * 400  # a prefix being regenerated (test_data_reliability)
NEW_DOCS = [list(range(10, 30))] * 200  # its new documents: a bigger .bin, the old offsets fit inside it


def write_builder(prefix, docs, dtype=np.uint16) -> None:
    """`docs` (lists of token ids) as a pair at `prefix`, one document each, through our builder (with its
    manifest)."""
    with MMapIndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()


def write_upstream(prefix, docs, dtype=np.uint16) -> None:
    """A pair as Megatron-LM (or any other tool) writes it: the same bytes, no manifest."""
    write_builder(prefix, docs, dtype)
    os.remove(f"{prefix}.manifest.json")


def docs_with(bad_id: int, bad_doc: int, num_docs: int = 300, length: int = 50) -> list[list[int]]:
    """`num_docs` documents of ids below 90, document `bad_doc` holding `bad_id` in its middle."""
    docs = [[(7 * i + j) % 90 for j in range(length)] for i in range(num_docs)]
    docs[bad_doc][length // 2] = bad_id
    return docs


def write_megatron_by_hand(prefix, docs, dtype, code) -> None:
    """Megatron-LM's MMapIndexedDataset layout, written independently of our writer."""
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize)])
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.array(d, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(doc_idx.tobytes())


def write_indexed(prefix: Path, num_docs: int, seed: int) -> str:
    """Documents of counting patterns (learnable), stored with an eod after each, as preprocessing does."""
    rng = np.random.default_rng(seed)
    with MMapIndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for _ in range(num_docs):
            start, step, length = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(20, 60)
            builder.add_document(np.append((start + step * np.arange(length)) % VOCAB, VOCAB))
        builder.finalize()
    return str(prefix)


def data_argv(train: str, valid: str, **overrides) -> list[str]:
    """tiny_argv training on `train` and validating on `valid` (write_indexed pairs) with the NullTokenizer."""
    argv = [a for a in tiny_argv(**overrides) if a != "--mock-data"]
    return argv + ["--train-data-path", train, "--valid-data-path", valid, "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", str(VOCAB)]


# tools/merge_datasets.py's inputs (test_merge_datasets): three parts of plain text, one line a document.
MERGE_PARTS = [
    ["1 2 3", "", "4 5", "999"],          # a blank line (not a document)
    ["7"],
    ["8 9 10 11", "12", "0 0 0"],
]


def write_parts(folder) -> list[str]:
    """Each part preprocessed on its own, and the concatenated text preprocessed whole (`whole_text_document`)."""
    from megatron.data.preprocess import preprocess

    prefixes = []
    for k, lines in enumerate(MERGE_PARTS):
        (folder / f"part{k}.txt").write_text("\n".join(lines) + "\n")
        preprocess(str(folder / f"part{k}.txt"), str(folder / f"part{k}"), NULL, append_eod=True, progress=False)
        prefixes.append(str(folder / f"part{k}_text_document"))
    (folder / "whole.txt").write_text("".join("\n".join(lines) + "\n" for lines in MERGE_PARTS))
    preprocess(str(folder / "whole.txt"), str(folder / "whole"), NULL, append_eod=True, progress=False)
    return prefixes


def assert_same_pair(a: str, b: str) -> None:
    """Pairs `a` and `b` hold the same bytes, and their manifests the same facts."""
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            assert fa.read() == fb.read(), ext
    ma, mb = (json.load(open(p + ".manifest.json")) for p in (a, b))
    for key in ("state", "dtype", "sequences", "documents", "token_range", "bin", "idx"):
        assert ma[key] == mb[key], key
