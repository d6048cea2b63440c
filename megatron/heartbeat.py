"""Which rank failed: every rank's heartbeat in the job's store, compared when a collective fails.

Each rank of a multi-process run starts a daemon thread that counts up a key of its own in the rendezvous store
(`<prefix>/megatron_heartbeat/<rank>`) every `INTERVAL` seconds, on a store connection of its own. A rank that died
or was stopped (SIGKILL, SIGSTOP, a frozen node, a dead process) stops counting; a live rank counts on, whatever its
main thread is waiting for (a rank stuck in Python is `--exit-on-stall-seconds`' business). When a collective fails,
`suspects()` reads every counter twice, `STALE` seconds apart, and names the ranks whose counter did not move, and
those whose run ended with an error of their own (`stop(exit_code)`: a user error, a diverged run). No clocks are
compared, so nodes need not agree on the time.

The store is the one the ranks met through: torchrun's agent store (it outlives the workers), or the TCPStore the
launcher's MASTER_ADDR:MASTER_PORT names, which rank 0 hosts: when rank 0's process is gone, so is that store, and
`suspects()` says so.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

INTERVAL = 0.5  # seconds between beats
STALE = 2.0  # seconds a counter must stand still to name its rank (4 beats missed)
_PREFIX = "megatron_heartbeat"
_LEFT = ("reporting", "finished")  # the values of a rank that stopped beating on purpose: not a suspect
_EXITED = "exited "  # + the exit code: a rank whose run ended with an error of its own (it is named as such)


class _Beat:
    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="megatron-heartbeat", daemon=True)

    def _run(self) -> None:
        count = 0
        while not self.stop.is_set():
            count += 1
            try:
                self.store.set(str(self.rank), str(count))
            except Exception:  # the store is gone (its host died): nothing left to report to
                return
            self.stop.wait(INTERVAL)


_current: Optional[_Beat] = None


def start(rank: int, world: int, prefix: str) -> bool:
    """Start this rank's heartbeat under `prefix` (the attempt's prefix in the store); whether it runs. Needs the
    store's address in MASTER_ADDR / MASTER_PORT, as torchrun and the DeepSpeed launcher set them."""
    global _current
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world <= 1 or not host or not port or _current is not None:
        return False
    try:
        client = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
    except Exception:  # no store to beat into (a launch without one): the failure line names no suspect
        return False
    _current = _Beat(dist.PrefixStore(f"{prefix}/{_PREFIX}", client), rank, world)
    _current.thread.start()
    return True


def _leave(beat: _Beat, why: str) -> None:
    """Stop beating and say why, so that no other rank names this one."""
    beat.stop.set()
    beat.thread.join(timeout=2 * INTERVAL + 1)  # the store client is the caller's alone from here on
    try:
        beat.store.set(str(beat.rank), why)
    except Exception:
        pass


def stop(exit_code: int = 0) -> None:
    """Stop this rank's heartbeat at the end of its run: marked finished (a later failure elsewhere does not name
    it), or, for a non-zero `exit_code` (a user error, a diverged run), with that code, which the others name."""
    global _current
    if _current is not None:
        _leave(_current, "finished" if exit_code == 0 else f"{_EXITED}{exit_code}")
        _current = None


def _counters(beat: _Beat) -> dict[int, Optional[str]]:
    out: dict[int, Optional[str]] = {}
    for rank in range(beat.world):
        if rank != beat.rank:
            key = str(rank)
            out[rank] = beat.store.get(key).decode() if beat.store.check([key]) else None
    return out


def suspects(stale: float = STALE, none_silent: str = "look for the rank whose log ends first") -> Optional[str]:
    """After a failed collective: which other ranks stopped beating, as a phrase for the error line ("rank 3 stopped
    answering (no heartbeat for 2.5 s)"), or what could not be told; `none_silent` is the advice when every other
    rank is alive. None when this rank has no heartbeat. Waits `stale` seconds; stops this rank's heartbeat (the
    rank is leaving)."""
    global _current
    beat = _current
    if beat is None:
        return None
    _current = None
    _leave(beat, "reporting")  # this rank saw the failure too: not a suspect for the others
    try:
        beat.store.set_timeout(datetime.timedelta(seconds=5))
        first = _counters(beat)
        time.sleep(stale)
        second = _counters(beat)
    except Exception as exc:
        return (f"the heartbeats could not be read from the store ({exc.__class__.__name__}): the process hosting it "
                "(rank 0's, unless torchrun hosts it) may be the one that failed")
    exited = sorted(r for r in second if (second[r] or "").startswith(_EXITED))
    silent = sorted(r for r in second if r not in exited and second[r] not in _LEFT
                    and (second[r] is None or second[r] == first[r]))
    phrases = [f"rank{'s' if len(silent) > 1 else ''} {_names(silent)} stopped answering (no heartbeat for "
               f"{stale:g} s)"] if silent else []
    phrases += [f"rank {r} exited with code {second[r][len(_EXITED):]}" for r in exited[:16]]
    if not phrases:
        return f"every other rank is still alive (each heartbeat moved): {none_silent}"
    return " and ".join(phrases)


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
