"""Tokenizing a raw corpus into `.bin/.idx` files (the engine of tools/preprocess_data.py).

Input is one file, a directory or a glob of JSONL or plain-text files, compressed or not (see
`megatron.data.text_input`), or of Parquet and Arrow tables (`megatron.data.parquet_input`: keys name columns);
each `--json-keys` key becomes its own dataset `{output_prefix}_{key}_document.bin/.idx`, one document per input
line (or table row), in the order of the files and their lines.

Parallelism has two levels. `partitions` cuts the inputs into contiguous pieces of about equal bytes
(`plan_partitions`; tables between row groups), each tokenized by its own process into
`{output_prefix}_{k}_{key}_document` (Megatron-LM's partition names; k zero-padded so that names sort in order),
which are then merged by streaming into `{output_prefix}_{key}_document` and removed (`merge=False` keeps the
partition pairs instead, for a blend). Within a partition, `workers` processes parse and tokenize lines in a pool
(order preserved) while the partition's process reads and writes; with one worker it does all of it itself, which
is the fastest per core. A progress bar over the whole job counts bytes read, documents and tokens of every
partition.

A malformed line (bad JSON or UTF-8, a missing key, text the tokenizer rejects) or table row (a null or
non-string value) stops the run with `BadLineError` naming file and line (row) number, unless `skip_bad_lines`,
in which case it is counted and the first few are listed in the summary. Outputs are written under temporary
names and published only after the last line, with a manifest recording their sizes, hashes and token-id range
(see `megatron.data.manifest`): an error, Ctrl-C or SIGTERM leaves nothing new under the final names (a failing
partition stops the others). An input without any document is refused (`DataError`, nothing written): a
0-document pair is never what a user means.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from megatron.config import DataConfig
from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype, remove_own_temporaries
from megatron.data.merge import merge_partitions, remove_pairs
from megatron.data.parquet_input import TablePiece, TableReader, is_table_input
from megatron.data.text_input import (
    BadLineError,
    LineReader,
    Piece,
    check_keys,
    is_json_input,
    parse_line,
    plan_partitions,
    resolve_inputs,
)
from megatron.tokenizer import build_tokenizer

MAX_LISTED_BAD_LINES = 10
REPORT_EVERY = 1000  # documents between progress updates (per-document bookkeeping would cost more)
Report = Callable[[int, int, int], None]  # (bytes read, documents, tokens) so far, of one partition


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bad_lines: int = 0
    bad_line_messages: list[str] = field(default_factory=list)
    seconds: float = 0.0
    output_prefixes: list[str] = field(default_factory=list)
    partitions: int = 1

    def add(self, other: "PreprocessStats") -> None:
        self.documents += other.documents
        self.tokens += other.tokens
        self.bad_lines += other.bad_lines
        room = MAX_LISTED_BAD_LINES - len(self.bad_line_messages)
        self.bad_line_messages += other.bad_line_messages[:max(room, 0)]

    def summary(self) -> str:
        rate = max(self.seconds, 1e-9)
        text = (f"{self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f}s "
                f"({self.documents / rate:,.0f} docs/s, {self.tokens / rate:,.0f} tokens/s)")
        if self.partitions > 1:
            text += f", {self.partitions} partitions"
        if self.bad_lines:
            text += f"; skipped {self.bad_lines} bad line(s):\n  " + "\n  ".join(self.bad_line_messages)
            if self.bad_lines > len(self.bad_line_messages):
                text += f"\n  ... and {self.bad_lines - len(self.bad_line_messages)} more"
        return text


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: `{prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


def partition_prefix(output_prefix: str, k: int, partitions: int) -> str:
    """Megatron-LM's `{prefix}_{k}`, k zero-padded to the width of the last one (so names sort numerically)."""
    return f"{output_prefix}_{k:0{len(str(partitions - 1))}d}"


class Encoder:
    """Parses and tokenizes one raw line or table row; returns (line number, arrays per key, error or None)."""

    def __init__(self, tokenizer, json_keys: Sequence[str], append_eod: bool) -> None:
        self.tokenizer = tokenizer
        self.json_keys = list(json_keys)
        self.append_eod = append_eod
        self.dtype = best_fitting_dtype(tokenizer.vocab_size)

    def fields(self, raw: Union[bytes, dict, str], as_json: bool) -> dict[str, str]:
        """A raw line parsed; a table row as read (a dict of texts, or the reason it is bad: a str)."""
        if isinstance(raw, bytes):
            return parse_line(raw, self.json_keys, as_json)
        if isinstance(raw, str):
            raise ValueError(raw)
        return raw

    def encode(self, item: tuple[int, Union[bytes, dict, str], bool]
               ) -> tuple[int, Optional[dict[str, np.ndarray]], Optional[str]]:
        line_no, raw, as_json = item
        try:
            fields = self.fields(raw, as_json)
            out = {}
            for key, text in fields.items():
                ids = self.tokenizer.tokenize(text)
                if self.append_eod:
                    ids = list(ids)
                    ids.append(self.tokenizer.eod)
                out[key] = np.array(ids, dtype=self.dtype)
        except ValueError as err:  # malformed line or text the tokenizer rejects
            return line_no, None, str(err)
        return line_no, out, None


_worker_encoder: Optional[Encoder] = None


def _init_worker(cfg: DataConfig, json_keys: Sequence[str], append_eod: bool) -> None:
    global _worker_encoder
    # Forked from a process whose SIGTERM unwinds it (to remove its temporaries): a pool worker has none, and
    # unwinding inside the pool's queue code could leave it stuck; Pool.terminate's SIGTERM must end it at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = Encoder(build_tokenizer(cfg), json_keys, append_eod)


def _encode_in_worker(item: tuple[int, Union[bytes, dict, str], bool]):
    return _worker_encoder.encode(item)


@dataclass(frozen=True)
class Job:
    """What every partition does the same way."""

    tokenizer_cfg: DataConfig
    json_keys: tuple[str, ...]
    append_eod: bool
    workers: int
    skip_bad_lines: bool


class _PieceLines:
    """The lines (table rows) of a partition's pieces in order, tagged with their piece (for messages) and
    format."""

    def __init__(self, pieces: Sequence[Piece], json_keys: Sequence[str]) -> None:
        self.pieces = list(pieces)
        self.json_keys = list(json_keys)
        self.current: Optional[Union[LineReader, TableReader]] = None
        self.done_bytes = 0

    def __iter__(self) -> Iterator[tuple[int, Union[bytes, dict, str], bool]]:
        for k, piece in enumerate(self.pieces):
            as_json = is_json_input(piece.path)
            opened = TableReader(piece, self.json_keys) if isinstance(piece, TablePiece) else LineReader(piece)
            with opened as reader:
                self.current = reader
                for line_no, raw in reader:
                    # The piece index rides in the line number's high bits: the pool returns it untouched.
                    yield (k << 40) | line_no, raw, as_json
                self.done_bytes += reader.consumed()
            self.current = None

    def consumed(self) -> int:
        return self.done_bytes + (self.current.consumed() if self.current else 0)

    def where(self, tagged_line: int) -> tuple[str, int]:
        piece = self.pieces[tagged_line >> 40]
        return piece.path, piece.line_number(tagged_line & ((1 << 40) - 1))


def run_partition(pieces: Sequence[Piece], output_prefix: str, job: Job, tokenizer, report: Report) -> PreprocessStats:
    """Tokenize `pieces` into `{output_prefix}_{key}_document` for every key (nothing written without documents)."""
    stats = PreprocessStats(output_prefixes=[output_prefix_for(output_prefix, k) for k in job.json_keys])
    lines = _PieceLines(pieces, job.json_keys)
    builders: dict[str, MMapIndexedDatasetBuilder] = {}
    pool = None
    try:
        if job.workers > 1:
            pool = multiprocessing.Pool(job.workers, initializer=_init_worker,
                                        initargs=(job.tokenizer_cfg, list(job.json_keys), job.append_eod))
            results: Iterator = pool.imap(_encode_in_worker, lines, chunksize=64)
        else:
            results = map(Encoder(tokenizer, job.json_keys, job.append_eod).encode, lines)
        # After the fork: workers must not inherit the output files (they would hold their locks, and so keep
        # them "in use", if this process were killed and they lingered).
        dtype = best_fitting_dtype(tokenizer.vocab_size)
        builders = {k: MMapIndexedDatasetBuilder(p, dtype) for k, p in zip(job.json_keys, stats.output_prefixes)}
        _write_all(results, builders, stats, lines, job.skip_bad_lines, report)
        if stats.documents:
            for builder in builders.values():
                builder.finalize()
        else:
            for builder in builders.values():
                builder.abort()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        for prefix in stats.output_prefixes:  # a builder a signal stopped before `builders` held it
            remove_own_temporaries(prefix)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return stats


def _write_all(results: Iterator, builders: dict[str, MMapIndexedDatasetBuilder], stats: PreprocessStats,
               lines: _PieceLines, skip_bad_lines: bool, report: Report) -> None:
    pending = 0
    for tagged_line, arrays, error in results:
        if error is not None:
            path, line_no = lines.where(tagged_line)
            if not skip_bad_lines:
                what = "row" if is_table_input(path) else "line"
                raise BadLineError(path, line_no, f"{error}. Fix the {what} or pass --skip-bad-lines")
            stats.bad_lines += 1
            if len(stats.bad_line_messages) < MAX_LISTED_BAD_LINES:
                stats.bad_line_messages.append(f"{path}:{line_no}: {error}")
            continue
        for key, tokens in arrays.items():
            builders[key].add_document(tokens)
            stats.tokens += tokens.size
        stats.documents += 1
        pending += 1
        if pending == REPORT_EVERY:
            pending = 0
            report(lines.consumed(), stats.documents, stats.tokens)
    report(lines.consumed(), stats.documents, stats.tokens)


class _Progress:
    """One bar over the whole job: bytes read from disk, with documents and tokens per second."""

    def __init__(self, total_bytes: int, partitions: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=not enabled,
                        mininterval=1.0, smoothing=0.1, dynamic_ncols=True)
        self.rows = np.zeros((partitions, 3), dtype=np.int64)
        self.start = time.perf_counter()

    def update(self, k: int, consumed: int, documents: int, tokens: int) -> None:
        self.rows[k] = (consumed, documents, tokens)
        done, docs, toks = (int(v) for v in self.rows.sum(axis=0))
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(min(done, self.bar.total) - self.bar.n)
        self.bar.set_postfix_str(f"{docs:,} docs, {docs / elapsed:,.0f} docs/s, {toks / elapsed:,.0f} tokens/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def preprocess(input_spec: Union[str, Sequence[str]], output_prefix: str, tokenizer_cfg: DataConfig,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               skip_bad_lines: bool = False, progress: bool = True, tokenizer=None, partitions: int = 1,
               merge: bool = True) -> PreprocessStats:
    """Tokenize the inputs into `{output_prefix}_{key}_document.bin/.idx` for every key (module docstring).

    `input_spec`: a file, a directory or a glob (or a list of them, taken in order). `tokenizer` overrides
    `build_tokenizer(tokenizer_cfg)` in this process and its partition processes (pool workers always build
    their own from `tokenizer_cfg`). With `partitions > 1` and `merge=False`, the partition pairs are the output.
    """
    specs = [input_spec] if isinstance(input_spec, str) else list(input_spec)
    paths = [p for spec in specs for p in resolve_inputs(spec)]
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    for path in paths:
        check_keys(path, json_keys)
    plan = plan_partitions(paths, partitions)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker; no fork warnings
    tokenizer = tokenizer or build_tokenizer(tokenizer_cfg)
    job = Job(tokenizer_cfg, tuple(json_keys), append_eod, workers, skip_bad_lines)
    start = time.perf_counter()
    if len(plan) == 1:
        bar = _Progress(sum(p.disk_bytes() for p in plan[0]), 1, progress)
        try:
            stats = run_partition(plan[0], output_prefix, job, tokenizer, lambda *r: bar.update(0, *r))
        finally:
            bar.close()
        parts = [stats] if stats.documents else []
    else:
        parts = _run_partitions(plan, output_prefix, job, tokenizer, progress)
        stats = PreprocessStats(partitions=len(plan))
        for part in parts:
            stats.add(part)
        parts = [p for p in parts if p.documents]
    if stats.documents == 0:
        why = (f"all {stats.bad_lines} non-blank line(s) were bad and skipped ({stats.bad_line_messages[0]} ...)"
               if stats.bad_lines else "it is empty or holds only blank lines")
        raise DataError(f"--input {' '.join(specs)} holds no documents ({why}): nothing was written under "
                        f"{output_prefix}; check the input file")
    if len(plan) > 1:
        stats.output_prefixes = _merge_partitions(parts, output_prefix, json_keys, merge, progress)
    stats.seconds = time.perf_counter() - start
    return stats


def _merge_partitions(parts: list[PreprocessStats], output_prefix: str, json_keys: Sequence[str],
                      merge: bool, progress: bool) -> list[str]:
    if not merge:
        return [prefix for part in parts for prefix in part.output_prefixes]
    outputs = []
    for k, key in enumerate(json_keys):
        out = output_prefix_for(output_prefix, key)
        merge_partitions([part.output_prefixes[k] for part in parts], out, remove_inputs=True, progress=progress)
        outputs.append(out)
    return outputs


def _partition_main(k: int, pieces: list[Piece], prefix: str, job: Job, tokenizer, counters, stop,
                    writers: list) -> None:
    """A partition process: tokenize, report progress in `counters[3k:3k+3]`, send (status, payload) on
    `writers[k]`. A pipe of its own rather than a shared multiprocessing.Queue: a queue's feeder thread holds a
    lock shared by every writer, and a partition stopped while sending would leave it held and hang the others."""
    for j, writer in enumerate(writers):
        if j != k:
            writer.close()  # so that the job sees EOF on a partition's pipe when that partition dies
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: temporaries removed

    def report(consumed: int, documents: int, tokens: int) -> None:
        # The job failed elsewhere (a SIGTERM that came before our handler was installed is lost), or its
        # process died (SIGKILL): stop rather than publish an orphan.
        if stop.value or os.getppid() != parent:
            sys.exit(1)
        counters[3 * k:3 * k + 3] = [consumed, documents, tokens]

    try:
        outcome = ("ok", run_partition(pieces, prefix, job, tokenizer, report))
    except (ValueError, OSError) as err:
        outcome = ("user", f"{type(err).__name__}: {err}" if isinstance(err, OSError) else str(err))
    except KeyboardInterrupt:
        outcome = ("interrupted", "")
    except SystemExit:  # stopped by the job (another partition failed): nothing to report
        return
    except BaseException as err:  # a bug: keep its traceback visible in the partition's stderr
        import traceback

        traceback.print_exc()
        outcome = ("crash", f"{type(err).__name__}: {err}")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # done: its temporaries are published or removed
    writers[k].send(outcome)
    writers[k].close()


def _run_partitions(plan: list[list[Piece]], output_prefix: str, job: Job, tokenizer,
                    progress: bool) -> list[PreprocessStats]:
    """Each partition in its own process; the first failure stops the others (their temporaries removed)."""
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("fork")  # children inherit the tokenizer object (tests override it)
    counters = ctx.Array("q", 3 * len(plan), lock=False)
    stop = ctx.Value("b", 0, lock=False)
    pipes = [ctx.Pipe(duplex=False) for _ in plan]
    readers, writers = [r for r, _ in pipes], [w for _, w in pipes]
    prefixes = [partition_prefix(output_prefix, k, len(plan)) for k in range(len(plan))]
    procs = [ctx.Process(target=_partition_main, args=(k, pieces, prefixes[k], job, tokenizer, counters, stop, writers),
                         name=f"preprocess-partition-{k}") for k, pieces in enumerate(plan)]
    outcomes: dict[int, PreprocessStats] = {}
    bar = _Progress(sum(p.disk_bytes() for pieces in plan for p in pieces), len(plan), progress)
    try:  # from the first start on: a SIGTERM (SystemExit) anywhere below still stops and cleans every partition
        for proc in procs:
            proc.start()
        for writer in writers:
            writer.close()
        while len(outcomes) < len(plan):
            ready = wait([r for k, r in enumerate(readers) if k not in outcomes], timeout=0.5)
            for j in range(len(plan)):
                bar.update(j, *counters[3 * j:3 * j + 3])
            for reader in ready:
                k = readers.index(reader)
                try:
                    status, payload = reader.recv()
                except EOFError:
                    procs[k].join()
                    raise RuntimeError(f"{procs[k].name} died without a result (exit code {procs[k].exitcode}: "
                                       "killed, or out of memory?)") from None
                if status != "ok":
                    where = ", ".join(p.span() for p in plan[k])
                    if status == "user":
                        raise DataError(f"{payload} (partition {k}: {where})")
                    if status == "interrupted":
                        raise KeyboardInterrupt
                    raise RuntimeError(f"partition {k} ({where}) failed: {payload}")
                outcomes[k] = payload
    finally:
        bar.close()
        failed = len(outcomes) < len(plan)
        if failed:
            stop.value = 1
        for k, proc in enumerate(procs):
            if k not in outcomes and proc.is_alive():
                proc.terminate()  # SIGTERM: the partition aborts its builders and its pool
        for proc in procs:
            if proc.pid is not None:
                proc.join()
        for writer in writers:
            writer.close()
        for reader in readers:
            reader.close()
        if failed:  # the partitions that did finish published intermediate pairs: the job leaves nothing
            for prefix in prefixes:
                remove_pairs([output_prefix_for(prefix, key) for key in job.json_keys])
    return [outcomes[k] for k in range(len(plan))]

