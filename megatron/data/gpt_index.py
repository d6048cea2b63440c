"""The GPT dataset's three indices, built in bounded memory and written to their files as they are built.

The indices (see `megatron.data.gpt_dataset`): `doc_idx`, the split's documents repeated for each epoch,
each epoch in its own random order; `sample_idx`, `[n + 1, 2]` (position in doc_idx, token offset) of the
first token of each sample (sample i starts at stream token `i * seq_length`); `shuffle_idx`, a permutation
of the samples that mixes samples of the same epoch only.

Why this module exists: a 2T-token run (seq 4096, ~1.8B documents, 488M samples) built them as whole int64
arrays with int64 temporaries (cumulative sums, sample starts), ~57 GB on the building rank. Here:

* dtypes follow what each array indexes (`index_dtype`): doc_idx holds document ids, int32 below 2^31
  documents; sample_idx holds positions in doc_idx (documents x epochs, which can pass 2^31 where the
  document count does not) and offsets below the longest document, int32 while `len(doc_idx) < 2^31`;
  shuffle_idx holds sample numbers, int32 below 2^31 samples. Otherwise int64.
* doc_idx: one epoch's permutation at a time (the Fisher-Yates shuffle needs its epoch whole), written out
  and dropped;
* sample_idx: doc_idx read back from its sink in chunks of `CHUNK` positions; per chunk one cumulative sum
  of the lengths and one `searchsorted` of the sample starts that fall in it (themselves cut into chunks of
  `CHUNK` samples), appended to the sink;
* shuffle_idx: one epoch's permutation at a time (or, with more than 1024 tiny epochs, chunks of whole
  epochs sorted by `epoch + U[0, 1)` keys).

Peak memory is the caller's size table (`sizes`, usually a view of the `.idx` memory map) plus the largest of
one epoch's document permutation (4 bytes a document), one epoch's sample permutation (4 bytes a sample) and
the chunk buffers (~40 bytes x CHUNK). bench/bench_index_build.py measures it; docs/data.md has the table.

The values are those of the former whole-array construction: the generator is called in the same order with
the same sizes (shuffling an int32 `arange` draws what `permutation` and `permuted` draw; `random` draws the
same stream in chunks), and a chunked cumulative sum is the same sum. tests/unit/test_index_memory.py compares
both on random size tables, several epochs and empty documents included.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Protocol, Union

import numpy as np

CHUNK = 1 << 20  # documents or samples per step of the chunked loops (~40 bytes each in flight)
INT32_LIMIT = 1 << 31
MANY_EPOCHS = 1024  # above this, the shuffle sorts random keys instead of permuting epoch by epoch

Documents = Union[tuple[int, int], np.ndarray]


def index_dtype(largest_value: int) -> np.dtype:
    """int32 when every value fits (below 2^31), else int64."""
    return np.dtype(np.int32 if largest_value < INT32_LIMIT else np.int64)


class ArraySink(Protocol):
    """Where an index array goes as it is built: rows appended in order, read back in chunks."""

    def append(self, block: np.ndarray) -> None: ...

    def chunks(self, rows: int) -> Iterator[np.ndarray]: ...

    def close(self) -> None: ...


class MemorySink:
    """An array filled in place (small indices, tests, and caches that cannot be written)."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.array = np.empty(shape, dtype)
        self._rows = 0

    def append(self, block: np.ndarray) -> None:
        self.array[self._rows:self._rows + len(block)] = block
        self._rows += len(block)

    def chunks(self, rows: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self.array), rows):
            yield self.array[start:start + rows]

    def close(self) -> None:
        if self._rows != len(self.array):
            raise RuntimeError(f"index array got {self._rows} rows, expected {len(self.array)}")


class NpyFileSink:
    """An `.npy` file written as it is built: the header (the shape is known up front), then rows appended.

    Plain writes rather than `np.lib.format.open_memmap`: a mapping of the whole output would count against
    the address space (RLIMIT_AS) and leave its dirty pages in this process's resident set.
    """

    def __init__(self, path: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(int(n) for n in shape)
        self._row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        self._file = open(path, "wb")
        np.lib.format.write_array_header_1_0(self._file, {
            "descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": self.shape})
        self._data_start = self._file.tell()
        self._rows = 0

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype)
        self._file.write(block.data.cast("B"))
        self._rows += len(block)

    def chunks(self, rows: int) -> Iterator[np.ndarray]:
        """The rows written so far, `rows` at a time, through one reused buffer (copy what you keep)."""
        self._file.flush()
        buffer = np.empty((rows,) + self.shape[1:], self.dtype)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self._data_start)
            left = self._rows
            while left:
                n = min(rows, left)
                view = memoryview(buffer[:n]).cast("B")
                got = 0
                while got < len(view):
                    read = f.readinto(view[got:])
                    if not read:
                        raise RuntimeError(f"{self.path} ended early while reading it back")
                    got += read
                yield buffer[:n]
                left -= n

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._rows != self.shape[0]:
            raise RuntimeError(f"{self.path} got {self._rows} rows, expected {self.shape[0]}")

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()


class SinkFactory(Protocol):
    def create(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> ArraySink: ...


class MemorySinks:
    """A `SinkFactory` keeping every array in memory (`arrays` once built)."""

    def __init__(self) -> None:
        self.sinks: dict[str, MemorySink] = {}

    def create(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> MemorySink:
        self.sinks[name] = MemorySink(dtype, shape)
        return self.sinks[name]

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return {name: sink.array for name, sink in self.sinks.items()}


# ------------------------------------------------------------------------------------------- the arithmetic
def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose token stream yields `num_samples` samples of `seq_length + 1` tokens."""
    # Samples available from e epochs: (e * T - 1) // L (the last sample needs one extra token).
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def _document_range(documents: Documents) -> Optional[tuple[int, int]]:
    if isinstance(documents, tuple):
        return int(documents[0]), int(documents[1])
    return None


def count_documents(documents: Documents) -> int:
    span = _document_range(documents)
    return span[1] - span[0] if span else len(documents)


def tokens_in(sizes: np.ndarray, documents: Documents) -> int:
    """Tokens of the selected documents (chunked: no int64 copy of the table)."""
    span = _document_range(documents)
    if span:
        return int(sizes[span[0]:span[1]].sum(dtype=np.int64))
    return sum(int(sizes[documents[i:i + CHUNK]].sum(dtype=np.int64)) for i in range(0, len(documents), CHUNK))


def _fresh_documents(documents: Documents, dtype: np.dtype) -> np.ndarray:
    span = _document_range(documents)
    if span:
        return np.arange(span[0], span[1], dtype=dtype)
    return np.array(documents, dtype=dtype)


def write_document_index(documents: Documents, num_epochs: int, rng: np.random.Generator, sink: ArraySink,
                         dtype: np.dtype) -> None:
    """`documents` repeated `num_epochs` times, each repetition in its own random order."""
    for _ in range(num_epochs):
        epoch = _fresh_documents(documents, dtype)
        rng.shuffle(epoch)  # draws what rng.permuted(tiled epochs, axis=1) drew for this row
        sink.append(epoch)
        del epoch  # before the next epoch's is made: one epoch in memory at a time


def document_dtype(documents: Documents) -> np.dtype:
    span = _document_range(documents)
    return index_dtype(span[1] - 1 if span else int(np.max(documents, initial=0)))


def sample_dtype(sizes: np.ndarray, doc_idx_len: int) -> np.dtype:
    """Positions in doc_idx (< doc_idx_len) and offsets (< the longest document) share one dtype."""
    longest = int(np.iinfo(sizes.dtype).max) if sizes.dtype.itemsize <= 4 else int(np.max(sizes, initial=0))
    return index_dtype(max(doc_idx_len - 1, longest))


def write_sample_index(sizes: np.ndarray, doc_idx_chunks: Iterator[np.ndarray], seq_length: int, num_samples: int,
                       sink: ArraySink) -> None:
    """(position in doc_idx, offset) of the first token of samples 0..num_samples (inclusive), chunk by chunk.

    Sample s starts at stream token t = s * seq_length, inside the document at the last position k with
    cum[k] <= t (cum[k]: stream position of the first token of doc_idx[k]); `side="right"` skips empty
    documents, as Megatron's loop does. A chunk of positions [p0, p1) owns the starts in [cum[p0], cum[p1]).
    """
    position, stream_end, next_sample = 0, 0, 0
    for docs in doc_idx_chunks:
        cum = np.empty(len(docs) + 1, dtype=np.int64)
        cum[0] = stream_end
        np.cumsum(sizes[docs], dtype=np.int64, out=cum[1:])
        cum[1:] += stream_end
        stream_end = int(cum[-1])
        owned_end = min(num_samples + 1, -(-stream_end // seq_length))  # samples starting before stream_end
        for first in range(next_sample, owned_end, CHUNK):
            starts = np.arange(first, min(first + CHUNK, owned_end), dtype=np.int64) * seq_length
            local = np.searchsorted(cum, starts, side="right") - 1
            rows = np.empty((len(starts), 2), dtype=np.int64)
            rows[:, 0] = local + position
            rows[:, 1] = starts - cum[local]
            sink.append(rows)
        next_sample = max(next_sample, owned_end)
        position += len(docs)
    if next_sample != num_samples + 1:
        raise ValueError(f"{num_samples} samples of {seq_length} tokens need more than the {stream_end} tokens given")


def write_shuffle_index(num_samples: int, seq_length: int, tokens_per_epoch: int, rng: np.random.Generator,
                        sink: ArraySink) -> None:
    """A permutation of the samples that only mixes samples of the same epoch (the one holding their first token)."""
    num_epochs = (max(num_samples - 1, 0) * seq_length) // tokens_per_epoch + 1

    def epoch_start(e: int) -> int:  # first sample whose first token lies in epoch e
        return min(num_samples, -(-e * tokens_per_epoch // seq_length))

    dtype = index_dtype(max(num_samples - 1, 0))
    if num_epochs <= MANY_EPOCHS:  # few epochs: one permutation each
        for e in range(num_epochs):
            a, b = epoch_start(e), (epoch_start(e + 1) if e + 1 < num_epochs else num_samples)
            order = np.arange(b - a, dtype=dtype)
            rng.shuffle(order)  # draws what rng.permutation(b - a) draws
            order += dtype.type(a)
            sink.append(order)
            del order
        return
    # Many tiny epochs: sorting `epoch + U[0, 1)` keys shuffles inside epochs and keeps their order. Chunks of
    # whole epochs: a key never leaves [epoch, epoch + 1), so sorting chunk by chunk sorts the whole.
    a = 0
    while a < num_samples:
        target = min(a + CHUNK, num_samples)
        b = num_samples
        if target < num_samples:
            e = target * seq_length // tokens_per_epoch  # the epoch of sample `target`
            b = epoch_start(e) if epoch_start(e) > a else epoch_start(e + 1)  # an epoch longer than CHUNK: whole
        keys = np.arange(a, b, dtype=np.int64) * seq_length // tokens_per_epoch + rng.random(b - a)
        sink.append(np.argsort(keys).astype(dtype) + dtype.type(a))
        a = b


def write_gpt_indices(sizes: np.ndarray, documents: Documents, seq_length: int, num_samples: int, seed: int,
                      sinks: SinkFactory) -> int:
    """Build the three indices for at least `num_samples` samples into `sinks`; returns the sample count.

    `documents`: a `(start, end)` range of document ids (no array of them is made), or an array of ids.
    """
    if seq_length <= 0:
        raise ValueError(f"--seq-length must be positive, got {seq_length}")
    tokens_per_epoch = tokens_in(sizes, documents)
    if tokens_per_epoch == 0:
        raise ValueError("the selected documents hold no tokens")
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_idx_len = num_epochs * count_documents(documents)
    rng = np.random.default_rng(seed)
    dtype = document_dtype(documents)
    doc_sink = sinks.create("doc_idx", dtype, (doc_idx_len,))
    write_document_index(documents, num_epochs, rng, doc_sink, dtype)
    sample_sink = sinks.create("sample_idx", sample_dtype(sizes, doc_idx_len), (total_samples + 1, 2))
    write_sample_index(sizes, doc_sink.chunks(CHUNK), seq_length, total_samples, sample_sink)
    shuffle_sink = sinks.create("shuffle_idx", index_dtype(max(total_samples - 1, 0)), (total_samples,))
    write_shuffle_index(total_samples, seq_length, tokens_per_epoch, rng, shuffle_sink)
    for sink in (doc_sink, sample_sink, shuffle_sink):
        sink.close()
    return total_samples


def build_gpt_indices(sizes: np.ndarray, documents: Documents, seq_length: int, num_samples: int,
                      seed: int) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices in memory (pure function; small datasets and tests)."""
    sinks = MemorySinks()
    write_gpt_indices(sizes, documents, seq_length, num_samples, seed, sinks)
    return sinks.arrays


def build_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """The sample index of a given document index, in memory."""
    sink = MemorySink(sample_dtype(sizes, len(doc_idx)), (num_samples + 1, 2))
    write_sample_index(sizes, (doc_idx[i:i + CHUNK] for i in range(0, len(doc_idx), CHUNK)), seq_length,
                       num_samples, sink)
    sink.close()
    return sink.array


def build_shuffle_index(num_samples: int, seq_length: int, tokens_per_epoch: int,
                        rng: np.random.Generator) -> np.ndarray:
    """The shuffle index, in memory."""
    sink = MemorySink(index_dtype(max(num_samples - 1, 0)), (num_samples,))
    write_shuffle_index(num_samples, seq_length, tokens_per_epoch, rng, sink)
    sink.close()
    return sink.array
