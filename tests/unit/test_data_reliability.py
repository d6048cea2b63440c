"""Data reliability: every token id checked before training (manifest or one cached scan), a
`.bin/.idx` pair published so that a crash between its renames can never pass for a consistent pair, stale
temporary files removed, empty splits and empty inputs named, data errors printed without a traceback.

Crashes are injected at the exact point (a patched `os.replace`), never by timing."""
import json
import logging
import os
import signal
import sys
import tracemalloc

import numpy as np
import pytest

from megatron.arguments import parse_config
from megatron.config import DataConfig
from megatron.data.errors import CorruptIndexedDatasetError, DataError, TokenIdOutOfRangeError
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.manifest import HEAD_TAIL_BYTES, pair_is_complete
from megatron.data.preprocess import preprocess
from megatron.data.token_range import scan_token_range
from megatron.tokenizer import NullTokenizer
from megatron.training.datasets import build_datasets
from tests.support.config import tiny_argv
from tests.support.data import NEW_DOCS as NEW, NULL, OLD_DOCS as OLD, docs_with, write_builder, write_upstream

SEQ = 16


# ------------------------------------------------------------------------------------------- token ids (item 1)

def test_preprocess_records_the_token_range_in_the_manifest(tmp_path):
    (tmp_path / "in.txt").write_text("".join(f"{i} {i + 1}\n" for i in range(200)) + "999 5\n3 4\n")
    preprocess(str(tmp_path / "in.txt"), str(tmp_path / "out"), NULL, progress=False)
    manifest = json.loads((tmp_path / "out_text_document.manifest.json").read_text())
    assert manifest["token_range"] == {"min": 0, "min_sequence": 0, "max": 999, "max_sequence": 200}
    assert (manifest["documents"], manifest["sequences"], manifest["dtype"]) == (202, 202, "uint16")
    ds = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.recorded_token_range.max == 999 and scan_token_range(ds) == ds.recorded_token_range


@pytest.mark.parametrize("bad_id", [110, 5000])  # a padding row of the padded vocabulary (128) / beyond it
@pytest.mark.parametrize("writer", [write_builder, write_upstream])
def test_a_bad_id_anywhere_fails_before_training(tmp_path, bad_id, writer):
    """With --vocab-size 99 NullTokenizer has 100 ids and the embedding 128 rows: id 110 used to train a
    padding row silently, id 5000 to crash in F.embedding at the first batch that held it."""
    writer(tmp_path / "c", docs_with(bad_id, bad_doc=277))
    argv = tiny_argv(vocab_size=99) + ["--data-path", str(tmp_path / "c"), "--tokenizer-type", "NullTokenizer"]
    argv.remove("--mock-data")
    config = parse_config(argv)
    assert config.model.padded_vocab_size == 128
    with pytest.raises(TokenIdOutOfRangeError) as err:
        build_datasets(config)
    message = str(err.value)
    assert f"{tmp_path / 'c'}.bin: document 277 holds token id {bad_id}" in message
    assert "has 100 ids (0..99)" in message and "--vocab-size" in message and "--tokenizer-model" in message


@pytest.mark.parametrize("writer", [write_builder, write_upstream])  # range from the manifest / from a scan
def test_an_id_equal_to_the_vocabulary_size_fails_and_the_last_id_passes(tmp_path, writer):
    """NullTokenizer(99) has 100 ids, 0..99: id 100 is the first one outside the vocabulary and must be refused,
    id 99 (the eod) accepted. A `>` instead of `>=` in the range check would accept id == vocab_size."""
    tokenizer = NullTokenizer(99)
    assert tokenizer.vocab_size == 100
    cfg = DataConfig(data_path=(str(tmp_path / "c"),), data_cache_path=str(tmp_path / "cache"))
    writer(tmp_path / "c", docs_with(tokenizer.vocab_size - 1, bad_doc=42))
    build_train_valid_test_datasets(cfg, tokenizer, SEQ, 1, (10, 0, 0))
    writer(tmp_path / "c", docs_with(tokenizer.vocab_size, bad_doc=42))
    with pytest.raises(TokenIdOutOfRangeError, match="document 42 holds token id 100, .* has 100 ids \\(0..99\\)"):
        build_train_valid_test_datasets(cfg, tokenizer, SEQ, 1, (10, 0, 0))


def test_negative_ids_fail_too(tmp_path):
    docs = docs_with(0, 0, num_docs=20)
    docs[13][3] = -4
    write_upstream(tmp_path / "c", docs, np.int32)
    with pytest.raises(TokenIdOutOfRangeError, match="document 13 holds the negative token id -4"):
        build_train_valid_test_datasets(DataConfig(data_path=(str(tmp_path / "c"),)), NullTokenizer(99), SEQ, 1,
                                        (10, 0, 0))


def test_files_without_manifest_are_scanned_once_and_cached(tmp_path, monkeypatch):
    write_upstream(tmp_path / "c", docs_with(95, 5))
    scans = []
    real_scan = scan_token_range
    monkeypatch.setattr("megatron.data.token_range.scan_token_range", lambda ds: scans.append(1) or real_scan(ds))
    cfg = DataConfig(data_path=(str(tmp_path / "c"),), data_cache_path=str(tmp_path / "cache"))
    for _ in range(2):
        build_train_valid_test_datasets(cfg, NullTokenizer(99), SEQ, 1, (10, 0, 0))
    assert len(scans) == 1
    [cached] = [f for f in os.listdir(tmp_path / "cache") if "-token-range-" in f]
    recorded = json.loads((tmp_path / "cache" / cached).read_text())["token_range"]
    assert recorded == {"min": 0, "min_sequence": 0, "max": 95, "max_sequence": 5}
    # The data replaced under the same name (another tool, no manifest): scanned again, the new id caught.
    write_upstream(tmp_path / "c", docs_with(120, 9))
    with pytest.raises(TokenIdOutOfRangeError, match="document 9 holds token id 120"):
        build_train_valid_test_datasets(cfg, NullTokenizer(99), SEQ, 1, (10, 0, 0))
    assert len(scans) == 2


def test_pairs_with_a_manifest_are_never_scanned(tmp_path, monkeypatch):
    write_builder(tmp_path / "c", docs_with(80, 5))
    monkeypatch.setattr("megatron.data.token_range.scan_token_range", lambda ds: pytest.fail("scanned"))
    cfg = DataConfig(data_path=(str(tmp_path / "c"),), data_cache_path=str(tmp_path / "cache"))
    build_train_valid_test_datasets(cfg, NullTokenizer(99), SEQ, 1, (10, 0, 0))


def test_scan_chunks_find_the_id_and_its_document(tmp_path, caplog):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1000, 2000, size=int(rng.integers(0, 30))).tolist() for _ in range(200)]
    docs[151][-1], docs[60][0] = 40000, 3  # the largest id at a document's end, the smallest at another's start
    write_upstream(tmp_path / "c", docs)
    ds = MMapIndexedDataset(str(tmp_path / "c"))
    with caplog.at_level(logging.INFO, logger="megatron.data.token_range"):
        for chunk in (2, 6, 14, 4096, 1 << 20):  # chunks that split documents anywhere, and one chunk
            found = scan_token_range(ds, chunk_bytes=chunk, progress_seconds=0.0 if chunk == 6 else 1e9)
            assert (found.min, found.min_sequence, found.max, found.max_sequence) == (3, 60, 40000, 151)
    assert any("scanning" in r.message and "%" in r.message for r in caplog.records)  # the progress line


def test_scan_memory_does_not_grow_with_the_file(tmp_path):
    tokens = np.arange(16 << 20, dtype=np.int64) % 50000  # 32 MiB of uint16
    tokens[-7] = 65000
    write_upstream(tmp_path / "big", np.split(tokens, 64))
    ds = MMapIndexedDataset(str(tmp_path / "big"))
    tracemalloc.start()
    try:
        found = scan_token_range(ds, chunk_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found.max == 65000 and found.max_sequence == 63
    assert peak < 3 << 20, f"peak {peak} bytes while scanning 32 MiB in 1 MiB chunks"


# ------------------------------------------------------------------------------------- atomic pairs (item 2)


def crash_at(monkeypatch, call: int):
    """Make the `call`-th os.replace of the publication fail: 1 manifest marker, 2 .bin, 3 .idx, 4 manifest."""
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == call:
            raise OSError("injected crash")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_the_torn_pair_would_load_without_the_manifest(tmp_path, monkeypatch):
    """Negative control: without the manifest, a new .bin beside an old .idx passes every format check."""
    write_builder(tmp_path / "c", OLD)
    crash_at(monkeypatch, 3)
    with pytest.raises(OSError, match="injected crash"):
        write_builder(tmp_path / "c", NEW)
    monkeypatch.undo()
    os.remove(tmp_path / "c.manifest.json")
    ds = MMapIndexedDataset(str(tmp_path / "c"))
    assert len(ds) == 400 and ds[0].tolist() == [10, 11, 12, 13]  # wrong boundaries, no error


@pytest.mark.parametrize("call, outcome", [(1, "old"), (2, "refused"), (3, "refused"), (4, "refused"),
                                           (5, "new")])
def test_a_crash_at_any_point_of_publishing_never_yields_a_torn_pair(tmp_path, monkeypatch, call, outcome):
    write_builder(tmp_path / "c", OLD)
    calls = crash_at(monkeypatch, call)
    if call <= 4:
        with pytest.raises(OSError, match="injected crash"):
            write_builder(tmp_path / "c", NEW)
    else:
        write_builder(tmp_path / "c", NEW)
    monkeypatch.undo()
    assert [os.path.basename(c) for c in calls] == ["c.manifest.json", "c.bin", "c.idx", "c.manifest.json"][:call]
    if outcome == "refused":
        with pytest.raises(CorruptIndexedDatasetError, match="stopped before it finished") as err:
            MMapIndexedDataset(str(tmp_path / "c"))
        assert f"re-run tools/preprocess_data.py for {tmp_path / 'c'}" in str(err.value)
        write_builder(tmp_path / "c", NEW)  # the remedy the message gives
    ds = MMapIndexedDataset(str(tmp_path / "c"))
    expected = OLD if outcome == "old" else NEW
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_sigterm_during_publishing_waits_for_the_manifest(tmp_path, monkeypatch):
    """SIGTERM (Ctrl-C likewise) landing between the renames is held until the pair is complete."""
    write_builder(tmp_path / "c", OLD)
    real_replace = os.replace

    def replace(src, dst):
        if dst.endswith(".bin"):
            os.kill(os.getpid(), signal.SIGTERM)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # as the tool does
    try:
        with pytest.raises(SystemExit):
            write_builder(tmp_path / "c", NEW)
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.undo()
    ds = MMapIndexedDataset(str(tmp_path / "c"))
    assert [ds[i].tolist() for i in range(len(ds))] == NEW


def test_manifest_catches_a_same_size_change_and_names_a_damaged_manifest(tmp_path):
    write_builder(tmp_path / "c", OLD)
    raw = bytearray((tmp_path / "c.bin").read_bytes())
    raw[-1] ^= 1  # same size, one token different
    (tmp_path / "c.bin").write_bytes(bytes(raw))
    with pytest.raises(CorruptIndexedDatasetError, match="the (first|last) MiB of .*c.bin differs"):
        MMapIndexedDataset(str(tmp_path / "c"))
    (tmp_path / "c.manifest.json").write_text('{"format": "megatron-indexed-dataset-manifest", "vers')
    with pytest.raises(CorruptIndexedDatasetError, match="c.manifest.json is unreadable"):
        MMapIndexedDataset(str(tmp_path / "c"))


def test_manifest_catches_a_change_in_the_tail_of_a_bin_larger_than_the_head(tmp_path):
    """A .bin of 2.4 MB: its last MiB shares no byte with its first, so a change to its last token is seen only
    through the tail hash. (The .bin of the test above is under 1 MiB: there the head hash covers every byte and
    a manifest check that never compares the tail hash would pass it.)"""
    tokens_per_doc, num_docs = 400_000, 3  # uint16: 2.4e6 bytes > 2 MiB
    docs = [np.arange(k, k + tokens_per_doc, dtype=np.int64) % 1000 for k in range(num_docs)]
    write_builder(tmp_path / "c", docs)
    size = (tmp_path / "c.bin").stat().st_size
    assert size == 2 * tokens_per_doc * num_docs and size > 2 * HEAD_TAIL_BYTES
    assert len(MMapIndexedDataset(str(tmp_path / "c"))) == num_docs  # the untouched pair loads
    with open(tmp_path / "c.bin", "r+b") as f:  # same size, the last token different
        f.seek(size - 2)
        last = np.frombuffer(f.read(2), dtype=np.uint16)[0]
        f.seek(size - 2)
        f.write(np.array([last ^ 1], dtype=np.uint16).tobytes())
    with pytest.raises(CorruptIndexedDatasetError, match="the last MiB of .*c.bin differs"):
        MMapIndexedDataset(str(tmp_path / "c"))
    assert not pair_is_complete(str(tmp_path / "c"))


# ------------------------------------------------------------------------------- empty data (item 6)

def test_an_empty_validation_split_says_so(tmp_path, caplog):
    write_builder(tmp_path / "c", docs_with(5, 5, num_docs=50))
    argv = tiny_argv(eval_iters=2) + ["--data-path", str(tmp_path / "c"), "--tokenizer-type", "NullTokenizer",
                                      "--split", "100,0,0"]
    argv.remove("--mock-data")
    with caplog.at_level(logging.INFO):
        train, valid, test, _ = build_datasets(parse_config(argv))
    assert train is not None and valid is None and test is None
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "--split 100,0,0 leaves the validation split without data" in warning
    assert "--eval-iters asks for 16 validation samples: validation is skipped" in warning


def test_an_empty_file_is_named_instead_of_asking_for_data_path(tmp_path):
    write_builder(tmp_path / "empty", [])
    for cfg in (DataConfig(data_path=(str(tmp_path / "empty"),)),
                DataConfig(train_data_path=(str(tmp_path / "empty"),))):
        with pytest.raises(DataError, match="training split is empty") as err:
            build_train_valid_test_datasets(cfg, NullTokenizer(99), SEQ, 1, (10, 0, 0))
        assert f"{tmp_path / 'empty'}.bin/.idx hold no tokens at all" in str(err.value)
        assert "pass --data-path" not in str(err.value)


def test_prepare_demo_data_redoes_a_pair_without_a_complete_manifest(tmp_path, monkeypatch):
    """A pair whose publication was killed (the manifest is a marker) or that has no manifest is redone; only a
    complete one is skipped (not any split whose .bin and .idx exist)."""
    from megatron.data.manifest import mark_publishing
    from tests.support.config import load_tool

    tool = load_tool("prepare_demo_data")
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.jsonl").write_text('{"text": "x"}\n')
        write_builder(tmp_path / f"{split}_text_document", [[1, 2]])
    (tmp_path / "tokenizer.model").write_bytes(b"stands in")
    mark_publishing(str(tmp_path / "valid_text_document"))  # SIGKILL between the marker and the manifest
    os.remove(tmp_path / "test_text_document.manifest.json")
    redone = []

    class Stats:
        def summary(self):
            return "redone"

    monkeypatch.setattr(tool, "preprocess", lambda path, base, *a, **k: redone.append(os.path.basename(base)) or Stats())
    tool.prepare(str(tmp_path))
    assert redone == ["valid", "test"]
