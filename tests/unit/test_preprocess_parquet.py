"""Parquet and Arrow inputs of preprocessing (megatron.data.parquet_input): the documents of a JSONL corpus written
as tables (several row groups, files, a folder, a glob; Arrow IPC files and streams) give its bytes, also in
partitions cut between row groups and with workers; a bad row is named by file and row (and skipped on request); a
missing column, a damaged file and a missing pyarrow are one clear error."""
import json
import os
import re
import sys

import pyarrow as pa
import pyarrow.feather
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from megatron.data.errors import DataError
from megatron.data.parquet_input import TablePiece, TableReader
from megatron.data.preprocess import preprocess
from megatron.data.text_input import BadLineError, iter_documents, plan_partitions
from tests.support.config import load_tool
from tests.support.data import NULL, assert_same_pair

# Space-separated token ids (the NullTokenizer's text), an empty document among them; three files' worth.
DOCS = [" ".join(str((7 * i + j) % 1000) for j in range(i % 9)) for i in range(60)]
TITLES = [str(i) for i in range(60)]
FILES = [(0, 25), (25, 41), (41, 60)]


def write_jsonl(folder, docs=DOCS, titles=TITLES, files=FILES):
    """The documents as JSONL files, one per `files` range (a None document left out)."""
    folder.mkdir()
    for k, (a, b) in enumerate(files):
        rows = [{"text": d, "title": t} for d, t in zip(docs[a:b], titles[a:b]) if d is not None]
        (folder / f"part{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_parquet(folder, docs=DOCS, titles=TITLES, files=FILES, rows_per_group=4):
    """The documents in row groups of `rows_per_group` rows, with an extra column before them."""
    folder.mkdir()
    for k, (a, b) in enumerate(files):
        table = pa.table({"id": list(range(a, b)), "text": docs[a:b], "title": titles[a:b]})
        pq.write_table(table, folder / f"part{k}.parquet", row_group_size=rows_per_group)
    return folder


def reference(tmp_path, docs=DOCS, files=FILES, **kwargs):
    """The JSONL run: the bytes every table run must give."""
    preprocess(str(write_jsonl(tmp_path / "jsonl", docs=docs, files=files)), str(tmp_path / "ref"), NULL,
               append_eod=True, progress=False, **kwargs)
    return str(tmp_path / "ref")


def test_parquet_equals_jsonl_for_files_folders_globs_partitions_and_workers(tmp_path):
    ref = reference(tmp_path, json_keys=["text", "title"])
    folder = write_parquet(tmp_path / "pq")
    runs = {"folder": dict(input_spec=str(folder)),
            "glob": dict(input_spec=str(tmp_path / "p*" / "*.parquet")),
            "files": dict(input_spec=[str(folder / f"part{k}.parquet") for k in range(3)]),
            "partitions": dict(input_spec=str(folder), partitions=2, workers=2)}
    for name, kwargs in runs.items():
        stats = preprocess(output_prefix=str(tmp_path / name), tokenizer_cfg=NULL, json_keys=["text", "title"],
                           append_eod=True, progress=False, **kwargs)
        assert stats.documents == len(DOCS), name
        for key in ("text", "title"):
            assert_same_pair(f"{ref}_{key}_document", str(tmp_path / f"{name}_{key}_document"))


def test_partitions_cut_a_parquet_file_between_row_groups(tmp_path):
    ref = reference(tmp_path, files=[(0, 60)])
    write_parquet(tmp_path / "pq", files=[(0, 60)], rows_per_group=4)
    path = str(tmp_path / "pq" / "part0.parquet")
    for partitions in (2, 3):
        plan = plan_partitions([path], partitions)
        assert [len(pieces) for pieces in plan] == [1] * partitions
        bounds = [(p.start, p.end) for pieces in plan for p in pieces]
        assert bounds[0][0] == 0 and bounds[-1][1] is None  # contiguous row-group ranges: [0, a), [a, b), ...
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(partitions - 1)), bounds
        preprocess(path, str(tmp_path / f"p{partitions}"), NULL, append_eod=True, progress=False,
                   partitions=partitions, workers=2)
        assert_same_pair(f"{ref}_text_document", str(tmp_path / f"p{partitions}_text_document"))


def write_arrow(tmp_path):
    """The documents as an Arrow IPC file (record batches of 7 rows), an IPC stream and a Feather file."""
    table = pa.table({"id": list(range(60)), "text": DOCS})
    paths = [tmp_path / "a.arrow", tmp_path / "b_stream.arrow", tmp_path / "c.feather"]
    with pa.ipc.new_file(paths[0], table.schema) as writer:
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
    with pa.ipc.new_stream(paths[1], table.schema) as writer:
        writer.write_table(table, max_chunksize=9)
    pyarrow.feather.write_feather(table, paths[2], chunksize=11)
    return [str(p) for p in paths]


def test_arrow_files_and_streams_equal_jsonl(tmp_path):
    ref = reference(tmp_path, files=[(0, 60)])
    for k, path in enumerate(write_arrow(tmp_path)):
        for partitions in (1, 2):
            out = str(tmp_path / f"arrow{k}_{partitions}")
            preprocess(path, out, NULL, append_eod=True, progress=False, partitions=partitions)
            assert_same_pair(f"{ref}_text_document", f"{out}_text_document")
    file_plan, stream_plan = (plan_partitions([p], 2) for p in write_arrow(tmp_path)[:2])
    assert len(file_plan) == 2 and file_plan[1][0].start > 0  # record batches are groups
    assert stream_plan == [[TablePiece(stream_plan[0][0].path, nbytes=stream_plan[0][0].nbytes)]]  # whole


def test_pieces_hold_every_row_once_with_its_row_number(tmp_path):
    write_parquet(tmp_path / "pq", files=[(0, 60)], rows_per_group=7)
    paths = [str(tmp_path / "pq" / "part0.parquet"), write_arrow(tmp_path)[0]]
    for path in paths:
        expected = [(n, {"text": doc}) for n, doc in enumerate(DOCS, 1)]
        for partitions in (1, 2, 3, 5):
            got = []
            for pieces in plan_partitions([path], partitions):
                for piece in pieces:
                    with TableReader(piece, ["text"]) as reader:
                        got += [(piece.line_number(n), row) for n, row in reader]
            assert got == expected, (path, partitions)
    assert list(iter_documents(paths[0], ["text"])) == [{"text": doc} for doc in DOCS]


def bad_inputs(tmp_path):
    """part1.parquet's 10th row (in its third row group) is null; ints.parquet's text column holds integers."""
    docs = list(DOCS)
    docs[25 + 9] = None
    folder = write_parquet(tmp_path / "pq", docs=docs)
    pq.write_table(pa.table({"text": [5, 6]}), folder / "part9_ints.parquet")
    return folder


def test_a_bad_row_is_named_by_file_and_row_and_skipped_on_request(tmp_path):
    folder = bad_inputs(tmp_path)
    null = f"{folder / 'part1.parquet'}:10: column 'text' is null"
    with pytest.raises(BadLineError, match=f"^{re.escape(null)}. Fix the row or pass --skip-bad-lines$"):
        preprocess(str(folder), str(tmp_path / "out"), NULL, progress=False)
    starts = [p.start for pieces in plan_partitions(sorted(map(str, folder.iterdir())), 2) for p in pieces
              if p.path.endswith("part1.parquet")]
    assert starts == [0, 1]  # the second partition holds it, from part1's second row group on
    with pytest.raises(DataError, match=re.escape(null)):
        preprocess(str(folder), str(tmp_path / "out"), NULL, progress=False, partitions=2)
    assert sorted(os.listdir(tmp_path)) == ["pq"]
    ints = f"{folder / 'part9_ints.parquet'}:1: column 'text' holds int, not a string"
    with pytest.raises(BadLineError, match=re.escape(ints)):
        list(iter_documents(str(folder / "part9_ints.parquet"), ["text"]))

    docs = list(DOCS)
    docs[25 + 9] = None
    ref = reference(tmp_path, docs=docs)
    for partitions in (1, 2):
        stats = preprocess(str(folder), str(tmp_path / f"skip{partitions}"), NULL, append_eod=True,
                           progress=False, skip_bad_lines=True, partitions=partitions, workers=2)
        assert (stats.documents, stats.bad_lines) == (len(DOCS) - 1, 3)
        assert stats.bad_line_messages[0] == null
        assert f"{folder / 'part9_ints.parquet'}:2: column 'text' holds int, not a string" in stats.summary()
        assert_same_pair(f"{ref}_text_document", str(tmp_path / f"skip{partitions}_text_document"))


def test_a_missing_column_names_the_file_and_its_columns(tmp_path, capsys):
    folder = write_parquet(tmp_path / "pq")
    path = folder / "part0.parquet"
    message = f"--input {path}: no column 'body' (its columns: ['id', 'text', 'title']); choose --json-keys"
    with pytest.raises(DataError, match=f"^{re.escape(message)}$"):
        preprocess(str(folder), str(tmp_path / "out"), NULL, ["text", "body"], progress=False)
    # The tool prints it as one line, without a traceback.
    code = load_tool("preprocess_data").main(["--input", str(folder), "--json-keys", "body", "--output-prefix",
                                              str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size", "1000", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and err == f"preprocess_data.py: error: {message}\n"
    assert sorted(os.listdir(tmp_path)) == ["pq"]


def test_a_damaged_file_is_one_error_naming_it(tmp_path):
    folder = write_parquet(tmp_path / "pq", files=[(0, 60)], rows_per_group=10)
    good = (folder / "part0.parquet").read_bytes()
    damaged = {"cut.parquet": good[:len(good) // 2], "noise.parquet": b"not a table " * 10,
               "noise.arrow": b"not a table " * 10}
    for name, data in damaged.items():
        (tmp_path / name).write_bytes(data)
        kind = "a Parquet" if name.endswith(".parquet") else "an Arrow IPC (file or stream)"
        head = re.escape(f"--input {tmp_path / name}: cannot be read as {kind} file (")
        with pytest.raises(DataError, match=rf"^{head}[^\n]+\); is the file complete\?$"):
            preprocess(str(tmp_path / name), str(tmp_path / "out"), NULL, progress=False)
    # A damaged data page (the footer is fine): found while reading.
    start = pq.ParquetFile(folder / "part0.parquet").metadata.row_group(2).column(1).data_page_offset
    (tmp_path / "page.parquet").write_bytes(good[:start] + b"\xff" * 40 + good[start + 40:])
    with pytest.raises(DataError, match=rf"^{re.escape(f'--input {tmp_path}/page.parquet: cannot be read (')}[^\n]+\)"):
        preprocess(str(tmp_path / "page.parquet"), str(tmp_path / "out"), NULL, progress=False)
    assert not list(tmp_path.glob("out*"))


def test_without_pyarrow_a_table_input_says_how_to_install_it(tmp_path, monkeypatch):
    folder = write_parquet(tmp_path / "pq")
    jsonl = write_jsonl(tmp_path / "jsonl")
    for name in ("pyarrow", "pyarrow.ipc", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # `import pyarrow` raises ImportError
    head = re.escape(f"--input {folder / 'part0.parquet'}: reading Parquet or Arrow files needs pyarrow: ")
    with pytest.raises(DataError, match=rf"^{head}pip install pyarrow \(or .*\[parquet\]"):
        preprocess(str(folder), str(tmp_path / "out"), NULL, progress=False, partitions=2)
    stats = preprocess(str(jsonl), str(tmp_path / "out"), NULL, progress=False, partitions=2)  # JSONL needs none
    assert stats.documents == len(DOCS)
