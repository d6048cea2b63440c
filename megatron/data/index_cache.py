"""On-disk cache of the numpy index arrays (document / sample / shuffle / blending indices).

Arrays are stored as `.npy` files named by a hash of a description of everything that determines
them (data file contents via a hash of the sequence lengths, document range, sequence length, seed,
sample count, index-format version). A changed input therefore gets a new name instead of silently
reusing stale indices. Each file is written to a temporary name and `os.replace`d into place, so
several ranks building the same index at once, or a crash mid-write, never expose a partial file.
The description is saved next to the arrays as JSON for humans.

Location: `--data-cache-path` if given, else `index-cache/` next to the data prefix, else (that
folder not writable) `~/.cache/megatron-fp8/index-cache`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

FALLBACK_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "megatron-fp8", "index-cache")


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def resolve_cache_dir(data_cache_path: Optional[str], path_prefix: str) -> str:
    """The folder holding the indices of the dataset at `path_prefix`."""
    if data_cache_path:
        return data_cache_path
    beside_data = os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "index-cache")
    return beside_data if _writable_dir(beside_data) else FALLBACK_CACHE_DIR


def array_digest(array: np.ndarray) -> str:
    """Content hash of an array (identifies a dataset by its sequence lengths)."""
    return hashlib.md5(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


def description_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def _save_atomic(path: str, write: Callable[[object], None]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_or_build(cache_dir: str, tag: str, description: dict, names: Sequence[str],
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays `names` for `description`: memory-mapped from the cache, or built and saved.

    Files are `{cache_dir}/{tag}-{hash}-{name}.npy`; cached arrays come back as read-only memmaps.
    """
    stem = os.path.join(cache_dir, f"{tag}-{description_hash(description)}")
    paths = {name: f"{stem}-{name}.npy" for name in names}
    if all(os.path.isfile(p) for p in paths.values()):
        try:
            arrays = {name: np.load(p, mmap_mode="r", allow_pickle=False) for name, p in paths.items()}
            logger.info("loaded cached indices %s-*.npy", stem)
            return arrays
        except (OSError, ValueError) as err:  # unreadable cache entry: rebuild it
            logger.warning("rebuilding unreadable cached indices %s: %s", stem, err)
    arrays = build()
    if not _writable_dir(cache_dir):
        logger.warning("index cache %s is not writable (--data-cache-path): indices are rebuilt every run",
                       cache_dir)
        return arrays
    for name, path in paths.items():
        _save_atomic(path, lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
    _save_atomic(f"{stem}-description.json",
                 lambda f: f.write(json.dumps(description, indent=2, sort_keys=True).encode()))
    logger.info("built and cached indices %s-*.npy", stem)
    return arrays
