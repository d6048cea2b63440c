"""glibc malloc settings for training on the CPU: freed tensor memory stays in the process for the next step.

With glibc's defaults every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB) is a fresh
`mmap`, and every free of one an `munmap`: each training step maps its large activations and gradients again and
the kernel zeroes and faults in every page of them (demo model: logits alone are 32 MiB per micro-batch). Freed
memory at the top of the heap is also handed back above 128 KiB. `keep` turns both off through `mallopt`:
allocations come from the heap (M_MMAP_MAX=0), the heap is only trimmed above 2 GiB of free memory at its top
(M_TRIM_THRESHOLD) and grows in 256 MiB steps (M_TOP_PAD; pages count towards RSS only once touched). The price is
a resident set that stays at its peak, and a somewhat higher peak where freed blocks fragment (docs/performance.md
has both figures).

`MEGATRON_CPU_MALLOC=keep|system` chooses (unset: keep); `system` leaves glibc as it is. Settings a user already
made win: GLIBC_TUNABLES or MALLOC_*_ variables for these parameters, or a preloaded allocator (jemalloc, tcmalloc,
mimalloc) leave malloc alone, and the start-up line says so. Not glibc (musl, macOS): nothing to do, said once.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping, Optional

ENV_VAR = "MEGATRON_CPU_MALLOC"
_CHOICES = ("keep", "system")
# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
KEEP_SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 256 << 20))
# what the user may have set for the same four glibc parameters: environment variables and tunables
_USER_MALLOC_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")
_USER_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad",
                  "glibc.malloc.mmap_threshold")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

logger = logging.getLogger("megatron")
_applied: Optional[str] = None


class CpuMallocConfigError(ValueError):
    """`MEGATRON_CPU_MALLOC` holds a value we do not know."""


def requested(environ: Mapping[str, str] = os.environ) -> str:
    """"keep" or "system" from `MEGATRON_CPU_MALLOC` (unset or empty: keep); raises on any other value."""
    choice = environ.get(ENV_VAR, "").strip().lower() or "keep"
    if choice not in _CHOICES:
        raise CpuMallocConfigError(f"{ENV_VAR}={environ[ENV_VAR]!r} is not one of {', '.join(_CHOICES)}: unset it "
                                   f"(keep freed memory for reuse) or set system (glibc's own malloc settings)")
    return choice


def user_setting(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The malloc setting the user made before start-up, in words, or None."""
    preload = environ.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} is preloaded (LD_PRELOAD)"
    tunables = [t for t in _USER_TUNABLES if t + "=" in environ.get("GLIBC_TUNABLES", "")]
    if tunables:
        return f"GLIBC_TUNABLES sets {', '.join(tunables)}"
    named = [v for v in _USER_MALLOC_VARS if v in environ]
    return f"{', '.join(named)} set" if named else None


def glibc_version() -> Optional[str]:
    """"2.36" and the like on glibc, None on any other C library."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    return text.split()[-1] if text and text.startswith("glibc") else None


def _mallopt(settings) -> bool:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def configure(environ: Mapping[str, str] = os.environ) -> str:
    """Apply the choice once per process and log it; returns what was done ("keep", "system", "user", "absent",
    "refused"). Later calls return the first answer."""
    global _applied
    if _applied is not None:
        return _applied
    choice = requested(environ)
    mine = user_setting(environ)
    version = glibc_version()
    if choice == "system":
        _applied, line = "system", f"glibc's default malloc settings ({ENV_VAR}=system)"
    elif mine is not None:
        _applied, line = "user", f"left as set: {mine}"
    elif version is None:
        _applied, line = "absent", "not glibc: the C library's own settings"
    elif _mallopt(KEEP_SETTINGS):
        _applied, line = "keep", (f"glibc {version} keeps freed memory for reuse (no mmap per large tensor, "
                                  f"no trimming below 2 GiB; {ENV_VAR}=system keeps glibc's defaults)")
    else:
        _applied, line = "refused", f"glibc {version} refused mallopt: its default settings stay"
    logger.info("CPU malloc: %s", line)
    return _applied
