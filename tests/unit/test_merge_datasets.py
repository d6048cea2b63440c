"""tools/merge_datasets.py: merging equals preprocessing the concatenated input byte for byte, in
Megatron's format, streaming in constant memory, atomically, with the token-id range in the manifest."""
import os
import struct
import tracemalloc

import numpy as np
import pytest

from megatron.data import indexed_dataset, merge
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.merge import merge_datasets
from tests.support.data import assert_same_pair, write_megatron_by_hand, write_parts


def test_merge_equals_preprocessing_the_concatenation(tmp_path):
    prefixes = write_parts(tmp_path)
    stats = merge_datasets(prefixes, str(tmp_path / "merged"), progress=False)
    assert (stats.documents, stats.inputs) == (7, 3)
    assert_same_pair(str(tmp_path / "merged"), str(tmp_path / "whole_text_document"))
    ds = MMapIndexedDataset(str(tmp_path / "merged"))
    assert ds[2].tolist() == [999, 1000] and ds.recorded_token_range.max == 1000


def test_megatron_lm_pairs_merge_into_megatron_lm_bytes(tmp_path):
    """Inputs as Megatron-LM writes them (no manifest; several sequences per document): the output has the layout
    of Megatron-LM's merge (offsets recomputed, document index shifted), checked against one written by hand."""
    docs_a, docs_b = [[1, 2], [3]], [[4, 5, 6], [], [7]]
    write_megatron_by_hand(tmp_path / "a", docs_a, np.int32, 4)
    write_megatron_by_hand(tmp_path / "b", docs_b, np.int32, 4)
    write_megatron_by_hand(tmp_path / "expected", docs_a + docs_b, np.int32, 4)
    merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"), progress=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"expected{ext}").read_bytes()
    # Two sequences per document: the document index of b is shifted by a's sequences.
    with MMapIndexedDatasetBuilder(str(tmp_path / "c"), np.int32) as builder:
        builder.add_item([1]), builder.add_item([2]), builder.end_document()
        builder.finalize()
    merge_datasets([str(tmp_path / "c"), str(tmp_path / "c")], str(tmp_path / "cc"), progress=False)
    assert MMapIndexedDataset(str(tmp_path / "cc")).doc_idx.tolist() == [0, 2, 4]


def test_a_failure_while_copying_leaves_nothing(tmp_path, monkeypatch):
    prefixes = write_parts(tmp_path)

    def failing_copy(src_path, dst, buffer, advance):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(merge, "_copy", failing_copy)
    with pytest.raises(OSError, match="No space left"):
        merge_datasets(prefixes, str(tmp_path / "m"), progress=False)
    assert not any(name.startswith("m.") for name in os.listdir(tmp_path))


def test_merge_streams_in_constant_memory(tmp_path, monkeypatch):
    """Two inputs of 1M documents each (tables: 40 MB) merge with a few MB of Python-visible memory."""
    n = 1_000_000
    sizes = (np.arange(n) % 5).astype(np.int32)
    pointers = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * 2, out=pointers[1:])
    for name in ("a", "b"):
        with open(tmp_path / f"{name}.idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
            f.write(sizes.tobytes() + pointers.tobytes() + np.arange(n + 1, dtype=np.int64).tobytes())
        (tmp_path / f"{name}.bin").write_bytes(np.ones(int(sizes.sum()), np.uint16).tobytes())
    del sizes, pointers
    monkeypatch.setattr(merge, "TABLE_CHUNK", 1 << 14)
    monkeypatch.setattr(indexed_dataset, "TABLE_CHUNK", 1 << 14)  # the format checks on open
    monkeypatch.setattr(merge, "COPY_BYTES", 1 << 20)
    tracemalloc.start()
    merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"), progress=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    merged = MMapIndexedDataset(str(tmp_path / "m"))
    assert len(merged) == 2 * n and merged.doc_idx[-1] == 2 * n and merged[n + 3].tolist() == [1, 1, 1]
    assert merged.recorded_token_range.max == 1
    assert peak < 6_000_000  # chunks of 16k entries and a 1 MiB copy buffer (+ the scan's chunk)
