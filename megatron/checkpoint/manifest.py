"""Each checkpoint's manifest: the size and CRC-32 of every file it holds, checked before a resume loads it.

    iter_0000100/manifest.json   {"version": 1, "files": {"mp_rank_00/model_optim_rng.pt": {"bytes": N,
                                  "crc32": C}, "train_state.json": {...}, ...}}

Written: each writer hands `torch.save` a `ChecksumFile`, which adds every chunk to a running CRC-32 as it goes to
the file: the checksum is of the bytes written, at the cost of one pass over memory already in cache (no second
read of the file). Each writer leaves its entries in the staging folder's `.manifest/` (one JSON per writing rank);
the commit merges them, with the JSON files it writes itself, into `manifest.json` before the folder takes its
`iter_*` name.

Checked: `problems(folder, part, parts)` compares every file's size and reads the CRC-32 of its share of the files
(the host group's ranks split the reading: one pass over the checkpoint in all). A folder without a manifest (saved
by older versions, by upstream Megatron or DeepSpeed) has nothing to check and loads as before.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Optional

MANIFEST_FILE = "manifest.json"
PARTS_DIR = ".manifest"  # inside the staging folder: one JSON of entries per writer, merged at the commit
MANIFEST_VERSION = 1
_READ_CHUNK = 16 << 20


class ChecksumFile:
    """A binary file opened for writing that keeps the CRC-32 and count of the bytes written through it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self.crc32 = 0
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        self.bytes += len(view)
        return self._file.write(view)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        """Flush, fsync and close."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> "ChecksumFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._file.close()

    def entry(self) -> dict:
        return {"bytes": self.bytes, "crc32": self.crc32}


def entry_of_bytes(data: bytes) -> dict:
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_part(staging: Path, writer: str, entries: dict[str, dict]) -> None:
    """Record the entries (path relative to `staging` -> {"bytes", "crc32"}) of the files `writer` wrote."""
    parts = staging / PARTS_DIR
    parts.mkdir(exist_ok=True)
    tmp = parts / f".{writer}.json.tmp"
    tmp.write_text(json.dumps(entries, sort_keys=True))
    os.replace(tmp, parts / f"{writer}.json")


def finish(staging: Path, extra: dict[str, dict]) -> None:
    """Merge the writers' parts and `extra` (files the committing process wrote) into the manifest, fsynced; the
    parts folder is removed. Called by the one committing process, after every writer is done."""
    files: dict[str, dict] = {}
    parts = staging / PARTS_DIR
    for part in sorted(parts.glob("*.json")) if parts.is_dir() else []:
        files.update(json.loads(part.read_text()))
        part.unlink()
    if parts.is_dir():
        parts.rmdir()
    files.update(extra)
    with open(staging / MANIFEST_FILE, "w") as f:
        json.dump({"version": MANIFEST_VERSION, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read(folder: Path) -> Optional[dict[str, dict]]:
    """The manifest's entries, None when the folder has none; a damaged manifest is itself a problem (ValueError)."""
    path = Path(folder) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is damaged ({exc.__class__.__name__}: {str(exc)[:100]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ValueError(f"{path} is damaged (no 'files' table)")
    return data["files"]


def problems(folder: Path, part: int = 0, parts: int = 1) -> Optional[str]:
    """What is wrong with `folder` against its manifest, None when nothing is (or it has no manifest).

    Sizes and presence are checked for every file; the CRC-32 is read for the files `part` of `parts` owns (sorted
    names, every `parts`-th one), so that the ranks of a job share the reading."""
    folder = Path(folder)
    try:
        files = read(folder)
    except ValueError as exc:
        return str(exc)
    if files is None:
        return None
    names = sorted(files)
    for name in names:
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{path} is missing"
        if size != files[name]["bytes"]:
            return f"{path} is truncated or overwritten: {size:,} bytes, {files[name]['bytes']:,} were written"
    for name in names[part::parts]:
        path = folder / name
        crc = file_crc32(path)
        if crc != files[name]["crc32"]:
            return (f"{path} fails its checksum: CRC-32 {crc:08x}, {files[name]['crc32']:08x} was written (the bytes "
                    "changed on disk)")
    return None


def refresh(folder: Path, name: str) -> None:
    """After a tool rewrote `folder/name` on purpose (an experiment's edit of a saved checkpoint): its manifest entry
    from the file as it is now. Nothing to do in a folder without a manifest."""
    folder = Path(folder)
    files = read(folder)
    if files is None:
        return
    path = folder / name
    files[name] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
    tmp = folder / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST_FILE)
