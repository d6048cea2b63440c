"""The Megatron mmap `.bin/.idx` format: round trips, byte compatibility with a pair written by hand
following Megatron-LM's layout, and a clear error for each kind of corrupt or missing file (with the
format checks alone for pairs written elsewhere, and through the manifest for ours)."""
import os
import pickle
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    CorruptIndexedDatasetError,
    DatasetNotFoundError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
)
from tests.support.data import write_builder as write, write_megatron_by_hand

DOCS = [[1, 2, 3], [], [65000, 7], list(range(100))]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_reader_roundtrip(tmp_path, dtype):
    docs = DOCS + [[2**20]] if dtype == np.int32 else DOCS
    write(tmp_path / "ds", docs, dtype)
    ds = MMapIndexedDataset(str(tmp_path / "ds"))
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(docs) and ds.num_documents == len(docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc
    assert ds[-1].tolist() == docs[-1]
    assert ds.get(3, offset=10, length=5).tolist() == [10, 11, 12, 13, 14]
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert pickle.loads(pickle.dumps(ds))[3].tolist() == DOCS[3]  # DataLoader workers reopen the files
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx", "ds.manifest.json"]  # no temporary files left


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4)])
def test_hand_written_megatron_pair_loads_and_matches_our_bytes(tmp_path, dtype, code):
    write_megatron_by_hand(tmp_path / "megatron", DOCS, dtype, code)
    ds = MMapIndexedDataset(str(tmp_path / "megatron"))
    assert ds.dtype == np.dtype(dtype)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    write(tmp_path / "ours", DOCS, dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"megatron{ext}").read_bytes()


def test_best_fitting_dtype_uses_megatrons_threshold():
    assert best_fitting_dtype(32000) == np.uint16 and best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32 and best_fitting_dtype(None) == np.int32


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="do not fit the dataset dtype uint16"):
        with MMapIndexedDatasetBuilder(str(tmp_path / "ds"), np.uint16) as builder:
            builder.add_document(np.array([1, 70000]))
    assert os.listdir(tmp_path) == []  # the failed writer removed its temporary files


def corrupt_idx(path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


DAMAGES = [
    (lambda idx, bin_: corrupt_idx(idx, 0, b"NOTMAGIC!"), "bad magic"),
    (lambda idx, bin_: corrupt_idx(idx, 9, struct.pack("<Q", 2)), "unknown version 2"),
    (lambda idx, bin_: corrupt_idx(idx, 17, struct.pack("<B", 9)), "unknown dtype code 9"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), "truncated"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), "shorter than the 34-byte header"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes() + b"\0" * 8), "trailing bytes"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), "beyond the end of"),
    (lambda idx, bin_: corrupt_idx(idx, 34 + 4 * 4, struct.pack("<q", 10**6)), "beyond the end of"),
    (lambda idx, bin_: corrupt_idx(idx, 34 + 12 * 4, struct.pack("<q", 3)), "document index"),
]


@pytest.mark.parametrize("damage, message", DAMAGES)
def test_corrupt_files_fail_naming_the_file(tmp_path, damage, message):
    write(tmp_path / "ds", DOCS)
    os.remove(tmp_path / "ds.manifest.json")  # a pair written by another tool: the format checks alone
    damage(tmp_path / "ds.idx", tmp_path / "ds.bin")
    with pytest.raises(CorruptIndexedDatasetError, match=message) as err:
        MMapIndexedDataset(str(tmp_path / "ds"))
    assert str(tmp_path / "ds.idx") in str(err.value)


@pytest.mark.parametrize("damage", [d for d, _ in DAMAGES])
def test_corrupt_files_with_a_manifest_fail_on_the_manifest(tmp_path, damage):
    write(tmp_path / "ds", DOCS)
    damage(tmp_path / "ds.idx", tmp_path / "ds.bin")
    with pytest.raises(CorruptIndexedDatasetError, match="does not match .*ds.manifest.json") as err:
        MMapIndexedDataset(str(tmp_path / "ds"))
    assert "re-run tools/preprocess_data.py" in str(err.value)


@pytest.mark.parametrize("missing", ["ds.bin", "ds.idx"])
def test_missing_file_names_path_and_tool(tmp_path, missing):
    write(tmp_path / "ds", DOCS)
    os.remove(tmp_path / missing)
    with pytest.raises(DatasetNotFoundError, match="tools/preprocess_data.py") as err:
        MMapIndexedDataset(str(tmp_path / "ds"))
    assert str(tmp_path / missing) in str(err.value)


def test_a_prefix_without_its_text_document_suffix_gets_a_hint(tmp_path):
    """tools/preprocess_data.py writes PREFIX_text_document.bin/.idx; `--data-path PREFIX` names that one."""
    write(tmp_path / "corpus_text_document", DOCS)
    with pytest.raises(DatasetNotFoundError, match=r"Did you mean '.*corpus_text_document'\?"):
        MMapIndexedDataset(str(tmp_path / "corpus"))
    with pytest.raises(DatasetNotFoundError) as err:  # nothing close: no hint
        MMapIndexedDataset(str(tmp_path / "other"))
    assert "Did you mean" not in str(err.value)


@pytest.mark.parametrize("with_manifest", [True, False])
def test_opening_checks_the_tables_in_constant_memory(tmp_path, monkeypatch, with_manifest):
    """A merged 2T-token pair holds ~1.8B documents (36 GB of tables): opening it must not copy them. Without a
    manifest the tables are checked chunk by chunk; with one, only the last sequence's end (O(1))."""
    import tracemalloc

    from megatron.data import indexed_dataset

    from megatron.data.manifest import TokenRange, write_manifest

    n = 2_000_000
    sizes = (np.arange(n) % 3).astype(np.int32)
    pointers = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(tmp_path / "ds.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(sizes.tobytes() + pointers.tobytes() + np.arange(n + 1, dtype=np.int64).tobytes())
    (tmp_path / "ds.bin").write_bytes(bytes(int(sizes.sum()) * 2))
    if with_manifest:
        write_manifest(str(tmp_path / "ds"), "uint16", n, n, TokenRange(0, 1, 0, 1))
    del sizes, pointers
    monkeypatch.setattr(indexed_dataset, "TABLE_CHUNK", 1000)
    tracemalloc.start()
    ds = MMapIndexedDataset(str(tmp_path / "ds"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(ds) == n and ds.data_bytes == (n // 3) * 3 * 2 + (n % 3 == 2) * 2
    assert peak < 2_500_000  # the tables are 40 MB; int64 temporaries of them were 16 MB each (+ 1 MiB reads)
