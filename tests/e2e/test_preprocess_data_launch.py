"""tools/preprocess_data.py and preprocessing that starts processes (worker pools, partitions, zstd): bad lines
stop the run (or are skipped on request), interrupted runs leave nothing under the final names, many files,
compressed inputs and partitions give the bytes of one run."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import preprocess
from tests.support.config import REPO
from tests.support.data import NULL
from tests.support.launch import launch


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return launch(1, [*args, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress"],
                  os.path.join(REPO, "tools", "preprocess_data.py"), timeout=60)


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


# ---------------------------------------------------------------------------- many files, compressed inputs, partitions

def corpus_files(folder) -> list:
    """Four inputs in four formats, named so that sorted order is a, b, c, d; JSONL keys and plain text mixed."""
    import gzip
    import shutil

    rng = np.random.default_rng(0)
    folder.mkdir(exist_ok=True)

    def doc(i):
        return " ".join(str(int(t)) for t in rng.integers(0, 1000, size=int(rng.integers(0, 30))))

    (folder / "a.jsonl").write_text("".join(json.dumps({"text": doc(i)}) + "\n" for i in range(300)))
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": doc(i), "other": 1}) + "\n" for i in range(200)))
    (folder / "c.txt").write_text("\n".join(doc(i) for i in range(250)) + "\n")
    files = [folder / "a.jsonl", folder / "b.jsonl.gz", folder / "c.txt"]
    if shutil.which("zstd"):
        (folder / "d.jsonl").write_text("".join(json.dumps({"text": doc(i)}) + "\n" for i in range(100)))
        subprocess.run(["zstd", "-q", "--rm", str(folder / "d.jsonl")], check=True)
        files.append(folder / "d.jsonl.zst")
    return files


def same_bytes(a: str, b: str) -> bool:
    return all(open(a + ext, "rb").read() == open(b + ext, "rb").read() for ext in (".bin", ".idx"))


def test_glob_and_directory_inputs_equal_the_per_file_runs(tmp_path):
    from megatron.data.merge import merge_datasets

    files = corpus_files(tmp_path / "in")
    singles = []
    for k, path in enumerate(files):
        preprocess(str(path), str(tmp_path / f"single{k}"), NULL, append_eod=True, progress=False)
        singles.append(str(tmp_path / f"single{k}_text_document"))
    merge_datasets(singles, str(tmp_path / "per_file"), progress=False)
    stats = preprocess(str(tmp_path / "in"), str(tmp_path / "dir"), NULL, append_eod=True, progress=False)
    assert stats.documents == len(MMapIndexedDataset(str(tmp_path / "per_file")))
    assert same_bytes(str(tmp_path / "dir_text_document"), str(tmp_path / "per_file"))
    preprocess(str(tmp_path / "in" / "*"), str(tmp_path / "glob"), NULL, append_eod=True, progress=False)
    assert same_bytes(str(tmp_path / "glob_text_document"), str(tmp_path / "per_file"))


@pytest.mark.parametrize("partitions, workers", [(3, 1), (2, 2), (12, 1)])
def test_partitions_equal_one_partition(tmp_path, partitions, workers):
    corpus_files(tmp_path / "in")
    preprocess(str(tmp_path / "in"), str(tmp_path / "one"), NULL, append_eod=True, progress=False)
    stats = preprocess(str(tmp_path / "in"), str(tmp_path / "many"), NULL, append_eod=True, progress=False,
                       partitions=partitions, workers=workers)
    assert stats.partitions > 1 and stats.output_prefixes == [str(tmp_path / "many_text_document")]
    assert same_bytes(str(tmp_path / "many_text_document"), str(tmp_path / "one_text_document"))
    left = sorted(f for f in os.listdir(tmp_path) if f.startswith("many"))
    assert left == ["many_text_document.bin", "many_text_document.idx", "many_text_document.manifest.json"]


def test_no_merge_keeps_partitions_named_in_order_and_the_merge_tool_joins_them(tmp_path):
    corpus_files(tmp_path / "in")
    preprocess(str(tmp_path / "in"), str(tmp_path / "one"), NULL, append_eod=True, progress=False)
    result = run_tool("--input", str(tmp_path / "in"), "--output-prefix", str(tmp_path / "out" / "p"), "--append-eod",
                      "--partitions", "11", "--no-merge")
    assert result.returncode == 0, result.stderr
    names = sorted(f[:-4] for f in os.listdir(tmp_path / "out") if f.endswith(".bin"))
    assert names[0] == "p_00_text_document" and len(names) > 1 and all(n.endswith("_text_document") for n in names)
    merged = subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_datasets.py"), "--input",
                             str(tmp_path / "out"), "--output-prefix", str(tmp_path / "m"), "--no-progress"],
                            capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr
    assert same_bytes(str(tmp_path / "m"), str(tmp_path / "one_text_document"))


def test_a_bad_line_in_one_partition_names_file_and_line_and_stops_all(tmp_path):
    lines = [" ".join(["7"] * (i % 13)) for i in range(4000)]
    lines[3001] = "12 x 4"  # in the last of the 3 partitions: its line number is counted from the file's start
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    result = run_tool("--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "out"),
                      "--partitions", "3")
    assert result.returncode == 1
    assert f"{tmp_path / 'in.txt'}:3002: NullTokenizer" in result.stderr and "partition 2" in result.stderr
    assert os.listdir(tmp_path) == ["in.txt"]  # the other partitions' outputs and temporaries are gone too


def test_a_damaged_compressed_input_is_named(tmp_path):
    import gzip

    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": "1 2 3"}) + "\n" for _ in range(5000)))
    data = (tmp_path / "in.jsonl.gz").read_bytes()
    (tmp_path / "in.jsonl.gz").write_bytes(data[:len(data) // 2])
    result = run_tool("--input", str(tmp_path / "in.jsonl.gz"), "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 1 and f"--input {tmp_path / 'in.jsonl.gz'}: cannot be read" in result.stderr
    assert os.listdir(tmp_path) == ["in.jsonl.gz"]


def test_sigterm_stops_every_partition_and_leaves_nothing(tmp_path):
    (tmp_path / "in.txt").write_text("1 2 3\n" * 2_000_000)  # several seconds of work per partition
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
                             str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "out"), "--partitions", "2",
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress"],
                            stderr=subprocess.PIPE)
    deadline = time.time() + 30
    while sum(".tmp-" in f for f in os.listdir(tmp_path)) < 2 and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert os.listdir(tmp_path) == ["in.txt"]
