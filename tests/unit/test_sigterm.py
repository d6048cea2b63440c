"""megatron/sigterm.py: a rank of a multi-process run that gets SIGTERM while its main thread is blocked in C++ (a
TCPStore wait here; an NCCL wait on a GPU) prints one line naming the rank whose heartbeat stopped and exits with
128 + SIGTERM at once; a handler put in its place (`--exit-signal-handler`, a held-back publication) keeps the
signal until it is put back. The rank is a child process (the handler and the wakeup fd are process-wide); the test
hosts the store and plays rank 1, whose counter never moves."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatron import sigterm
from tests.support.config import REPO

CHILD = r"""
import datetime, signal, sys, time
import torch.distributed as dist
from megatron import heartbeat, sigterm
assert heartbeat.start(0, 2, "attempt") and sigterm.install()
client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=60))
if sys.argv[2] == "held":  # a handler of its own in place, as the training loop's --exit-signal-handler puts it
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: print("held", flush=True))
    print("ready", flush=True)
    while not client.check(["go"]):  # set by the test after its first SIGTERM (the handler runs in Python)
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, previous)
    signal.raise_signal(signal.SIGTERM)
print("ready", flush=True)
client.get("never")  # blocked in C++ for up to 60 s
"""


def _store(rank1: str) -> dist.TCPStore:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    server.set("attempt/megatron_heartbeat/1", rank1)
    return server


@pytest.fixture
def store():
    return _store("7")  # rank 1: one beat, then silence


def _child(store, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), mode], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=30)
    return proc


def test_a_rank_blocked_in_cxx_prints_the_silent_rank_and_exits_on_sigterm(store):
    proc = _child(store, "blocked")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    # the heartbeats are read for 2 s; the store wait would have held the main thread for 60
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - start < 30, (proc.returncode, err)
    line = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(line) == 1 and line[0].startswith("[rank 0] error: stopped by SIGTERM"), err
    assert ": rank 1 stopped answering (no heartbeat for 2 s);" in line[0], err


def test_a_handler_put_in_place_keeps_the_signal_until_ours_is_back(store):
    proc = _child(store, "held")
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "held\n"
    time.sleep(0.5)
    assert proc.poll() is None  # not ended by the thread: the handler in place took the signal
    store.set("go", "1")
    assert proc.stdout.readline() == "ready\n"
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "[rank 0] error: stopped by SIGTERM" in err, err


def test_a_handler_already_set_is_left_alone(monkeypatch):
    monkeypatch.setattr(signal, "getsignal", lambda signum: print)  # someone else's handler
    assert not sigterm.install() and not sigterm.installed()


def test_a_sigterm_that_every_rank_got_says_it_came_from_outside_the_job():
    """scancel or a time limit: rank 1 got it too and is reporting it, so no rank is named."""
    store = _store("reporting")  # held: the child talks to it until it exits
    proc = _child(store, "blocked")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert ("stopped by SIGTERM" in err and "every other rank is still alive (each heartbeat moved): the signal came "
            "from outside the job") in err, err
