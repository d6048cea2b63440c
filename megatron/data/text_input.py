"""Reading raw corpora: which files an `--input` names, and their lines, whole or in byte ranges.

`--input` is a file (a named pipe too), a directory (every `.jsonl`, `.json`, `.txt` file under it, also
`.gz`/`.zst` compressed, and every `.parquet`, `.arrow`, `.feather` file, found recursively and taken in the order
of their paths) or a glob (`**` recurses; matches taken in sorted order). That order is the order of the documents
in the output. Parquet and Arrow files are tables, read row by row by `megatron.data.parquet_input`;
`plan_partitions` cuts them between row groups (`TablePiece`) and `iter_documents` reads them too. What follows is
about the line-based files.

A file is read as JSONL when its name (without `.gz`/`.zst`) ends in `.jsonl` or `.json`; anything else is
plain text where each line is one document, stored under the first `--json-keys` key. Lines are read as
bytes and decoded one at a time, so a bad byte or bad JSON is reported with its file and line number
(`BadLineError`) instead of aborting a whole read. Blank lines are not documents and are skipped.

Partitions (`plan_partitions`) cut the inputs' bytes into contiguous `InputPiece`s of about equal size.
An uncompressed regular file may be cut anywhere: a piece starting at byte b begins with the first line that
starts at or after b, and owns every line that starts before its end, so consecutive pieces hold each line
exactly once. Compressed files and pipes cannot be entered in the middle and go whole to one piece. A piece
counts its lines from its start; the line number in the file (for messages) is found by counting the newlines
before it, only when a message needs it.

`.gz` is read with Python's gzip; `.zst` with the `zstandard` package if installed, else through the `zstd`
command (`zstd -dc`), which most Linux systems carry.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from megatron.data.errors import DataError
from megatron.data.parquet_input import (
    TABLE_SUFFIXES,
    TablePiece,
    TableReader,
    check_columns,
    is_table_input,
    table_layout,
)
from megatron.errors import json_reason

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".text")
COMPRESSED_SUFFIXES = (".gz", ".zst")
COUNT_BYTES = 16 << 20


class BadLineError(DataError):
    """A malformed input line; `str()` reads `FILE:LINE: reason`."""

    def __init__(self, path: str, line_no: int, reason: str) -> None:
        super().__init__(f"{path}:{line_no}: {reason}")
        self.path, self.line_no, self.reason = path, line_no, reason


def _uncompressed_name(path: str) -> str:
    for suffix in COMPRESSED_SUFFIXES:
        if path.endswith(suffix):
            return path[:-len(suffix)]
    return path


def is_json_input(path: str) -> bool:
    return _uncompressed_name(path).endswith(JSON_SUFFIXES)


def is_compressed(path: str) -> bool:
    return path.endswith(COMPRESSED_SUFFIXES)


def check_keys(path: str, json_keys: Sequence[str]) -> None:
    """A ValueError unless `json_keys` suits `path` (for a table: every key is one of its columns)."""
    if not json_keys:
        raise ValueError("--json-keys needs at least one key, e.g. --json-keys text")
    if is_table_input(path):
        check_columns(path, json_keys)
    elif not is_json_input(path) and len(json_keys) != 1:
        raise ValueError(f"--input {path!r} is plain text (one document per line, not .jsonl/.json), which has "
                         f"one field: pass a single --json-keys key, not {list(json_keys)}")


def resolve_inputs(spec: str) -> list[str]:
    """The files `--input` names: a file or pipe, a directory (searched recursively) or a glob; in order."""
    if os.path.isdir(spec):
        wanted = tuple(s + c for s in JSON_SUFFIXES + TEXT_SUFFIXES for c in ("",) + COMPRESSED_SUFFIXES)
        wanted += TABLE_SUFFIXES
        found = []
        for folder, subfolders, names in os.walk(spec):
            subfolders[:] = [d for d in subfolders if not d.startswith(".")]
            found += [os.path.join(folder, n) for n in names if n.endswith(wanted) and not n.startswith(".")]
        if not found:
            raise DataError(f"--input {spec} is a directory without input files in it (.jsonl, .json or .txt, also "
                            ".gz/.zst; .parquet, .arrow or .feather)")
        return sorted(found)
    if os.path.exists(spec):
        return [spec]
    if glob.has_magic(spec):
        found = sorted(p for p in glob.glob(spec, recursive=True) if not os.path.isdir(p))
        if not found:
            raise DataError(f"--input {spec!r} matches no file (quote the pattern so that the shell passes it as is)")
        return found
    raise DataError(f"--input {spec}: no such file or directory (pass a file, a directory or a quoted glob)")


def parse_line(raw: bytes, json_keys: Sequence[str], as_json: bool) -> dict[str, str]:
    """The text of each key in one raw line; raises ValueError with the reason when malformed."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not valid UTF-8 ({err.reason} at byte {err.start})") from None
    if not as_json:
        return {json_keys[0]: line.rstrip("\r\n")}
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"bad JSON ({json_reason(err)})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    out = {}
    for key in json_keys:
        if key not in obj:
            raise ValueError(f"missing key {key!r} (keys present: {sorted(obj)[:8]}); choose --json-keys")
        if not isinstance(obj[key], str):
            raise ValueError(f"key {key!r} holds {type(obj[key]).__name__}, not a string")
        out[key] = obj[key]
    return out


@dataclass(frozen=True)
class InputPiece:
    """Bytes [start, end) of one input file (end None: to its end); see the module docstring for lines."""

    path: str
    start: int = 0
    end: Optional[int] = None

    def line_number(self, relative: int) -> int:
        """The number in the whole file of this piece's `relative`-th line (1-based)."""
        return relative if self.start == 0 else _lines_before(self.path, self.start) + relative

    def disk_bytes(self) -> int:
        """The piece's bytes on disk (0 for a pipe or a missing file)."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return 0
        return (self.end if self.end is not None else size) - self.start

    def span(self) -> str:
        return f"{self.path}[{self.start}:{'' if self.end is None else self.end}]"


def _lines_before(path: str, start: int) -> int:
    """Lines before a piece starting at byte `start` (for messages only: reads the file up to there).

    The piece's first line starts right after the newline that ends the line holding byte start - 1 (at
    start - 1 itself, or later): one more than the newlines in [0, start - 1).
    """
    count, left = 0, start - 1
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(COUNT_BYTES, left))
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count + 1


def splittable(path: str) -> bool:
    """Whether a piece may start inside `path` (a regular, uncompressed file)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode) and not is_compressed(path)
    except OSError:
        return False


def _size(path: str) -> int:
    try:
        st = os.stat(path)
    except OSError as err:
        raise DataError(f"--input {path}: {err.strerror}") from None
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


Piece = Union[InputPiece, TablePiece]


def plan_partitions(paths: Sequence[str], partitions: int) -> list[list[Piece]]:
    """The inputs cut into at most `partitions` contiguous runs of pieces of about equal bytes (on disk).

    Cut points fall at k * total / partitions; a plain file is cut there, a compressed file or a pipe goes whole
    to the partition holding its middle byte, and so does each row group of a table. Partitions left without a
    piece are dropped.
    """
    if partitions < 1:
        raise ValueError(f"--partitions must be >= 1, got {partitions}")
    groups = {p: table_layout(p) for p in paths if is_table_input(p)}
    sizes = [sum(groups[p]) if p in groups else _size(p) for p in paths]
    total = sum(sizes)
    cuts = [k * total // partitions for k in range(1, partitions)]
    plan: list[list[Piece]] = [[] for _ in range(partitions)]
    offset = 0
    for path, size in zip(paths, sizes):
        begin, end = offset, offset + size
        if groups.get(path):
            _place_groups(plan, cuts, path, begin, groups[path])
        elif not splittable(path) or size == 0:
            part = sum(1 for c in cuts if c <= begin + size // 2) if total else 0
            plan[part].append(TablePiece(path) if path in groups else InputPiece(path))
        else:
            inner = [c for c in cuts if begin < c < end]
            bounds = [begin] + inner + [end]
            first_part = sum(1 for c in cuts if c <= begin)
            for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                plan[first_part + k].append(InputPiece(path, a - begin, None if b == end else b - begin))
        offset = end
    return [pieces for pieces in plan if pieces]


def _place_groups(plan: list[list[Piece]], cuts: Sequence[int], path: str, begin: int, sizes: Sequence[int]) -> None:
    """Each group of a table (`sizes`: its bytes, from global offset `begin`) to the partition holding its middle
    byte; consecutive groups of one partition make one piece."""
    parts, offset = [], begin
    for size in sizes:
        parts.append(sum(1 for c in cuts if c <= offset + size // 2))
        offset += size
    first = 0
    for g in range(1, len(sizes) + 1):
        if g == len(sizes) or parts[g] != parts[first]:
            end = None if g == len(sizes) else g
            plan[parts[first]].append(TablePiece(path, first, end, sum(sizes[first:g])))
            first = g


class LineReader:
    """Iterates `(line number within the piece, raw bytes)` over the non-blank lines of a piece; `consumed()`
    is how many bytes of the file on disk it has read so far (for progress)."""

    def __init__(self, piece: InputPiece) -> None:
        self.piece = piece
        self._raw = open(piece.path, "rb")
        self._proc: Optional[subprocess.Popen] = None
        self._position = piece.start
        self._stream = self._open_stream()

    def _open_stream(self):
        path = self.piece.path
        if path.endswith(".gz"):
            return gzip.GzipFile(fileobj=self._raw, mode="rb")
        if path.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                zstd = shutil.which("zstd")
                if zstd is None:
                    raise DataError(f"--input {path}: reading .zst needs the zstandard package (pip install "
                                    "zstandard) or the zstd command (apt-get install zstd)") from None
                # zstd reads our file descriptor: its read offset, shared with us, tells the progress.
                self._proc = subprocess.Popen([zstd, "-dcq"], stdin=self._raw, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE)
                return self._proc.stdout
            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(self._raw, read_across_frames=True))
        if self.piece.start:
            self._raw.seek(self.piece.start - 1)
            self._raw.readline()  # the rest of the line holding byte start - 1 belongs to the piece before
        return self._raw

    def consumed(self) -> int:
        if self._stream is self._raw:
            return self._position - self.piece.start
        try:  # compressed: the position in the file on disk, wherever the decompressor has read to
            return os.lseek(self._raw.fileno(), 0, os.SEEK_CUR)
        except OSError:  # a pipe
            return 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        self._position = self._raw.tell() if self.piece.start else 0  # pieces past 0 are in regular files
        end = self.piece.end
        try:
            for line_no, raw in enumerate(self._stream, start=1):
                if end is not None and self._position >= end:
                    return
                self._position += len(raw)
                if raw.strip():
                    yield line_no, raw
        except (OSError, EOFError) as err:  # a damaged or truncated compressed file
            raise DataError(f"--input {self.piece.path}: cannot be read ({err}); is the file complete?") from None
        if self._proc is not None and self._proc.wait() != 0:
            why = self._proc.stderr.read().decode(errors="replace").strip()
            raise DataError(f"--input {self.piece.path}: zstd failed ({why}); is the file complete?")

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._stream is not self._raw:
            self._stream.close()
        self._raw.close()

    def __enter__(self) -> "LineReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_raw_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) for every non-blank line of `path` (compressed or not)."""
    with LineReader(InputPiece(path)) as reader:
        yield from reader


def iter_documents(path: str, json_keys: Sequence[str]) -> Iterator[dict[str, str]]:
    """Parsed documents of `path`; the first malformed line (or table row) raises `BadLineError`."""
    check_keys(path, json_keys)
    if is_table_input(path):
        with TableReader(TablePiece(path), json_keys) as reader:
            for row_no, row in reader:
                if isinstance(row, str):
                    raise BadLineError(path, row_no, row)
                yield row
        return
    as_json = is_json_input(path)
    for line_no, raw in iter_raw_lines(path):
        try:
            yield parse_line(raw, json_keys, as_json)
        except ValueError as err:
            raise BadLineError(path, line_no, str(err)) from None
