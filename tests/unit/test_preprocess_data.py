"""Preprocessing in this process (megatron.data.preprocess, one worker, one partition): outputs read back as the
tokenized input, a tokenizer failure leaves nothing, input pieces hold every line once."""
import json
import os

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import preprocess
from megatron.tokenizer import NullTokenizer
from tests.support.data import NULL


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


def test_plain_text_takes_one_key(tmp_path):
    (tmp_path / "in.txt").write_text("1 2\n")
    with pytest.raises(ValueError, match="plain text"):
        preprocess(str(tmp_path / "in.txt"), str(tmp_path / "out"), NULL, ["text", "title"], progress=False)


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


# ---------------------------------------------------------------------------- many files, compressed inputs, partitions

def test_pieces_hold_every_line_once_with_its_line_number(tmp_path):
    from megatron.data.text_input import LineReader, plan_partitions

    rng = np.random.default_rng(1)
    for trial in range(40):
        lines = [("" if rng.random() < 0.2 else "x" * int(rng.integers(1, 9))) + ("\r\n" if rng.random() < 0.2 else "\n")
                 for _ in range(int(rng.integers(0, 30)))]
        data = ("".join(lines) + ("tail" if rng.random() < 0.5 else "")).encode()
        (tmp_path / "f.txt").write_bytes(data)
        expected = [(n, raw) for n, raw in enumerate(data.splitlines(keepends=True), 1) if raw.strip()]
        for partitions in (1, 2, 5, 11):
            got = []
            for pieces in plan_partitions([str(tmp_path / "f.txt")], partitions):
                for piece in pieces:
                    with LineReader(piece) as reader:
                        got += [(piece.line_number(n), raw) for n, raw in reader]
            assert got == expected, (data, partitions)


def test_a_signal_between_creating_a_writer_and_holding_it_leaves_no_temporaries(tmp_path, monkeypatch):
    """A SIGTERM (SystemExit) or Ctrl-C can land after a writer made its temporary files and before the partition
    holds it, where no abort reaches it: the partition removes its own temporaries by name."""
    from megatron.data import preprocess as pre

    real = pre.MMapIndexedDatasetBuilder

    def made_then_interrupted(prefix, dtype):
        real(prefix, dtype)  # its PREFIX.bin.tmp-PID exists now, and nobody holds the builder
        raise KeyboardInterrupt

    monkeypatch.setattr(pre, "MMapIndexedDatasetBuilder", made_then_interrupted)
    (tmp_path / "in.txt").write_text("1 2 3\n4 5\n")
    with pytest.raises(KeyboardInterrupt):
        pre.preprocess(str(tmp_path / "in.txt"), str(tmp_path / "out"), NULL, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]
