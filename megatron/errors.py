"""How entry points end on a user's mistake: one line naming what is wrong and how to fix it, no traceback.

`pretrain_gpt.py` and the tools run their `main` through `run_cli`. Bad flags, data files and checkpoints raise
`ValueError` (the project's own `CheckpointError` is one; data and flag checks raise it with the flag or file to
fix) or `OSError` (a missing file, a full disk). Those print `error: <message>` on stderr and exit with code 2;
`MEGATRON_TRACEBACK=1` lets them propagate with their traceback, for debugging.

A collective that failed because another rank died or stopped answering (gloo's "Connection closed/reset by peer",
a timed-out collective, NCCL's aborted communicator) is not this rank's bug either: one line saying so, exit code 4;
the line names the collective that failed and the ranks whose heartbeat stopped (megatron/heartbeat.py), whose own
logs say why, and torchrun's `--max-restarts` starts the next attempt. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import os
import re
import signal
import sys
from types import TracebackType
from typing import Any, Callable, Optional

from megatron import heartbeat, sigterm

USER_ERROR_EXIT_CODE = 2
USER_ERRORS = (ValueError, OSError)
PEER_FAILURE_EXIT_CODE = 4
# What gloo and NCCL say when the other end of a collective is gone or silent.
_PEER_FAILURE = re.compile(r"connection (closed|reset) by peer|timed out|broken pipe|connection refused|"
                           r"nccl communicator was aborted|watchdog caught collective operation timeout", re.I)


def json_reason(err: Any) -> str:
    """A `json.JSONDecodeError` as a clause that names the column: "Expecting value at column 5", "Unterminated
    string starting at column 9" (whose own message ends in "at")."""
    msg = err.msg if err.msg.endswith(" at") else f"{err.msg} at"
    return f"{msg} column {err.colno}"


def peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank died or stopped answering."""
    return isinstance(exc, RuntimeError) and bool(_PEER_FAILURE.search(str(exc)))


def show_tracebacks() -> bool:
    return os.environ.get("MEGATRON_TRACEBACK", "") not in ("", "0")


def report_user_error(exc: BaseException) -> int:
    """Print `exc` as one error line (with the rank in a multi-process run); the exit code to use."""
    print(f"{_rank_prefix()}error: {exc}", file=sys.stderr, flush=True)
    return USER_ERROR_EXIT_CODE


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def failed_call(tb: Optional[TracebackType]) -> Optional[str]:
    """The torch.distributed function a failed collective was called as (`all_reduce`, `barrier`, ...), with our
    frame that called it: the innermost frame of torch/distributed/ in the traceback and the megatron frame above
    it. None when no torch.distributed frame is in it (DDP's all-reduce runs in C++, under `backward`)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for i in range(len(frames) - 1, -1, -1):
        code = frames[i].f_code
        if f"torch{os.sep}distributed{os.sep}" in code.co_filename and not code.co_name.startswith("_"):
            ours = next((f for f in reversed(frames[:i]) if f.f_code.co_filename.startswith(_PACKAGE)
                         and os.path.basename(f.f_code.co_filename) != "comm.py"), None)
            where = (f" from megatron{os.sep}{ours.f_code.co_filename[len(_PACKAGE):]}:{ours.f_lineno}"
                     if ours is not None else "")
            return f"torch.distributed.{code.co_name}{where}"
    return None


def report_peer_failure(exc: BaseException) -> int:
    """One line: the collective that failed, the suspect ranks (their heartbeat stopped; waits a few seconds to
    tell), what the backend said; exit code 4."""
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    call = failed_call(exc.__traceback__)
    sigterm.claim()  # a SIGTERM's line came first: it ends the process in a moment
    # The launcher may stop this rank (torchrun sends SIGTERM once it sees a worker fail, and SIGKILL 30 s later):
    # the heartbeats need a moment to tell, after which the process ends anyway.
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    except ValueError:  # not the main thread: no handler to change
        previous = None
    try:
        suspects = heartbeat.suspects()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"{_rank_prefix()}error: {call or 'a collective'} failed because another rank died or stopped answering"
          f"{f': {suspects}' if suspects else ''} ({first}); that rank's own log says why. Under torchrun "
          "--max-restarts the next attempt resumes from the newest checkpoint (docs/reliability.md)",
          file=sys.stderr, flush=True)
    return PEER_FAILURE_EXIT_CODE


def run_cli(main: Callable[[Optional[list]], Any], argv: Optional[list] = None) -> int:
    """Run a tool's `main(argv)`; its int result (or 0) is the exit code, user errors exit 2, a failed peer 4
    (module docstring)."""
    try:
        result = main(argv)
    except USER_ERRORS as exc:
        if show_tracebacks():
            raise
        return report_user_error(exc)
    except RuntimeError as exc:
        if show_tracebacks() or not peer_failure(exc):
            raise
        return report_peer_failure(exc)
    return result if isinstance(result, int) else 0
