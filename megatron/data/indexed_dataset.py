"""Megatron-LM's memory-mapped token format (`PREFIX.bin` + `PREFIX.idx`): reader and writer.

The `.bin` file is the concatenation of all token sequences in one dtype. The `.idx` file is,
byte for byte as Megatron-LM writes it (all little-endian):

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version, 1
    uint8     dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    uint64    number of sequences N
    uint64    number of document-index entries D (= documents + 1; Megatron stores len(doc_idx))
    int32[N]  sequence lengths, in tokens
    int64[N]  byte offset of each sequence in the .bin file
    int64[D]  document index: doc_idx[0] = 0, doc_idx[-1] = N; document k = sequences [doc_idx[k], doc_idx[k+1])

GPT data has one sequence per document. The reader checks the header and the tables against the
file sizes on open, so a corrupt or truncated pair fails at once with the file named, rather than
as garbage tokens later. The writer streams tokens into temporary files (`PREFIX.bin.tmp-PID`) and
publishes them in `finalize()` under the protocol of `megatron.data.manifest`: a `PREFIX.manifest.json`
(sizes, head/tail hashes, token-id range) is written last and checked by the reader, so a run killed
between the two renames cannot pass for a consistent pair. The `.bin/.idx` bytes stay Megatron's.
The next writer of a prefix removes the temporary files that killed writers left behind.
"""
from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import re
import signal
import struct
import threading
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from megatron.data.errors import CorruptIndexedDatasetError, DatasetNotFoundError
from megatron.data.manifest import TokenRange, mark_publishing, read_manifest, verify_manifest, write_manifest

__all__ = ["CorruptIndexedDatasetError", "DatasetNotFoundError", "MMapIndexedDataset", "MMapIndexedDatasetBuilder",
           "TemporaryPair", "best_fitting_dtype", "dtype_code", "remove_own_temporaries", "remove_stale_temporaries",
           "write_index_header"]

logger = logging.getLogger(__name__)

HDR_MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(HDR_MAGIC) + 8 + 1 + 8 + 8
TABLE_CHUNK = 1 << 22  # index entries checked per step on open
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}


def dtype_code(dtype: np.dtype) -> int:
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} is not in Megatron's .idx dtype table {sorted(DTYPES)}")


def best_fitting_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every id fits (Megatron's threshold, 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def search_table(table: np.ndarray, value: int) -> int:
    """`np.searchsorted(table, value, side="right")` for a sorted `.idx` table, without copying it.

    The tables sit at offsets that are not 8-byte aligned (a 34-byte header, then 4-byte lengths), and numpy
    copies an unaligned array whole before searching it: 14 GB for the offsets of 1.8B documents. Here one
    strided sample of every TABLE_CHUNK-th entry, then one block, are copied.
    """
    starts = np.array(table[::TABLE_CHUNK])
    block = int(np.searchsorted(starts, value, side="right"))
    if block == 0:
        return 0
    first = (block - 1) * TABLE_CHUNK
    return first + int(np.searchsorted(np.array(table[first:first + TABLE_CHUNK]), value, side="right"))


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def _near(prefix: str) -> str:
    """A hint when the user is close: tools/preprocess_data.py appends `_<json-key>_document` (`_text_document` for
    the default key) to its --output-prefix, and that dataset exists."""
    found = [prefix + suffix for suffix in ("_text_document", "_content_document")
             if os.path.isfile(index_file_path(prefix + suffix)) and os.path.isfile(data_file_path(prefix + suffix))]
    return f". Did you mean {found[0]!r}? (tools/preprocess_data.py adds _text_document to its prefix)" if found else ""


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class MMapIndexedDataset:
    """Read-only view of a `.bin/.idx` pair; `ds[i]` is sequence i as a numpy array (no copy).

    `recorded_token_range` is the token-id range from the pair's manifest (None for a pair without one).
    """

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        # The manifest first: for a half-published pair it says what happened, where the format checks
        # below would only report a symptom (a missing or short file) or, worse, pass.
        manifest = read_manifest(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DatasetNotFoundError(f"indexed dataset file {path} not found: check the data path "
                                           f"{self.path_prefix!r} (the prefix, without .bin/.idx) or create it "
                                           "with tools/preprocess_data.py --output-prefix ..."
                                           + _near(self.path_prefix))
        self.recorded_token_range: Optional[TokenRange] = (
            None if manifest is None else verify_manifest(self.path_prefix, manifest))
        idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)

        def corrupt(why: str) -> CorruptIndexedDatasetError:
            return CorruptIndexedDatasetError(f"{idx_path}: {why}; regenerate the pair with tools/preprocess_data.py")

        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if not HDR_MAGIC.startswith(header[:len(HDR_MAGIC)]):
            raise corrupt(f"bad magic {header[:len(HDR_MAGIC)]!r}, expected {HDR_MAGIC!r} "
                          "(not a Megatron mmap .idx file)")
        if len(header) < HEADER_BYTES:
            raise corrupt(f"only {idx_size} bytes, shorter than the {HEADER_BYTES}-byte header (truncated)")
        offset = len(HDR_MAGIC)
        (version,) = struct.unpack_from("<Q", header, offset)
        if version != VERSION:
            raise corrupt(f"unknown version {version}, only version {VERSION} is supported")
        (code,) = struct.unpack_from("<B", header, offset + 8)
        if code not in DTYPES:
            raise corrupt(f"unknown dtype code {code}, expected one of {sorted(DTYPES)}")
        num_seqs, num_doc_idx = struct.unpack_from("<QQ", header, offset + 9)
        expected = HEADER_BYTES + num_seqs * (4 + 8) + num_doc_idx * 8
        if idx_size != expected:
            raise corrupt(f"header says {num_seqs} sequences and {num_doc_idx} document-index entries, "
                          f"which take {expected} bytes, but the file has {idx_size}"
                          + (" (truncated)" if idx_size < expected else " (trailing bytes)"))
        self.dtype = np.dtype(DTYPES[code])
        self._idx_mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(self._idx_mmap, np.int32, num_seqs, HEADER_BYTES)
        self.pointers = np.frombuffer(self._idx_mmap, np.int64, num_seqs, HEADER_BYTES + 4 * num_seqs)
        self.doc_idx = np.frombuffer(self._idx_mmap, np.int64, num_doc_idx, HEADER_BYTES + 12 * num_seqs)

        if num_doc_idx == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != num_seqs:
            raise corrupt(f"document index must rise from 0 to the {num_seqs} sequences")
        if self.recorded_token_range is not None:
            # A complete manifest that matches both files vouches for the tables our writer laid out (offsets are
            # the running sum of the lengths): only the last sequence's end is checked, in O(1), so opening a
            # 1.8B-document pair does not read its 36 GB index on every rank at every start.
            self.data_bytes = 0
            if num_seqs:
                self.data_bytes = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
                if self.data_bytes != bin_size:
                    raise corrupt(f"the last sequence ends at byte {self.data_bytes}, but {bin_path} has {bin_size}")
        else:
            self.data_bytes = self._check_tables(bin_path, bin_size, corrupt)
        # np.memmap refuses empty files; an empty dataset needs no buffer.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.empty(0, np.uint8)

    def _check_tables(self, bin_path: str, bin_size: int, corrupt) -> int:
        """Lengths, offsets and document index against the `.bin` size, chunk by chunk (constant memory);
        returns the end of the last byte any sequence uses."""
        data_bytes, itemsize = 0, self.dtype.itemsize
        for start in range(0, len(self.sizes), TABLE_CHUNK):
            sizes = self.sizes[start:start + TABLE_CHUNK]
            pointers = self.pointers[start:start + TABLE_CHUNK]
            if sizes.min() < 0:
                raise corrupt("negative sequence length")
            ends = pointers + sizes.astype(np.int64) * itemsize
            if pointers.min() < 0 or ends.max() > bin_size:
                worst = start + int(np.argmax(ends))
                raise corrupt(f"sequence {worst} ends at byte {int(ends.max())} beyond the end of "
                              f"{bin_path} ({bin_size} bytes): the .bin is truncated or belongs to another .idx")
            data_bytes = max(data_bytes, int(ends.max()))
        for start in range(0, len(self.doc_idx) - 1, TABLE_CHUNK):
            if np.any(np.diff(self.doc_idx[start:start + TABLE_CHUNK + 1]) < 0):
                raise corrupt(f"document index must rise from 0 to the {len(self.sizes)} sequences")
        return data_bytes

    def __getstate__(self) -> dict:
        # DataLoader workers reopen the maps instead of pickling their contents.
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when length is None)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of length {size}")
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def __getitem__(self, idx: Union[int, np.integer]) -> np.ndarray:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        return self.get(int(idx) % len(self))


_TEMP_SUFFIX = re.compile(r"\.(?:bin|idx|manifest\.json)\.tmp-(\d+)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _locked_by_a_writer(path: str) -> bool:
    """Whether a live writer holds `path` (writers keep an exclusive flock on their temporary .bin). This
    covers a writer on another host of a shared filesystem, whose PID means nothing here."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # gone, or a filesystem without locks: the PID test alone decides
        return False
    return False


def remove_stale_temporaries(prefix: str) -> list[str]:
    """Remove `PREFIX.{bin,idx,manifest.json}.tmp-PID` files whose writer is dead; returns their paths."""
    folder, base = os.path.split(os.path.abspath(prefix))
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _TEMP_SUFFIX.fullmatch(name[len(base):]) if name.startswith(base) else None
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _pid_alive(pid) or _locked_by_a_writer(os.path.join(folder, f"{base}.bin.tmp-{pid}")):
            continue
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
            os.remove(path)
        except FileNotFoundError:  # another writer cleaned it first
            continue
        removed.append(path)
        logger.warning("removed %s (%d bytes), left by an interrupted run (pid %d, not running)", path, size, pid)
    return removed


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while the pair is published, so Ctrl-C or a scheduler's SIGTERM lands after the
    manifest is written; only SIGKILL or a crash can stop a publication halfway (the manifest then says so).

    The Python handlers are swapped for recorders rather than the signals masked: a process-directed signal
    would reach another thread (torch and multiprocessing start some) that does not mask it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:  # None: installed outside Python, which could not be put back
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(received):  # now delivered to the handlers they were meant for
            signal.raise_signal(sig)


def write_index_header(f, dtype: np.dtype, num_sequences: int, num_doc_idx: int) -> None:
    """The `.idx` header; the three tables follow (lengths, byte offsets, document index)."""
    f.write(HDR_MAGIC)
    f.write(struct.pack("<Q", VERSION))
    f.write(struct.pack("<B", dtype_code(dtype)))
    f.write(struct.pack("<Q", num_sequences))
    f.write(struct.pack("<Q", num_doc_idx))


def remove_own_temporaries(out_prefix: str) -> None:
    """Remove this process's `PREFIX.bin/.idx.tmp-PID`, whatever state its writer reached: a signal may stop a
    writer between creating its files and its caller holding it (then no `abort` can reach them)."""
    tag = f".tmp-{os.getpid()}"
    for path in (data_file_path(out_prefix) + tag, index_file_path(out_prefix) + tag):
        if os.path.exists(path):
            os.remove(path)


class TemporaryPair:
    """`PREFIX.bin/.idx.tmp-PID`, filled by a writer and then published as one (or removed).

    Creating it removes the temporaries that dead writers left under the prefix and locks the temporary `.bin`
    (which marks it as alive for `remove_stale_temporaries` on other hosts). `publish` runs the manifest protocol:
    marker, `.bin`, `.idx`, complete manifest, with SIGINT/SIGTERM held until it is done. Shared by the builder
    (preprocessing) and the merge (`megatron.data.merge`).
    """

    def __init__(self, out_prefix: str) -> None:
        self.out_prefix = out_prefix
        tag = f".tmp-{os.getpid()}"
        self.bin_path = data_file_path(out_prefix) + tag
        self.idx_path = index_file_path(out_prefix) + tag
        os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
        remove_stale_temporaries(out_prefix)
        self.bin = open(self.bin_path, "wb")
        try:
            fcntl.flock(self.bin.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # "alive" for remove_stale_temporaries
        except OSError:
            pass  # a filesystem without locks: the PID alone marks the file as ours

    def publish(self, dtype: np.dtype, sequences: int, documents: int, token_range: TokenRange) -> None:
        """Publish the temporary pair (its `.idx` written and synced by the caller) under the final names."""
        self.bin.flush()
        os.fsync(self.bin.fileno())  # renamed data must be on disk before a manifest vouches for it
        with _signals_deferred():
            mark_publishing(self.out_prefix)
            os.replace(self.bin_path, data_file_path(self.out_prefix))
            os.replace(self.idx_path, index_file_path(self.out_prefix))
            write_manifest(self.out_prefix, np.dtype(dtype).name, sequences, documents, token_range)
        self.bin.close()  # only now: the flock marked the temporary .bin as alive until it was renamed

    def abort(self) -> None:
        """Drop everything written so far (nothing new appears under the final names)."""
        self.bin.close()
        for path in (self.bin_path, self.idx_path):
            if os.path.exists(path):
                os.remove(path)


class MMapIndexedDatasetBuilder:
    """Streams documents into `PREFIX.bin/.idx` through temporary files; `finalize()` publishes them.

    Use as a context manager: leaving the block by an exception removes the temporary files.
    The builder records the smallest and largest token id as it goes, for the manifest. The lengths and the
    document index stay in memory until `finalize` (12 bytes a document: cut very large inputs with
    `--partitions`, whose outputs are merged by streaming).
    """

    def __init__(self, out_prefix: str, dtype: type = np.uint16) -> None:
        self.out_prefix = out_prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # a dtype outside Megatron's table fails here, before any file is made
        self._pair = TemporaryPair(out_prefix)
        self._bin = self._pair.bin
        self._sizes = array.array("i")  # 4 bytes a sequence, not a Python int object each
        self._doc_idx = array.array("q", [0])
        self._lo, self._hi = (np.iinfo(self.dtype).min, np.iinfo(self.dtype).max) \
            if self.dtype.kind in "iu" else (-np.inf, np.inf)
        self.token_range = TokenRange()

    def add_item(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one sequence (call `end_document` after the last sequence of a document)."""
        arr = np.asarray(tokens)
        if arr.size and arr.dtype != self.dtype and (arr.min() < self._lo or arr.max() > self._hi):
            raise ValueError(f"token ids in [{arr.min()}, {arr.max()}] do not fit the dataset dtype {self.dtype}: "
                             "use int32 for vocabularies of 65500 ids or more")
        out = np.ascontiguousarray(arr, dtype=self.dtype)
        if out.size:
            self._track_range(out)
            self._bin.write(out.data.cast("B"))
        self._sizes.append(arr.size)

    def _track_range(self, tokens: np.ndarray) -> None:
        r, seq = self.token_range, len(self._sizes)
        lo, hi = int(tokens.min()), int(tokens.max())
        if r.min is None or lo < r.min:
            r = TokenRange(lo, seq, r.max, r.max_sequence)
        if r.max is None or hi > r.max:
            r = TokenRange(r.min, r.min_sequence, hi, seq)
        self.token_range = r

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one single-sequence document (the GPT case)."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> None:
        """Write the index, then publish: manifest marker, `.bin`, `.idx`, complete manifest (in this order)."""
        sizes = np.frombuffer(self._sizes, np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_idx, np.int64)
        with open(self._pair.idx_path, "wb") as f:
            write_index_header(f, self.dtype, len(sizes), len(doc_idx))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        self._pair.publish(self.dtype, len(sizes), len(doc_idx) - 1, self.token_range)

    def abort(self) -> None:
        """Drop everything written so far (nothing new appears under the final names)."""
        self._pair.abort()

    def __enter__(self) -> "MMapIndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
