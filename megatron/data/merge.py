"""Merging `.bin/.idx` pairs into one, streaming (the engine of tools/merge_datasets.py and of
`tools/preprocess_data.py --partitions N`).

The result is what tokenizing the inputs' texts one after the other writes, byte for byte, and what
NVIDIA Megatron-LM's `tools/merge_datasets.py` writes: the `.bin` files concatenated; lengths concatenated;
byte offsets recomputed as the running sum of the lengths; document index `[0]` followed by each input's
document index without its leading 0, shifted by the sequences before it. All inputs must share one token
dtype (Megatron-LM asserts the same).

Constant memory: the `.bin` files are copied through one buffer, the tables streamed in chunks of
`TABLE_CHUNK` entries (three passes over the inputs' `.idx` files: lengths, offsets, document index), so
merging 1.8B documents takes as much memory as merging ten. Each input is checked to store its sequences
back to back (offsets equal to the running sum of lengths, `.bin` size equal to the data): Megatron-LM's
merge copies whole `.bin` files and recomputes offsets, so a gap would silently shift every later sequence.

The result is published like a preprocessing output (`TemporaryPair`: temporary files, then manifest
marker, `.bin`, `.idx`, complete manifest), with the token-id range combined from the inputs' manifests, or
scanned (chunked) for inputs without one.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset, TemporaryPair, write_index_header
from megatron.data.manifest import TokenRange
from megatron.data.token_range import scan_token_range

logger = logging.getLogger(__name__)

TABLE_CHUNK = 1 << 22  # index entries per step (~100 MB of temporaries at most)
COPY_BYTES = 16 << 20


@dataclass
class MergeStats:
    inputs: int = 0
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9) / 1e6
        return (f"merged {self.inputs} pair(s): {self.documents:,} documents, {self.sequences:,} sequences, "
                f"{self.tokens:,} tokens, {self.bytes / 1e9:.2f} GB in {self.seconds:.1f}s ({rate:,.0f} MB/s)")


def pairs_in_directory(folder: str) -> list[str]:
    """Every `X.bin`/`X.idx` pair in `folder`, as prefixes sorted by name (Megatron-LM's `--input DIR`)."""
    if not os.path.isdir(folder):
        raise DataError(f"--input {folder} is not a directory: pass the folder holding the .bin/.idx pairs")
    stems: dict[str, set[str]] = {}
    for name in os.listdir(folder):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(folder, name)):
            stems.setdefault(stem, set()).add(ext)
    for stem, exts in sorted(stems.items()):
        if len(exts) != 2:
            missing = ({".bin", ".idx"} - exts).pop()
            raise DataError(f"{os.path.join(folder, stem + exts.pop())} has no {missing} beside it in --input {folder}: "
                            "remove it or complete the pair")
    return [os.path.join(folder, stem) for stem in sorted(stems)]


def _check_inputs(datasets: list[MMapIndexedDataset], output_prefix: str) -> None:
    out = os.path.abspath(output_prefix)
    for ds in datasets:
        if os.path.abspath(ds.path_prefix) == out:
            raise DataError(f"the output prefix {output_prefix} is also an input: choose another --output-prefix")
        if ds.dtype != datasets[0].dtype:
            raise DataError(f"{ds.path_prefix} holds {ds.dtype} tokens but {datasets[0].path_prefix} holds "
                            f"{datasets[0].dtype}: merged pairs need one dtype (tokenize them with the same tokenizer)")
        bin_size = os.path.getsize(ds.path_prefix + ".bin")
        if bin_size != ds.data_bytes:
            raise DataError(f"{ds.path_prefix}.bin has {bin_size} bytes but its sequences use {ds.data_bytes}: "
                            "merging copies whole .bin files, which would misplace the sequences after it")


def _chunks(array: np.ndarray) -> range:
    return range(0, len(array), TABLE_CHUNK)


def _write_tables(f, datasets: list[MMapIndexedDataset]) -> None:
    """Lengths, then offsets (checked against each input's own), then the document index, chunk by chunk."""
    for ds in datasets:
        for a in _chunks(ds.sizes):
            f.write(np.ascontiguousarray(ds.sizes[a:a + TABLE_CHUNK]).data.cast("B"))
    itemsize = datasets[0].dtype.itemsize
    offset = 0  # byte offset of the next sequence in the merged .bin
    for ds in datasets:
        local = 0  # the same within this input's own .bin
        for a in _chunks(ds.sizes):
            nbytes = ds.sizes[a:a + TABLE_CHUNK].astype(np.int64) * itemsize
            starts = np.empty_like(nbytes)
            starts[0] = 0
            np.cumsum(nbytes[:-1], out=starts[1:])
            if not np.array_equal(ds.pointers[a:a + TABLE_CHUNK], starts + local):
                bad = a + int(np.argmax(ds.pointers[a:a + TABLE_CHUNK] != starts + local))
                raise DataError(f"{ds.path_prefix}.idx: sequence {bad} starts at byte {int(ds.pointers[bad])}, not "
                                "right after the previous one: merging copies whole .bin files and recomputes the "
                                "offsets, which would misplace it (rewrite the pair with tools/preprocess_data.py)")
            f.write((starts + offset).data.cast("B"))
            local += int(nbytes.sum())
            offset += int(nbytes.sum())
    f.write(np.zeros(1, np.int64).data.cast("B"))
    sequences = 0
    for ds in datasets:
        entries = ds.doc_idx[1:]
        for a in _chunks(entries):
            f.write((entries[a:a + TABLE_CHUNK] + sequences).astype(np.int64).data.cast("B"))
        sequences += len(ds.sizes)


def _combined_range(datasets: list[MMapIndexedDataset]) -> TokenRange:
    """The merged pair's token-id range: the inputs' manifests, or a chunked scan of those without one."""
    lo = hi = None
    lo_seq = hi_seq = None
    first = 0
    for ds in datasets:
        r = ds.recorded_token_range
        if r is None:
            logger.info("%s has no manifest: scanning it for its token-id range", ds.path_prefix)
            r = scan_token_range(ds, chunk_bytes=COPY_BYTES)
        if r.min is not None and (lo is None or r.min < lo):
            lo, lo_seq = r.min, first + r.min_sequence
        if r.max is not None and (hi is None or r.max > hi):
            hi, hi_seq = r.max, first + r.max_sequence
        first += len(ds)
    return TokenRange(lo, lo_seq, hi, hi_seq)


def _copy(src_path: str, dst, buffer: bytearray, advance: Callable[[int], None]) -> None:
    view = memoryview(buffer)
    with open(src_path, "rb", buffering=0) as src:
        while True:
            n = src.readinto(view)
            if not n:
                return
            dst.write(view[:n])
            advance(n)


def merge_datasets(prefixes: Sequence[str], output_prefix: str, progress: bool = True) -> MergeStats:
    """Merge the pairs `prefixes` (in this order) into `output_prefix.bin/.idx` (+ manifest), atomically."""
    if not prefixes:
        raise DataError("nothing to merge: no .bin/.idx pair was given")
    started = time.perf_counter()
    datasets = [MMapIndexedDataset(p) for p in prefixes]
    _check_inputs(datasets, output_prefix)
    token_range = _combined_range(datasets)
    stats = MergeStats(inputs=len(datasets), documents=sum(ds.num_documents for ds in datasets),
                       sequences=sum(len(ds) for ds in datasets), bytes=sum(ds.data_bytes for ds in datasets))
    stats.tokens = stats.bytes // datasets[0].dtype.itemsize
    pair = TemporaryPair(output_prefix)
    try:
        with open(pair.idx_path, "wb") as f:
            write_index_header(f, datasets[0].dtype, stats.sequences, stats.documents + 1)
            _write_tables(f, datasets)
            f.flush()
            os.fsync(f.fileno())
        _copy_bins(datasets, pair, stats.bytes, progress)
        pair.publish(datasets[0].dtype, stats.sequences, stats.documents, token_range)
    except BaseException:
        pair.abort()
        raise
    stats.seconds = time.perf_counter() - started
    return stats


def _copy_bins(datasets: list[MMapIndexedDataset], pair: TemporaryPair, total: int, progress: bool) -> None:
    from tqdm import tqdm

    buffer = bytearray(COPY_BYTES)
    with tqdm(total=total, unit="B", unit_scale=True, desc="merge", disable=not progress, mininterval=1.0) as bar:
        for ds in datasets:
            _copy(ds.path_prefix + ".bin", pair.bin, buffer, bar.update)


def merge_partitions(partition_prefixes: Sequence[str], output_prefix: str, remove_inputs: bool,
                     progress: bool = False) -> Optional[MergeStats]:
    """`tools/preprocess_data.py --partitions N`: merge the partitions' pairs, then (optionally) remove them."""
    stats = merge_datasets(partition_prefixes, output_prefix, progress)
    if remove_inputs:
        remove_pairs(partition_prefixes)
    return stats


def remove_pairs(prefixes: Sequence[str]) -> None:
    """Delete the `.bin`, `.idx` and manifest of each prefix (intermediate pairs)."""
    for prefix in prefixes:
        for ext in (".bin", ".idx", ".manifest.json"):
            if os.path.exists(prefix + ext):
                os.remove(prefix + ext)
