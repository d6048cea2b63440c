"""`PREFIX.manifest.json`: proof that a `.bin/.idx` pair was published together, and its token-id range.

Why: a pair is published with two renames, and a run killed between them while regenerating an existing
prefix leaves the new `.bin` beside the old `.idx`. The old offsets usually fit inside the new file, so
the format's own checks pass and training reads wrong document boundaries. The `.bin/.idx` bytes must
stay exactly Megatron's, so the proof lives in a third, small file:

    {"format": "megatron-indexed-dataset-manifest", "version": 1, "state": "complete",
     "bin": {"size": 30600, "head_sha256": "...", "tail_sha256": "..."},   # first / last 1 MiB
     "idx": {"size": 6042, "head_sha256": "...", "tail_sha256": "..."},
     "dtype": "uint16", "sequences": 300, "documents": 300,
     "token_range": {"min": 0, "min_sequence": 4, "max": 127, "max_sequence": 12},
     "writer": {"host": "...", "pid": 1234, "time": "2025-01-01T00:00:00Z"}}

Publishing (`MMapIndexedDatasetBuilder.finalize`): (1) the manifest is replaced by a "publishing" marker,
(2) `.bin` and (3) `.idx` are renamed into place, (4) the complete manifest is written. Every JSON write
is a temporary file, fsync and rename. A crash before (1) leaves the old pair with its old manifest; a
crash after (1) and before (4) leaves the marker, and the reader refuses the pair (re-run preprocessing);
after (4) the new pair is complete. So a pair with a manifest is consistent by construction.

Reading (`MMapIndexedDataset`): a complete manifest must match both files' sizes and the hashes of their
first and last MiB (a few milliseconds, whatever the size); a mismatch or a marker is a
`CorruptIndexedDatasetError` naming the prefix and the fix. Pairs without a manifest (written by
Megatron-LM or another tool) are read as before, with the format checks only; their token-id range is
scanned once and cached (`megatron.data.token_range`). The "largest token id" recorded here is what lets
training refuse ids beyond the vocabulary without reading terabytes at every start.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any, Optional

from megatron.data.errors import CorruptIndexedDatasetError

MANIFEST_FORMAT = "megatron-indexed-dataset-manifest"
MANIFEST_VERSION = 1
HEAD_TAIL_BYTES = 1 << 20
COMPLETE, PUBLISHING = "complete", "publishing"


def manifest_path(prefix: str) -> str:
    return prefix + ".manifest.json"


@dataclass(frozen=True)
class FileFingerprint:
    """Size and hashes of the first and last `HEAD_TAIL_BYTES` of a file: cheap, and catches a swapped
    or truncated file (the head holds the .idx header and first offsets, the tail the last ones)."""

    size: int
    head_sha256: str
    tail_sha256: str

    @classmethod
    def of(cls, path: str) -> "FileFingerprint":
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = hashlib.sha256(f.read(HEAD_TAIL_BYTES)).hexdigest()
            f.seek(max(0, size - HEAD_TAIL_BYTES))
            tail = hashlib.sha256(f.read(HEAD_TAIL_BYTES)).hexdigest()
        return cls(size, head, tail)


@dataclass(frozen=True)
class TokenRange:
    """Smallest and largest token id of a dataset and the sequences holding them (None when empty)."""

    min: Optional[int] = None
    min_sequence: Optional[int] = None
    max: Optional[int] = None
    max_sequence: Optional[int] = None

    @classmethod
    def from_dict(cls, data: dict) -> "TokenRange":
        return cls(**{k: (None if data.get(k) is None else int(data[k]))
                      for k in ("min", "min_sequence", "max", "max_sequence")})


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some filesystems do not open folders; the rename is then as durable as they make it
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write `obj` to `path` so that readers see the old file or the whole new one, even after a power cut."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _writer() -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"host": socket.gethostname(), "pid": os.getpid(), "time": now}


def mark_publishing(prefix: str) -> None:
    """Step (1): replace any manifest with a marker that says the pair is being replaced."""
    write_json_atomic(manifest_path(prefix), {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                                              "state": PUBLISHING, "writer": _writer()})


def write_manifest(prefix: str, dtype: str, sequences: int, documents: int, token_range: TokenRange) -> None:
    """Step (4): describe the pair now under the final names."""
    write_json_atomic(manifest_path(prefix), {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "state": COMPLETE,
        "bin": asdict(FileFingerprint.of(prefix + ".bin")), "idx": asdict(FileFingerprint.of(prefix + ".idx")),
        "dtype": dtype, "sequences": sequences, "documents": documents,
        "token_range": asdict(token_range), "writer": _writer()})


def _rerun(prefix: str) -> str:
    return (f"re-run tools/preprocess_data.py for {prefix} (if you replaced the .bin/.idx on purpose with "
            f"another tool, delete {manifest_path(prefix)}: the pair is then read with the format checks only)")


def read_manifest(prefix: str) -> Optional[dict]:
    """The complete manifest of `prefix`, None if it has none; a marker or a damaged one raises."""
    path = manifest_path(prefix)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a {MANIFEST_FORMAT} file")
    except ValueError as err:
        raise CorruptIndexedDatasetError(f"{path} is unreadable ({err}): {_rerun(prefix)}") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise CorruptIndexedDatasetError(f"{path} has manifest version {manifest.get('version')}, this code reads "
                                         f"version {MANIFEST_VERSION}: {_rerun(prefix)}")
    if manifest.get("state") == PUBLISHING:
        w = manifest.get("writer", {})
        raise CorruptIndexedDatasetError(
            f"{prefix}: the run that was writing this .bin/.idx pair (pid {w.get('pid')} on {w.get('host')}, "
            f"started publishing at {w.get('time')}) stopped before it finished, so the .bin and .idx may come from "
            f"different runs: {_rerun(prefix)}")
    if manifest.get("state") != COMPLETE:
        raise CorruptIndexedDatasetError(f"{path}: unknown state {manifest.get('state')!r}: {_rerun(prefix)}")
    return manifest


def verify_manifest(prefix: str, manifest: dict) -> TokenRange:
    """Check both files against their manifest; returns the recorded token-id range."""
    for ext in ("bin", "idx"):
        path = f"{prefix}.{ext}"
        try:
            expected = FileFingerprint(**manifest[ext])
        except (KeyError, TypeError):
            raise CorruptIndexedDatasetError(f"{manifest_path(prefix)} lacks the {ext!r} entry: {_rerun(prefix)}") \
                from None
        if os.path.getsize(path) != expected.size:
            what = f"{path} has {os.path.getsize(path)} bytes, the manifest says {expected.size}"
        else:
            actual = FileFingerprint.of(path)
            if actual == expected:
                continue
            part = "first" if actual.head_sha256 != expected.head_sha256 else "last"
            what = f"the {part} MiB of {path} differs from what the manifest recorded"
        raise CorruptIndexedDatasetError(
            f"{prefix}: the .bin/.idx pair does not match {manifest_path(prefix)} ({what}): the files were "
            f"changed or only partly replaced after they were written: {_rerun(prefix)}")
    return TokenRange.from_dict(manifest.get("token_range", {}))


def pair_is_complete(prefix: str) -> bool:
    """Whether `prefix.bin/.idx` were published whole by our writer: a complete manifest matching both files.

    A pair without a manifest, with a "publishing" marker (a writer killed mid-publish) or with files that no
    longer match is not; tools that skip existing outputs must redo those.
    """
    try:
        manifest = read_manifest(prefix)
        if manifest is None:
            return False
        verify_manifest(prefix, manifest)
    except (CorruptIndexedDatasetError, OSError):
        return False
    return True
