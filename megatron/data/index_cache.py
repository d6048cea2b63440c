"""On-disk cache of the numpy index arrays (document / sample / shuffle / blending indices).

Arrays are stored as `.npy` files named by a hash of a description of everything that determines
them (data file contents via a hash of the sequence lengths, document range, sequence length, seed,
sample count, index-format version). A changed input therefore gets a new name instead of silently
reusing stale indices. The description is saved next to the arrays as JSON for humans.

Builders write through sinks (`megatron.data.gpt_index.ArraySink`): each array goes to
`{name}.npy.tmp-{host}-{pid}` as it is built, so a 2T-token index never sits whole in memory, and is
`os.replace`d into place when every array is complete. Several ranks or nodes building the same entry at
once, or a crash mid-write, never expose a partial file (the host in the name keeps writers on different
nodes of a shared filesystem apart; their outputs are identical, so whichever rename lands last is right).
Temporary files of writers that died on this host are removed by the next build of the same entry.
Cached arrays are returned as read-only memory maps.

Location: `--data-cache-path` if given, else `index-cache/` next to the data prefix, else (that
folder not writable) `~/.cache/megatron-fp8/index-cache`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
from typing import Callable, Optional, Sequence

import numpy as np

from megatron.data.gpt_index import MemorySinks, NpyFileSink, SinkFactory

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


def temporary_suffix() -> str:
    """`.tmp-{host}-{pid}`: unique among the writers of a filesystem shared by several nodes."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}"


_TEMPORARY = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_writers_files(stem: str) -> None:
    """Temporary files of this entry left by writers on this host that are no longer running."""
    folder, base = os.path.split(stem)
    host = socket.gethostname()
    for name in os.listdir(folder):
        match = _TEMPORARY.search(name) if name.startswith(base) else None
        if match and match["host"] == host and not _pid_alive(int(match["pid"])):
            try:
                os.remove(os.path.join(folder, name))
                logger.warning("removed %s, left by an index build that stopped", os.path.join(folder, name))
            except FileNotFoundError:
                pass


class CacheWriter:
    """A `SinkFactory` writing each array to its temporary file; `commit` publishes them all."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths
        self.sinks: dict[str, NpyFileSink] = {}

    def create(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> NpyFileSink:
        self.sinks[name] = NpyFileSink(self.paths[name] + temporary_suffix(), dtype, shape)
        return self.sinks[name]

    def commit(self, description_path: str, description: dict) -> None:
        missing = set(self.paths) - set(self.sinks)
        if missing:
            raise RuntimeError(f"the index build wrote no {sorted(missing)}")
        for sink in self.sinks.values():
            sink.close()
        for name, sink in self.sinks.items():
            os.replace(sink.path, self.paths[name])
        tmp = description_path + temporary_suffix()
        with open(tmp, "w") as f:
            json.dump(description, f, indent=2, sort_keys=True)
        os.replace(tmp, description_path)

    def discard(self) -> None:
        for sink in self.sinks.values():
            sink.discard()
            if os.path.exists(sink.path):
                os.remove(sink.path)


def entry_paths(cache_dir: str, tag: str, description: dict, names: Sequence[str]) -> tuple[str, dict[str, str]]:
    """The stem `{cache_dir}/{tag}-{hash}` of an entry and the `.npy` path of each of its arrays."""
    stem = os.path.join(cache_dir, f"{tag}-{description_hash(description)}")
    return stem, {name: f"{stem}-{name}.npy" for name in names}


def build_entry(cache_dir: str, tag: str, description: dict, names: Sequence[str],
                build: Callable[[SinkFactory], None]) -> dict[str, str]:
    """Build an entry into the cache (files written as built, then published); returns the arrays' paths."""
    stem, paths = entry_paths(cache_dir, tag, description, names)
    _remove_dead_writers_files(stem)
    writer = CacheWriter(paths)
    try:
        build(writer)
        writer.commit(f"{stem}-description.json", description)
    finally:
        writer.discard()  # after a commit, nothing is left to remove
    logger.info("built and cached indices %s-*.npy", stem)
    return paths


def load_or_build(cache_dir: str, tag: str, description: dict, names: Sequence[str],
                  build: Callable[[SinkFactory], None]) -> dict[str, np.ndarray]:
    """The arrays `names` for `description`: memory-mapped from the cache, or built (and saved, then mapped).

    `build(sinks)` creates every array with `sinks.create(name, dtype, shape)` and appends its rows.
    Files are `{cache_dir}/{tag}-{hash}-{name}.npy`; they come back as read-only memory maps.
    """
    stem, paths = entry_paths(cache_dir, tag, description, names)
    if all(os.path.isfile(p) for p in paths.values()):
        try:
            arrays = {name: np.load(p, mmap_mode="r", allow_pickle=False) for name, p in paths.items()}
            logger.info("loaded cached indices %s-*.npy", stem)
            return arrays
        except (OSError, ValueError) as err:  # unreadable cache entry: rebuild it
            logger.warning("rebuilding unreadable cached indices %s: %s", stem, err)
    if not _writable_dir(cache_dir):
        logger.warning("index cache %s is not writable (--data-cache-path): indices are rebuilt every run, in memory",
                       cache_dir)
        sinks = MemorySinks()
        build(sinks)
        return sinks.arrays
    paths = build_entry(cache_dir, tag, description, names, build)
    return {name: np.load(p, mmap_mode="r", allow_pickle=False) for name, p in paths.items()}
