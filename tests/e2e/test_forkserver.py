"""The test launcher (tests/support/forkserver.py) gives a script what torchrun gives it: the same rank variables,
argv, working folder, thread count and merged output; a failing rank ends the launch; an import-time variable that
differs from the server's makes it a real process."""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.support import forkserver
from tests.support.config import REPO
from tests.support.launch import launch, run_checked, torchrun_command

SCRIPT = r'''
import json, os, sys, torch
keys = %r
report = json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "cwd": os.getcwd(),
                     "path0": sys.path[0], "threads": torch.get_num_threads(), "parent": os.getppid()})
# One write(2) of the whole line: print() writes the text and its newline separately when stdout is unbuffered
# (PYTHONUNBUFFERED), and the two ranks' lines then interleave on the shared pipe.
os.write(1, ("REPORT " + report + "\n").encode())
print("rank %%s on stderr" %% os.environ.get("RANK"), file=sys.stderr)
''' % (forkserver.RANK_VARIABLES,)


def _reports(text: str) -> list[dict]:
    found = [json.loads(line[len("REPORT "):]) for line in text.splitlines() if line.startswith("REPORT ")]
    return sorted(found, key=lambda r: r["env"]["RANK"] or "")


def test_ranks_see_what_torchrun_gives_them(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    real = run_checked(torchrun_command(2, str(script), "--flag", "x"), env=env)
    forked = launch(2, ["--flag", "x"], str(script), env=env)
    assert forked.returncode == 0, forked.stderr
    real_reports, forked_reports = _reports(real.stdout), _reports(forked.stdout)
    assert len(real_reports) == len(forked_reports) == 2
    for a, b in zip(real_reports, forked_reports):
        a["env"].pop("MASTER_PORT"), b["env"].pop("MASTER_PORT")
        assert b["parent"] != os.getpid()  # forked from the server, not started by this process
        a.pop("parent"), b.pop("parent")
        assert a == b
    assert forked_reports[0]["threads"] == 1 and forked_reports[0]["cwd"] == str(REPO)
    assert "rank 0 on stderr" in forked.stderr and "rank 1 on stderr" in forked.stderr


def test_a_failing_rank_ends_the_launch(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n")
    start = time.monotonic()
    out = launch(2, [], str(script))
    assert out.returncode == 1  # torchrun's code for a failed worker
    assert time.monotonic() - start < forkserver.TERMINATE_GRACE_S + 60  # rank 0 did not sleep its 600 s
    one = launch(1, [], str(tmp_path / "missing.py"))
    assert one.returncode == 2 and "can't open file" in one.stderr  # one process: the interpreter's own error


def test_an_import_time_variable_makes_a_real_process(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(SCRIPT)
    out = launch(1, [], str(script), env=dict(os.environ, MEGATRON_CPU_BF16_GEMM="fp32"))
    assert out.returncode == 0, out.stderr
    [report] = _reports(out.stdout)
    assert report["parent"] == os.getpid()


def _failing_worker(rank: int, message: str) -> None:
    if rank == 1:
        raise ValueError(message)


def test_spawn_reports_a_failing_worker():
    forked = forkserver.COUNTS["forked"]
    with pytest.raises(AssertionError, match="ValueError: planted"):
        forkserver.spawn(_failing_worker, ("planted",), 2)
    assert forkserver.COUNTS["forked"] == forked + 1  # through the server, not torch's spawn
