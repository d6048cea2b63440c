"""Every token id of a dataset checked against the vocabulary before training starts, without rereading it.

An id in `[vocab_size, padded_vocab_size)` trains silently on an embedding padding row; a larger one (or a
negative one) fails deep inside `F.embedding`, iterations later, without naming the data. Checking only
the first documents misses both. So the whole file's token-id range is known up front:

* pairs written by `MMapIndexedDatasetBuilder` (tools/preprocess_data.py) carry it in their manifest;
* other pairs are scanned once, in fixed-size chunks read into one buffer (constant memory, whatever the
  file size; a progress line every 30 s), and the result is cached as JSON in the index cache folder, keyed
  by the files' path, sizes, modification times and head/tail hashes, so later starts read it back.

`check_token_ids` then fails naming the file, the document, the id, the vocabulary size and the flags to fix.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from typing import Optional

import numpy as np

from megatron.data.errors import TokenIdOutOfRangeError
from megatron.data.indexed_dataset import TABLE_CHUNK, MMapIndexedDataset, search_table
from megatron.data.manifest import FileFingerprint, TokenRange, write_json_atomic

logger = logging.getLogger(__name__)

SCAN_CHUNK_BYTES = 64 << 20
PROGRESS_SECONDS = 30.0
RANGE_CACHE_VERSION = 1


def scan_token_range(ds: MMapIndexedDataset, chunk_bytes: int = SCAN_CHUNK_BYTES,
                     progress_seconds: float = PROGRESS_SECONDS) -> TokenRange:
    """Smallest and largest id of the tokens of `ds` (and their sequences), reading its `.bin` in chunks."""
    if len(ds) == 0:
        return TokenRange()
    itemsize = ds.dtype.itemsize
    chunk_bytes = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    start, stop = 0, ds.data_bytes  # the bytes the sequences cover
    path = ds.path_prefix + ".bin"
    buffer = np.empty(chunk_bytes, dtype=np.uint8)
    lo = hi = None
    lo_at = hi_at = 0
    began = last_log = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        position = start
        while position < stop:
            n = f.readinto(memoryview(buffer)[:min(chunk_bytes, stop - position)])
            if not n:
                break
            if n % itemsize:  # a short read that split a token: read its bytes again with the next chunk
                n -= n % itemsize
                f.seek(position + n)
            tokens = buffer[:n].view(ds.dtype)
            if tokens.size:
                c_lo, c_hi = tokens.min(), tokens.max()
                if lo is None or c_lo < lo:
                    lo, lo_at = c_lo, position + int(np.argmin(tokens)) * itemsize
                if hi is None or c_hi > hi:
                    hi, hi_at = c_hi, position + int(np.argmax(tokens)) * itemsize
            position += n
            now = time.monotonic()
            if now - last_log >= progress_seconds:
                last_log = now
                logger.info("scanning %s for its token-id range: %.0f%% (%.1f of %.1f GB, %.0f MB/s)", path,
                            100.0 * (position - start) / (stop - start), position / 1e9, stop / 1e9,
                            (position - start) / 1e6 / (now - began))
    if lo is None:  # sequences of zero tokens only
        return TokenRange()
    def sequence_at(byte: int) -> int:
        """The sequence whose bytes hold `byte`: a binary search, as writers lay sequences out in order."""
        k = max(search_table(ds.pointers, byte) - 1, 0)
        if ds.pointers[k] <= byte < ds.pointers[k] + int(ds.sizes[k]) * itemsize:
            return k
        for first in range(0, len(ds), TABLE_CHUNK):  # sequences out of order: search them all, chunk by chunk
            pointers = ds.pointers[first:first + TABLE_CHUNK]
            ends = pointers + ds.sizes[first:first + TABLE_CHUNK].astype(np.int64) * itemsize
            hits = np.flatnonzero((pointers <= byte) & (byte < ends))
            if hits.size:
                return first + int(hits[0])
        return k

    return TokenRange(int(lo), sequence_at(lo_at), int(hi), sequence_at(hi_at))


def _cache_file(ds: MMapIndexedDataset, cache_dir: str) -> tuple[str, dict]:
    key = {"version": RANGE_CACHE_VERSION, "path_prefix": os.path.abspath(ds.path_prefix)}
    for ext in ("bin", "idx"):
        path = f"{ds.path_prefix}.{ext}"
        key[ext] = dict(asdict(FileFingerprint.of(path)), mtime_ns=os.stat(path).st_mtime_ns)
    digest = hashlib.md5(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return os.path.join(cache_dir, f"{os.path.basename(ds.path_prefix)}-token-range-{digest}.json"), key


def dataset_token_range(ds: MMapIndexedDataset, cache_dir: Optional[str]) -> TokenRange:
    """The token-id range of `ds`: from its manifest, else from the cache in `cache_dir`, else scanned once."""
    if ds.recorded_token_range is not None:
        return ds.recorded_token_range
    path, key = _cache_file(ds, cache_dir) if cache_dir else (None, None)
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                return TokenRange.from_dict(json.load(f)["token_range"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("rescanning %s: its cached token-id range %s is unreadable (%s)", ds.path_prefix, path, err)
    size = os.path.getsize(ds.path_prefix + ".bin")
    logger.info("%s has no manifest: scanning its %.2f GB once for the token-id range%s", ds.path_prefix, size / 1e9,
                f" (cached in {path})" if path else "")
    began = time.monotonic()
    found = scan_token_range(ds)
    logger.info("scanned %s in %.1f s: token ids %s..%s", ds.path_prefix, time.monotonic() - began,
                found.min, found.max)
    if path:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            write_json_atomic(path, {"key": key, "token_range": asdict(found)})
        except OSError as err:
            logger.warning("could not cache the token-id range of %s in %s (%s): it is rescanned at every start "
                           "(--data-cache-path picks a writable folder)", ds.path_prefix, cache_dir, err)
    return found


def document_of(ds: MMapIndexedDataset, sequence: int) -> int:
    return search_table(ds.doc_idx, sequence) - 1


def check_token_ids(ds: MMapIndexedDataset, vocab_size: int, cache_dir: Optional[str],
                    tokenizer_name: str = "the tokenizer") -> TokenRange:
    """Raise `TokenIdOutOfRangeError` unless every id of `ds` lies in `[0, vocab_size)`."""
    found = dataset_token_range(ds, cache_dir)
    fix = (f"pass the --tokenizer-type/--tokenizer-model (for NullTokenizer --vocab-size) that "
           f"tools/preprocess_data.py used for this data, or re-run preprocessing with {tokenizer_name}")
    if found.max is not None and found.max >= vocab_size:
        raise TokenIdOutOfRangeError(
            f"{ds.path_prefix}.bin: document {document_of(ds, found.max_sequence)} holds token id {found.max}, but "
            f"{tokenizer_name} has {vocab_size} ids (0..{vocab_size - 1}); the id would train an embedding padding "
            f"row or fail inside the embedding. The data was tokenized with another vocabulary: {fix}")
    if found.min is not None and found.min < 0:
        raise TokenIdOutOfRangeError(
            f"{ds.path_prefix}.bin: document {document_of(ds, found.min_sequence)} holds the negative token id "
            f"{found.min}: the file is damaged or was not written as token ids; {fix}")
    return found
