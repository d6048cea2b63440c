"""How entry points end on a user's mistake: one line naming what is wrong and how to fix it, no traceback.

`pretrain_gpt.py` and the tools run their `main` through `run_cli`. Bad flags, data files and checkpoints raise
`ValueError` (the project's own `CheckpointError` is one; data and flag checks raise it with the flag or file to
fix) or `OSError` (a missing file, a full disk). Those print `error: <message>` on stderr and exit with code 2;
`MEGATRON_TRACEBACK=1` lets them propagate with their traceback, for debugging. Anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

USER_ERROR_EXIT_CODE = 2
USER_ERRORS = (ValueError, OSError)


def show_tracebacks() -> bool:
    return os.environ.get("MEGATRON_TRACEBACK", "") not in ("", "0")


def report_user_error(exc: BaseException) -> int:
    """Print `exc` as one error line (with the rank in a multi-process run); the exit code to use."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    print(f"{prefix}error: {exc}", file=sys.stderr, flush=True)
    return USER_ERROR_EXIT_CODE


def run_cli(main: Callable[[Optional[list]], Any], argv: Optional[list] = None) -> int:
    """Run a tool's `main(argv)`; its int result (or 0) is the exit code, user errors exit 2 (module docstring)."""
    try:
        result = main(argv)
    except USER_ERRORS as exc:
        if show_tracebacks():
            raise
        return report_user_error(exc)
    return result if isinstance(result, int) else 0
