"""What the benches share: launching processes (the test helpers take `free_port` and `REPO` from here too) and timing
calls."""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wall_times(fn: Callable[[], Any], calls: int) -> list[float]:
    """The wall time of each of `calls` calls of `fn`, in seconds."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times
