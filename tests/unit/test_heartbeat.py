"""megatron/heartbeat.py: each rank counts up its key in the job's store; after a failed collective the ranks whose
counter stood still are named, and ranks that left on purpose (reporting the failure themselves, or finished) are
not. Five ranks played by threads of this process on a real TCPStore."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from megatron import heartbeat


@pytest.fixture
def store_env(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setattr(heartbeat, "INTERVAL", 0.02)  # 50 beats in the 1 s a counter must stand still
    yield server
    heartbeat.stop()


def _peer(server, rank: int, prefix: str) -> heartbeat._Beat:
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    beat = heartbeat._Beat(dist.PrefixStore(f"{prefix}/megatron_heartbeat", client), rank, 5)
    beat.thread.start()
    return beat


def test_the_rank_whose_heartbeat_stopped_is_named_and_the_others_are_not(store_env):
    assert heartbeat.start(0, 5, "attempt")
    alive, dead, reporting, finished = (_peer(store_env, r, "attempt") for r in (1, 2, 3, 4))
    dead.stop.set()  # SIGKILL or SIGSTOP: its counter stands still from here on
    heartbeat._leave(reporting, "reporting")  # saw the failure too and is telling it
    heartbeat._leave(finished, "finished")  # its run ended
    assert heartbeat.suspects(stale=1.0) == "rank 2 stopped answering (no heartbeat for 1 s)"
    alive.stop.set()
    assert heartbeat.suspects() is None  # reported once: this rank's heartbeat is gone


def test_no_store_or_one_rank_means_no_heartbeat_and_no_suspect(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert not heartbeat.start(0, 2, "attempt") and heartbeat.suspects() is None
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert not heartbeat.start(0, 1, "attempt")


def test_a_rank_that_ended_with_an_error_is_named_with_its_exit_code(store_env):
    """A rank whose run ended with an error of its own (a user error: exit 2) stopped beating on purpose: not
    "stopped answering", but named with its code, beside a rank that did stop answering."""
    assert heartbeat.start(0, 5, "attempt")
    failed, dead, alive, finished = (_peer(store_env, r, "attempt") for r in (1, 2, 3, 4))
    dead.stop.set()
    heartbeat._leave(failed, "exited 2")  # as heartbeat.stop(2) leaves it
    heartbeat._leave(finished, "finished")
    assert heartbeat.suspects(stale=1.0) == ("rank 2 stopped answering (no heartbeat for 1 s) and rank 1 exited with "
                                             "code 2")
    alive.stop.set()


def test_stop_with_an_exit_code_leaves_it_for_the_others(store_env):
    assert heartbeat.start(3, 5, "attempt")
    reader = _peer(store_env, 0, "attempt")
    heartbeat.stop(3)
    reader.stop.set()
    assert reader.store.get("3") == b"exited 3"
