"""`--exit-on-stall-seconds S`: a rank on which no iteration has finished for S seconds ends itself.

A hang outside the collectives (a stuck filesystem under the data loader or a checkpoint save, a dead data worker,
a deadlock in Python) is not seen by `--distributed-timeout-minutes`: this rank never enters the collective that
would time out, and the other ranks wait in theirs. A daemon thread watches the time since the last finished
iteration (counted from the end of the first one, whose compilation and warm-up take as long as they take); past S
seconds it writes every thread's Python stack to a file, prints one line naming the file, and ends the process with
exit code 4 (`os._exit`: the main thread is stuck, nothing else would end it). torchrun `--max-restarts` then
restarts the job from the newest checkpoint, and the other ranks' failure lines name this rank (its heartbeat stops
with it). S must be longer than the slowest iteration together with an evaluation and a checkpoint save, and
shorter than `--distributed-timeout-minutes` for this rank to go first.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

from megatron.errors import PEER_FAILURE_EXIT_CODE

STALL_EXIT_CODE = PEER_FAILURE_EXIT_CODE  # a failure a restart may fix, like a peer's
end_process: Callable[[int], None] = os._exit  # the main thread is stuck: nothing else would end the process


class StallWatchdog:
    def __init__(self, seconds: float, rank: int, exit: Optional[Callable[[int], None]] = None) -> None:
        self.seconds, self.rank, self._exit = seconds, rank, exit
        self._last: Optional[float] = None  # monotonic time of the last finished iteration
        self._iteration = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megatron-stall-watchdog", daemon=True)
        self._thread.start()

    def finished(self, iteration: int) -> None:
        """Iteration `iteration` has finished (its save and evaluation included)."""
        self._iteration, self._last = iteration, time.monotonic()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.seconds / 4)):
            last = self._last
            if last is not None and time.monotonic() - last > self.seconds:
                self._stalled(time.monotonic() - last)
                return

    def _stalled(self, idle: float) -> None:
        stacks = os.path.join(tempfile.gettempdir(), f"megatron-stall-rank{self.rank}-{os.getpid()}.txt")
        try:
            with open(stacks, "w") as f:
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as exc:
            stacks = f"(not written: {exc})"
        prefix = f"[rank {self.rank}] " if os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"{prefix}error: no iteration finished for {idle:.0f} s since iteration {self._iteration} "
              f"(--exit-on-stall-seconds {self.seconds:g}): this rank is stuck outside the collectives (a filesystem, "
              f"a data worker, a deadlock); every thread's stack is in {stacks}. The process ends with exit code "
              f"{STALL_EXIT_CODE}; under torchrun --max-restarts the next attempt resumes from the newest checkpoint",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        (self._exit or end_process)(STALL_EXIT_CODE)
