"""tools/merge_datasets.py as a command: an input folder sorted by name or datasets in the given order,
and the inputs it refuses, named, with nothing published."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.merge import merge_datasets
from tests.support.config import REPO
from tests.support.data import assert_same_pair, write_parts


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_datasets.py"), *args, "--no-progress"],
                          capture_output=True, text=True, timeout=60)


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
