"""How entry points end on a user's mistake: one line naming what is wrong and how to fix it, no traceback.

`pretrain_gpt.py` and the tools run their `main` through `run_cli`. Bad flags, data files and checkpoints raise
`ValueError` (the project's own `CheckpointError` is one; data and flag checks raise it with the flag or file to
fix) or `OSError` (a missing file, a full disk). Those print `error: <message>` on stderr and exit with code 2;
`MEGATRON_TRACEBACK=1` lets them propagate with their traceback, for debugging.

A collective that failed because another rank died or stopped answering (gloo's "Connection closed/reset by peer",
a timed-out collective, NCCL's aborted communicator) is not this rank's bug either: one line saying so, exit code 4;
the rank that failed has its own log, and torchrun's `--max-restarts` starts the next attempt. Anything else is a
bug and keeps its traceback.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Optional

USER_ERROR_EXIT_CODE = 2
USER_ERRORS = (ValueError, OSError)
PEER_FAILURE_EXIT_CODE = 4
# What gloo and NCCL say when the other end of a collective is gone or silent.
_PEER_FAILURE = re.compile(r"connection (closed|reset) by peer|timed out|broken pipe|connection refused|"
                           r"nccl communicator was aborted|watchdog caught collective operation timeout", re.I)


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


def report_peer_failure(exc: BaseException) -> int:
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    print(f"{_rank_prefix()}error: a collective failed because another rank died or stopped answering ({first}); "
          "that rank's own log says why. Under torchrun --max-restarts the next attempt resumes from the newest "
          "checkpoint (docs/reliability.md)", file=sys.stderr, flush=True)
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
