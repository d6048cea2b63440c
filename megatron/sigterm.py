"""How a rank of a multi-process run ends on SIGTERM: one line naming the ranks whose heartbeat stopped, then exit.

torchrun and the DeepSpeed launcher send SIGTERM to every worker as soon as one fails (SIGKILL follows 30 s later);
schedulers send it at a time limit or on `scancel`. Without a handler the rank would vanish without a word whenever
the SIGTERM overtakes the failed collective that `megatron.errors.report_peer_failure` reports, and its log would
not say which rank to look at. With one, the rank prints

    [rank 0] error: stopped by SIGTERM ...: rank 1 stopped answering (no heartbeat for 2 s); ...

and exits with 128 + SIGTERM, as the signal's default action would have ended it (no interpreter finalization).

A Python signal handler runs only when the main thread comes back to the interpreter, and a rank blocked in a
collective (NCCL waits in C++ until its timeout) may not for minutes: the launcher would wait 30 s for its SIGKILL
on every failure. So the handler in Python does nothing; `signal.set_wakeup_fd` makes the C-level handler write the
signal's number to a socket, and a thread of ours reading it does the work at once, whatever the main thread does.
It acts only while the Python handler is ours: `--exit-signal-handler` (save and exit after the iteration) and a
`.bin/.idx` publication holding SIGTERM back put their own in place for as long as they need it.

Only the first of this path and a peer-failure report prints its line (`claim`); the other waits for the exit.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from megatron import heartbeat

# Taken by whichever reports this rank's end first: the SIGTERM thread (which then sets the event) or a failed
# collective's report.
_leaving = threading.Lock()
_sigterm_reporting = threading.Event()


def claim() -> None:
    """For the other path that prints a rank's last line (`megatron.errors.report_peer_failure`): returns at once
    unless the SIGTERM thread is printing its line; then it waits for that thread to end the process."""
    if not _leaving.acquire(blocking=False) and _sigterm_reporting.is_set():
        threading.Event().wait()


def _python_handler(signum, frame) -> None:
    """The handler in Python: nothing to do (the thread acts); it keeps the default action from killing us."""


def installed() -> bool:
    return signal.getsignal(signal.SIGTERM) is _python_handler


def install() -> bool:
    """Install the SIGTERM line (a rank of a multi-process run, once its groups are up); whether it was installed.
    Needs the main thread, and leaves alone a process whose SIGTERM handler or wakeup fd someone else already set."""
    if (installed() or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return False
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone else's (an event loop): put it back
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return False
    signal.signal(signal.SIGTERM, _python_handler)
    threading.Thread(target=_watch, args=(reader, writer), name="megatron-sigterm", daemon=True).start()
    return True


def _watch(reader: socket.socket, writer: socket.socket) -> None:
    # `writer` is held here so that its fd stays open while the C-level handler may write to it.
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        if int(signal.SIGTERM) in data and installed():
            _leave()


def _leave() -> None:
    """Print the line and end the process, unless a peer-failure report got there first (it ends the process)."""
    if not _leaving.acquire(blocking=False):
        return
    _sigterm_reporting.set()
    # no rank silent or failed: every rank got the signal
    suspects = heartbeat.suspects(none_silent="the signal came from outside the job (a time limit, scancel, kill)")
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: stopped by SIGTERM (torchrun and the DeepSpeed launcher send it to every worker once one "
          "fails; a scheduler sends it at a time limit or on scancel)"
          f"{f': {suspects}' if suspects else ''}; the log of a rank named here says why. Under torchrun "
          "--max-restarts the next attempt resumes from the newest checkpoint (docs/reliability.md)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signal.SIGTERM)
