"""Data reliability where a process is involved: a real SIGKILL between the renames of a pair's
publication and a rerun of tools/preprocess_data.py, stale temporaries of a writer that is gone, and the one-line
errors of the tools and of `pretrain_gpt.py`."""
import os
import signal
import subprocess
import sys

import pytest

from megatron.data.errors import CorruptIndexedDatasetError, DataError
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import preprocess
from tests.support.config import REPO, tiny_argv
from tests.support.data import NEW_DOCS as NEW, NULL, OLD_DOCS as OLD, docs_with, write_builder, write_upstream
from tests.support.launch import pretrain_cli
from tests.support.processes import dead_pid


# ------------------------------------------------------------------------------------- atomic pairs (item 2)

def test_sigkill_between_the_renames_then_a_rerun(tmp_path):
    """A real kill at the exact point: no cleanup runs, the marker and a temporary .idx stay behind."""
    (tmp_path / "old.txt").write_text("1 2 3 4\n" * 400)
    (tmp_path / "new.txt").write_text((" ".join(map(str, range(10, 30))) + "\n") * 200)
    tool = [os.path.join(REPO, "tools", "preprocess_data.py"), "--output-prefix", str(tmp_path / "c"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress"]
    preprocess(str(tmp_path / "old.txt"), str(tmp_path / "c"), NULL, progress=False)
    kill_between_renames = (
        "import os, runpy, signal, sys\n"
        "real = os.replace\n"
        "def replace(src, dst):\n"
        "    if dst.endswith('.idx'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(src, dst)\n"
        "os.replace = replace\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    killed = subprocess.run([sys.executable, "-c", kill_between_renames, *tool, "--input", str(tmp_path / "new.txt")],
                            capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL
    left = sorted(os.listdir(tmp_path))
    assert "c_text_document.idx.tmp-" in " ".join(left)  # the killed run's leftover
    with pytest.raises(CorruptIndexedDatasetError, match="stopped before it finished"):
        MMapIndexedDataset(str(tmp_path / "c_text_document"))
    rerun = subprocess.run([sys.executable, *tool, "--input", str(tmp_path / "new.txt")], capture_output=True,
                           text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "left by an interrupted run" in rerun.stderr
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    ds = MMapIndexedDataset(str(tmp_path / "c_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == NEW


def test_stale_temporaries_are_removed_only_when_their_writer_is_gone(tmp_path):
    dead, alive = dead_pid(), os.getppid()
    stale = [f"c.bin.tmp-{dead}", f"c.idx.tmp-{dead}", f"c.manifest.json.tmp-{dead}"]
    kept = [f"c.bin.tmp-{alive}", f"other.bin.tmp-{dead}", f"c.bin.tmp-{dead}x"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"\0" * 100)
    # A writer on another host of a shared filesystem: its PID means nothing here, its lock does.
    remote = dead_pid()
    (tmp_path / f"c.bin.tmp-{remote}").write_bytes(b"\0")
    import fcntl
    with open(tmp_path / f"c.bin.tmp-{remote}", "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        write_builder(tmp_path / "c", OLD)
        assert (tmp_path / f"c.bin.tmp-{remote}").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(kept + [f"c.bin.tmp-{remote}", "c.bin", "c.idx",
                                                          "c.manifest.json"])

# ------------------------------------------------------------------------------- empty data (item 6)

def test_an_empty_preprocess_input_is_refused(tmp_path):
    write_builder(tmp_path / "out_text_document", OLD)  # an existing pair is left alone
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    (tmp_path / "in.jsonl").write_text("\n\n")
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
                             str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                             "NullTokenizer", "--vocab-size", "1000", "--no-progress"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"--input {tmp_path / 'in.jsonl'} holds no documents (it is empty" in result.stderr
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path) if f != "in.jsonl"} == before
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(DataError, match=r"all 1 non-blank line\(s\) were bad"):
        preprocess(str(tmp_path / "bad.jsonl"), str(tmp_path / "out2"), NULL, skip_bad_lines=True, progress=False)

# -------------------------------------------------------------------------- one line, no traceback (item 7)

def test_a_truncated_bin_stops_pretraining_with_one_line(tmp_path):
    write_upstream(tmp_path / "c", docs_with(5, 5))
    with open(tmp_path / "c.bin", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "c.bin") - 100)
    argv = tiny_argv(train_iters=3) + ["--data-path", str(tmp_path / "c"), "--tokenizer-type", "NullTokenizer"]
    argv.remove("--mock-data")
    out = pretrain_cli(*argv)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    [line] = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert f"{tmp_path / 'c'}.idx: sequence 299 ends at byte" in line and "tools/preprocess_data.py" in line
