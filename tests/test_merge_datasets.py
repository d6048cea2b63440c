"""tools/merge_datasets.py (issue 15.2): merging equals preprocessing the concatenated input byte for byte, in
Megatron's format, streaming in constant memory, atomically, with the token-id range in the manifest."""
import json
import os
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from megatron.data import indexed_dataset, merge
from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.merge import merge_datasets
from megatron.data.preprocess import preprocess
from tests.support.config import REPO
from tests.support.data import NULL, write_megatron_by_hand

PARTS = [
    ["1 2 3", "", "4 5", "999"],          # a blank line (not a document)
    ["7"],
    ["8 9 10 11", "12", "0 0 0"],
]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_datasets.py"), *args, "--no-progress"],
                          capture_output=True, text=True, timeout=60)


def write_parts(folder) -> list[str]:
    """Each part preprocessed on its own, and the concatenated text preprocessed whole (`whole_text_document`)."""
    prefixes = []
    for k, lines in enumerate(PARTS):
        (folder / f"part{k}.txt").write_text("\n".join(lines) + "\n")
        preprocess(str(folder / f"part{k}.txt"), str(folder / f"part{k}"), NULL, append_eod=True, progress=False)
        prefixes.append(str(folder / f"part{k}_text_document"))
    (folder / "whole.txt").write_text("".join("\n".join(lines) + "\n" for lines in PARTS))
    preprocess(str(folder / "whole.txt"), str(folder / "whole"), NULL, append_eod=True, progress=False)
    return prefixes


def assert_same_pair(a: str, b: str) -> None:
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            assert fa.read() == fb.read(), ext
    ma, mb = (json.load(open(p + ".manifest.json")) for p in (a, b))
    for key in ("state", "dtype", "sequences", "documents", "token_range", "bin", "idx"):
        assert ma[key] == mb[key], key


def test_merge_equals_preprocessing_the_concatenation(tmp_path):
    prefixes = write_parts(tmp_path)
    stats = merge_datasets(prefixes, str(tmp_path / "merged"), progress=False)
    assert (stats.documents, stats.inputs) == (7, 3)
    assert_same_pair(str(tmp_path / "merged"), str(tmp_path / "whole_text_document"))
    ds = MMapIndexedDataset(str(tmp_path / "merged"))
    assert ds[2].tolist() == [999, 1000] and ds.recorded_token_range.max == 1000


def test_cli_input_directory_sorted_by_name_and_datasets_in_order(tmp_path):
    prefixes = write_parts(tmp_path)
    (tmp_path / "parts").mkdir()
    for k, prefix in enumerate(prefixes):  # names sort as the parts' order; manifests need not come along
        for ext in (".bin", ".idx"):
            os.rename(prefix + ext, tmp_path / "parts" / f"{k:02d}{ext}")
    result = run_tool("--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr
    assert "merged 3 pair(s): 7 documents" in result.stdout
    assert_same_pair(str(tmp_path / "merged"), str(tmp_path / "whole_text_document"))  # ranges scanned: the same
    reordered = [str(tmp_path / "parts" / f"{k:02d}") for k in (2, 0, 1)]
    assert run_tool("--datasets", *reordered, "--output-prefix", str(tmp_path / "r")).returncode == 0
    assert MMapIndexedDataset(str(tmp_path / "r"))[0].tolist() == [8, 9, 10, 11, 1000]


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


def test_merge_refuses_what_it_cannot_merge_and_names_it(tmp_path):
    prefixes = write_parts(tmp_path)
    with MMapIndexedDatasetBuilder(str(tmp_path / "wide"), np.int32) as builder:
        builder.add_document([1])
        builder.finalize()
    with pytest.raises(DataError, match=r"wide holds int32 tokens but .*part0_text_document holds uint16"):
        merge_datasets([prefixes[0], str(tmp_path / "wide")], str(tmp_path / "m"), progress=False)
    with pytest.raises(DataError, match="is also an input"):
        merge_datasets(prefixes, prefixes[1], progress=False)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"")
    result = run_tool("--input", str(tmp_path / "d"), "--output-prefix", str(tmp_path / "m"))
    assert result.returncode == 1 and "x.bin has no .idx beside it" in result.stderr
    # A pair whose .bin has a gap between sequences (another tool's layout): merging would shift what follows.
    idx = bytearray((tmp_path / "part2_text_document.idx").read_bytes())
    os.remove(tmp_path / "part2_text_document.manifest.json")
    struct.pack_into("<q", idx, 34 + 4 * 3 + 8 * 2, 16)  # sequence 2 starts 2 bytes late (at 16, not 14)
    (tmp_path / "part2_text_document.idx").write_bytes(bytes(idx))
    with open(tmp_path / "part2_text_document.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="sequence 2 starts at byte 16, not right after the previous one"):
        merge_datasets(prefixes, str(tmp_path / "m"), progress=False)
    assert not any(name.startswith("m.") for name in os.listdir(tmp_path))  # nothing published, no temporaries


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
