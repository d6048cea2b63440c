"""Tokenizing a raw corpus into `.bin/.idx` files (the engine of tools/preprocess_data.py).

Input is JSONL or plain text (see `megatron.data.text_input`); each `--json-keys` key becomes its
own dataset `{output_prefix}_{key}_document.bin/.idx`, one document per input line. Lines are
parsed and tokenized in a multiprocessing pool (order preserved) and written by the parent.

A malformed line (bad JSON or UTF-8, a missing key, text the tokenizer rejects) stops the run
with `BadLineError` naming file and line, unless `skip_bad_lines`, in which case it is counted and
the first few are listed in the summary. Outputs are written under temporary names and published
only after the last line, with a manifest recording their sizes, hashes and token-id range (see
`megatron.data.manifest`): an error, Ctrl-C or SIGTERM leaves nothing new under the final names.
An input without any document is refused (`DataError`, nothing written): a 0-document pair is never
what a user means, and training on it can only fail later.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from megatron.config import DataConfig
from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.data.text_input import BadLineError, check_keys, is_json_input, iter_raw_lines, parse_line
from megatron.tokenizer import build_tokenizer

MAX_LISTED_BAD_LINES = 10


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bad_lines: int = 0
    bad_line_messages: list[str] = field(default_factory=list)
    seconds: float = 0.0
    output_prefixes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = max(self.seconds, 1e-9)
        text = (f"{self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f}s "
                f"({self.documents / rate:,.0f} docs/s, {self.tokens / rate:,.0f} tokens/s)")
        if self.bad_lines:
            text += f"; skipped {self.bad_lines} bad line(s):\n  " + "\n  ".join(self.bad_line_messages)
            if self.bad_lines > len(self.bad_line_messages):
                text += f"\n  ... and {self.bad_lines - len(self.bad_line_messages)} more"
        return text


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: `{prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


class Encoder:
    """Parses and tokenizes one raw line; returns (line number, arrays per key, error or None)."""

    def __init__(self, tokenizer, json_keys: Sequence[str], as_json: bool, append_eod: bool) -> None:
        self.tokenizer = tokenizer
        self.json_keys = list(json_keys)
        self.as_json = as_json
        self.append_eod = append_eod
        self.dtype = best_fitting_dtype(tokenizer.vocab_size)

    def encode(self, item: tuple[int, bytes]) -> tuple[int, Optional[dict[str, np.ndarray]], Optional[str]]:
        line_no, raw = item
        try:
            fields = parse_line(raw, self.json_keys, self.as_json)
            out = {}
            for key, text in fields.items():
                ids = self.tokenizer.tokenize(text)
                if self.append_eod:
                    ids = list(ids) + [self.tokenizer.eod]
                out[key] = np.asarray(ids, dtype=self.dtype)
        except ValueError as err:  # malformed line or text the tokenizer rejects
            return line_no, None, str(err)
        return line_no, out, None


_worker_encoder: Optional[Encoder] = None


def _init_worker(cfg: DataConfig, json_keys: Sequence[str], as_json: bool, append_eod: bool) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(build_tokenizer(cfg), json_keys, as_json, append_eod)


def _encode_in_worker(item: tuple[int, bytes]):
    return _worker_encoder.encode(item)


def _progress(enabled: bool):
    from tqdm import tqdm

    return tqdm(unit=" docs", desc="preprocess", disable=not enabled, mininterval=1.0, smoothing=0.1,
                dynamic_ncols=True)


def preprocess(input_path: str, output_prefix: str, tokenizer_cfg: DataConfig, json_keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, skip_bad_lines: bool = False,
               progress: bool = True, tokenizer=None) -> PreprocessStats:
    """Tokenize `input_path` into `{output_prefix}_{key}_document.bin/.idx` for every key.

    `tokenizer` overrides `build_tokenizer(tokenizer_cfg)` in this process (workers always build
    their own from `tokenizer_cfg`).
    """
    if not os.path.exists(input_path) or os.path.isdir(input_path):  # a FIFO is fine: streaming input
        raise ValueError(f"--input {input_path!r} is not a file: pass a .jsonl/.json file or a plain text file")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    check_keys(input_path, json_keys)
    as_json = is_json_input(input_path)
    tokenizer = tokenizer or build_tokenizer(tokenizer_cfg)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    stats = PreprocessStats(output_prefixes=[output_prefix_for(output_prefix, k) for k in json_keys])
    builders: dict[str, MMapIndexedDatasetBuilder] = {}
    pool = None
    start = time.perf_counter()
    bar = _progress(progress)
    try:
        lines = iter_raw_lines(input_path)
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=_init_worker,
                                        initargs=(tokenizer_cfg, list(json_keys), as_json, append_eod))
            results: Iterable = pool.imap(_encode_in_worker, lines, chunksize=64)
        else:
            results = map(Encoder(tokenizer, json_keys, as_json, append_eod).encode, lines)
        # After the fork: workers must not inherit the output files (they would hold their locks, and so keep
        # them "in use", if this process were killed and they lingered).
        builders = {k: MMapIndexedDatasetBuilder(p, dtype) for k, p in zip(json_keys, stats.output_prefixes)}
        _write_all(results, builders, stats, input_path, skip_bad_lines, bar, start)
        if stats.documents == 0:
            why = (f"all {stats.bad_lines} non-blank line(s) were bad and skipped ({stats.bad_line_messages[0]} ...)"
                   if stats.bad_lines else "it is empty or holds only blank lines")
            raise DataError(f"--input {input_path} holds no documents ({why}): nothing was written under "
                            f"{output_prefix}; check the input file")
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    stats.seconds = time.perf_counter() - start
    return stats


def _write_all(results: Iterator, builders: dict[str, MMapIndexedDatasetBuilder], stats: PreprocessStats,
               input_path: str, skip_bad_lines: bool, bar, start: float) -> None:
    pending = 0
    for line_no, arrays, error in results:
        if error is not None:
            if not skip_bad_lines:
                raise BadLineError(input_path, line_no, f"{error}. Fix the line or pass --skip-bad-lines")
            stats.bad_lines += 1
            if len(stats.bad_line_messages) < MAX_LISTED_BAD_LINES:
                stats.bad_line_messages.append(f"{input_path}:{line_no}: {error}")
            continue
        for key, tokens in arrays.items():
            builders[key].add_document(tokens)
            stats.tokens += tokens.size
        stats.documents += 1
        pending += 1
        if pending == 1000:  # tqdm bookkeeping per document would cost more than a short document
            bar.update(pending)
            pending = 0
            bar.set_postfix_str(f"{stats.tokens / (time.perf_counter() - start):,.0f} tokens/s", refresh=False)
    bar.update(pending)
