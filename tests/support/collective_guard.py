"""Turns on `megatron.comm`'s collective guard for the whole test session, spawned workers included.

The environment variable is inherited by every process a test starts (torchrun, the DeepSpeed launcher,
mp.spawn); `megatron.comm` installs the guard when it is imported there. In this process we install it now.
"""
from __future__ import annotations

import os


def enable() -> None:
    from megatron import comm

    os.environ[comm.GUARD_ENV] = "1"
    comm.install_collective_guard()
