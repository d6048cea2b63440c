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
as garbage tokens later. The writer streams tokens into temporary files and renames them in
`finalize()`, so an interrupted run never leaves a pair under the final name.
"""
from __future__ import annotations

import array
import os
import struct
from typing import Optional, Sequence, Union

import numpy as np

HDR_MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(HDR_MAGIC) + 8 + 1 + 8 + 8
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


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class CorruptIndexedDatasetError(ValueError):
    """A `.bin/.idx` pair whose contents contradict the format or each other."""


class MMapIndexedDataset:
    """Read-only view of a `.bin/.idx` pair; `ds[i]` is sequence i as a numpy array (no copy)."""

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path} not found: check the data path "
                                        f"{self.path_prefix!r} (the prefix, without .bin/.idx) or create it "
                                        "with tools/preprocess_data.py --output-prefix ...")
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

        if num_seqs:
            if self.sizes.min() < 0:
                raise corrupt("negative sequence length")
            ends = self.pointers + self.sizes.astype(np.int64) * self.dtype.itemsize
            if self.pointers.min() < 0 or ends.max() > bin_size:
                worst = int(np.argmax(ends))
                raise corrupt(f"sequence {worst} ends at byte {int(ends[worst])} beyond the end of "
                              f"{bin_path} ({bin_size} bytes): the .bin is truncated or belongs to another .idx")
        if num_doc_idx == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != num_seqs \
                or np.any(np.diff(self.doc_idx) < 0):
            raise corrupt(f"document index must rise from 0 to the {num_seqs} sequences")
        # np.memmap refuses empty files; an empty dataset needs no buffer.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.empty(0, np.uint8)

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


class MMapIndexedDatasetBuilder:
    """Streams documents into `PREFIX.bin/.idx` through temporary files; `finalize()` publishes them.

    Use as a context manager: leaving the block by an exception removes the temporary files.
    """

    def __init__(self, out_prefix: str, dtype: type = np.uint16) -> None:
        self.out_prefix = out_prefix
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin = data_file_path(out_prefix) + tag
        self._tmp_idx = index_file_path(out_prefix) + tag
        os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = array.array("i")  # 4 bytes a sequence, not a Python int object each
        self._doc_idx = array.array("q", [0])
        self._lo, self._hi = (np.iinfo(self.dtype).min, np.iinfo(self.dtype).max) \
            if self.dtype.kind in "iu" else (-np.inf, np.inf)

    def add_item(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one sequence (call `end_document` after the last sequence of a document)."""
        arr = np.asarray(tokens)
        if arr.size and arr.dtype != self.dtype and (arr.min() < self._lo or arr.max() > self._hi):
            raise ValueError(f"token ids in [{arr.min()}, {arr.max()}] do not fit the dataset dtype {self.dtype}: "
                             "use int32 for vocabularies of 65500 ids or more")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(arr.size)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one single-sequence document (the GPT case)."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> None:
        """Write the index and rename both files to their final names (.bin first, .idx last)."""
        self._bin.close()
        sizes = np.frombuffer(self._sizes, np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_idx, np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(HDR_MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", self._code))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
        os.replace(self._tmp_bin, data_file_path(self.out_prefix))
        os.replace(self._tmp_idx, index_file_path(self.out_prefix))

    def abort(self) -> None:
        """Drop everything written so far (nothing appears under the final names)."""
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "MMapIndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
