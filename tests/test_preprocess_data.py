"""tools/preprocess_data.py: outputs read back as the tokenized input, bad lines stop the run (or are
skipped on request), and interrupted runs leave nothing under the final names."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.config import DataConfig
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import preprocess
from megatron.tokenizer import NullTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NULL = DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000)


def run_tool(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *args,
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress"],
                          capture_output=True, text=True, timeout=60, **kwargs)


def test_jsonl_roundtrip_with_eod_and_two_keys(tmp_path):
    docs = [{"text": "1 2 3", "title": "9"}, {"text": "", "title": "8 7"}, {"text": "4 5", "title": "6"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs) + "\n")
    stats = preprocess(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), NULL, ["text", "title"],
                       append_eod=True, progress=False)
    assert (stats.documents, stats.tokens, stats.bad_lines) == (3, (4 + 1 + 3) + (2 + 3 + 2), 0)
    text = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    title = MMapIndexedDataset(str(tmp_path / "out_title_document"))
    assert text.dtype == np.uint16
    assert [text[i].tolist() for i in range(3)] == [[1, 2, 3, 1000], [1000], [4, 5, 1000]]
    assert [title[i].tolist() for i in range(3)] == [[9, 1000], [8, 7, 1000], [6, 1000]]


def test_plain_text_and_workers_give_identical_files(tmp_path):
    lines = [" ".join(str((i * j) % 1000) for j in range(i % 17)) for i in range(1, 3000)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    preprocess(str(tmp_path / "in.txt"), str(tmp_path / "one"), NULL, progress=False)
    preprocess(str(tmp_path / "in.txt"), str(tmp_path / "two"), NULL, workers=2, progress=False)
    one = MMapIndexedDataset(str(tmp_path / "one_text_document"))
    # Blank lines (every 17th here) are not documents.
    assert [one[i].tolist() for i in range(len(one))] == [[int(x) for x in ln.split()] for ln in lines if ln]
    for ext in (".bin", ".idx"):
        one_bytes = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert one_bytes == (tmp_path / f"two_text_document{ext}").read_bytes()


def test_plain_text_takes_one_key(tmp_path):
    (tmp_path / "in.txt").write_text("1 2\n")
    with pytest.raises(ValueError, match="plain text"):
        preprocess(str(tmp_path / "in.txt"), str(tmp_path / "out"), NULL, ["text", "title"], progress=False)


BAD_INPUT = ['{"text": "1 2"}', '{"text": "3"}', '{"text": "4" ', '{"body": "5"}', '{"text": "6 x"}', '{"text": "7"}']


def test_bad_line_stops_the_run_naming_file_and_line(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(BAD_INPUT) + "\n")
    result = run_tool("--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 1
    assert f"{tmp_path / 'in.jsonl'}:3: bad JSON" in result.stderr and "--skip-bad-lines" in result.stderr
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_skip_bad_lines_counts_and_reports_them(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(BAD_INPUT) + "\n")
    result = run_tool("--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
                      "--skip-bad-lines", "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "3 documents" in result.stdout and "skipped 3 bad line(s)" in result.stdout
    assert ":4: missing key 'text'" in result.stdout and ":5: NullTokenizer expects" in result.stdout
    ds = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 1000], [3, 1000], [7, 1000]]


def test_tokenizer_failure_midway_leaves_no_files(tmp_path):
    (tmp_path / "in.txt").write_text("".join(f"{i} {i}\n" for i in range(500)))

    class Exploding(NullTokenizer):
        def tokenize(self, text):
            if text.startswith("300 "):
                raise RuntimeError("tokenizer crashed")
            return super().tokenize(text)

    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        preprocess(str(tmp_path / "in.txt"), str(tmp_path / "out"), NULL, tokenizer=Exploding(1000), progress=False)
    assert os.listdir(tmp_path) == ["in.txt"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_run_leaves_no_final_files(tmp_path, sig):
    fifo = tmp_path / "stream.txt"  # a FIFO: the run is provably mid-input when the signal comes
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(fifo),
                             "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "1000", "--no-progress"], stderr=subprocess.PIPE)
    with open(fifo, "w") as writer:
        writer.write("1 2 3\n" * 1000)
        writer.flush()
        deadline = time.time() + 30
        while not any(".tmp-" in f for f in os.listdir(tmp_path)) and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    assert proc.returncode != 0
    left = os.listdir(tmp_path)
    assert not any(f.endswith((".bin", ".idx")) for f in left)
    if sig == signal.SIGTERM:  # caught: the temporary files are removed too
        assert left == ["stream.txt"]
