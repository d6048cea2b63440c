"""Reading table inputs: Parquet (`.parquet`) and Arrow IPC (`.arrow`, `.feather`) files, row by row.

A table file is read through pyarrow, which is optional (the `parquet` extra) and imported only when a table is
read. Each `--json-keys` key names a column; a row becomes one document holding the text of each named column.
Rows are read in record batches of `BATCH_ROWS` rows of the named columns only, so memory stays bounded by one
row group (Parquet) or one record batch (Arrow), never the whole file.

A table is a sequence of groups: a Parquet file's row groups, an Arrow IPC file's record batches; an Arrow IPC
stream (what `datasets`' `save_to_disk` writes as `.arrow`) cannot be entered in the middle and is one group.
A `TablePiece` is a range of groups, the unit of `--partitions`. Rows are numbered from 1 in their file.

A row whose named column is null or not a string is bad: its reason is reported with its file and row number, as
a bad JSONL line is (`BadLineError`). A named column that the file lacks, or a file that pyarrow cannot read, is
one `DataError` naming the file.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from megatron.data.errors import DataError

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
BATCH_ROWS = 1024
Row = Union[dict, str]  # the text of each named column, or why the row is bad


def is_table_input(path: str) -> bool:
    return path.endswith(TABLE_SUFFIXES)


def import_pyarrow(path: str):
    """The pyarrow module; a `DataError` naming `path` and the install command when it is missing."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"--input {path}: reading Parquet or Arrow files needs pyarrow: pip install pyarrow "
                        "(or this package's extra: pip install -e '.[parquet]')") from None
    return pyarrow


class _Table:
    """An open table file: its column names, its groups (`groups`, `group_rows`, `group_bytes`) and the record
    batches of a group (`batches`)."""

    def __init__(self, path: str, pa) -> None:
        self.path, self.pa = path, pa
        self.columns: list[str] = []
        self.groups = 1

    def group_rows(self, group: int) -> int:
        raise NotImplementedError

    def group_bytes(self, group: int) -> int:
        raise NotImplementedError

    def batches(self, group: int, columns: Sequence[str]) -> Iterator:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _ParquetTable(_Table):
    def __init__(self, path: str, pa) -> None:
        super().__init__(path, pa)
        self.file = pa.parquet.ParquetFile(path)
        self.meta = self.file.metadata
        self.columns = list(self.file.schema_arrow.names)
        self.groups = self.meta.num_row_groups

    def group_rows(self, group: int) -> int:
        return self.meta.row_group(group).num_rows

    def group_bytes(self, group: int) -> int:
        row_group = self.meta.row_group(group)
        return sum(row_group.column(j).total_compressed_size for j in range(row_group.num_columns))

    def batches(self, group: int, columns: Sequence[str]) -> Iterator:
        # No decoding threads: partitions and workers are the parallelism.
        return self.file.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=list(columns),
                                      use_threads=False)

    def close(self) -> None:
        self.file.close()


class _ArrowTable(_Table):
    """An Arrow IPC file (random access: each record batch a group) or stream (one group)."""

    def __init__(self, path: str, pa) -> None:
        super().__init__(path, pa)
        self.size = os.path.getsize(path)
        self.source = pa.OSFile(path)
        try:
            try:
                self.reader = pa.ipc.open_file(self.source)
                self.stream = False
                self.groups = self.reader.num_record_batches
            except pa.ArrowInvalid:  # not the file format: the stream format, or not Arrow at all
                self.source.seek(0)
                self.reader = pa.ipc.open_stream(self.source)
                self.stream = True
            self.columns = list(self.reader.schema.names)
        except BaseException:
            self.source.close()
            raise

    def group_rows(self, group: int) -> int:
        return self.reader.get_batch(group).num_rows

    def group_bytes(self, group: int) -> int:
        return self.size * (group + 1) // self.groups - self.size * group // self.groups  # the file in equal parts

    def batches(self, group: int, columns: Sequence[str]) -> Iterator:
        for batch in (self.reader if self.stream else [self.reader.get_batch(group)]):
            batch = batch.select(list(columns))
            for offset in range(0, batch.num_rows, BATCH_ROWS):
                yield batch.slice(offset, BATCH_ROWS)

    def close(self) -> None:
        self.source.close()


def open_table(path: str) -> _Table:
    """The table file `path`, open; a `DataError` naming it when pyarrow cannot read it."""
    pa = import_pyarrow(path)
    parquet = path.endswith(".parquet")
    try:
        return _ParquetTable(path, pa) if parquet else _ArrowTable(path, pa)
    except (pa.ArrowException, OSError) as err:
        kind = "a Parquet" if parquet else "an Arrow IPC (file or stream)"
        raise DataError(f"--input {path}: cannot be read as {kind} file ({_reason(err)}); is the file complete?"
                        ) from None


def _reason(err: BaseException) -> str:
    """pyarrow's message on one line (some span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def check_columns(path: str, keys: Sequence[str]) -> None:
    """A `DataError` naming the file, the key and the file's columns unless every key is a column of `path`."""
    table = open_table(path)
    try:
        missing = [key for key in keys if key not in table.columns]
        if missing:
            raise DataError(f"--input {path}: no column {missing[0]!r} (its columns: {table.columns[:20]}"
                            f"{' ...' if len(table.columns) > 20 else ''}); choose --json-keys")
    finally:
        table.close()


def table_layout(path: str) -> list[int]:
    """The bytes on disk of each group of `path` (for cutting partitions and for progress)."""
    table = open_table(path)
    try:
        return [table.group_bytes(g) for g in range(table.groups)]
    finally:
        table.close()


@functools.lru_cache(maxsize=64)
def _rows_before(path: str, group: int, mtime_ns: int, size: int) -> int:
    """Rows in the groups before `group` (for messages; cached per version of the file)."""
    table = open_table(path)
    try:
        return sum(table.group_rows(g) for g in range(group))
    finally:
        table.close()


@dataclass(frozen=True)
class TablePiece:
    """Groups [start, end) of one table file (end None: to its end); `nbytes` their bytes on disk."""

    path: str
    start: int = 0
    end: Optional[int] = None
    nbytes: int = 0

    def line_number(self, relative: int) -> int:
        """The number in the whole file of this piece's `relative`-th row (1-based)."""
        if self.start == 0:
            return relative
        st = os.stat(self.path)
        return _rows_before(self.path, self.start, st.st_mtime_ns, st.st_size) + relative

    def disk_bytes(self) -> int:
        return self.nbytes

    def span(self) -> str:
        return f"{self.path}[row groups {self.start}:{'' if self.end is None else self.end}]"


def row_fields(keys: Sequence[str], values: Sequence) -> Row:
    """The text of each key in one row's `values`, or the reason the row is bad."""
    out = {}
    for key, value in zip(keys, values):
        if value is None:
            return f"column {key!r} is null"
        if not isinstance(value, str):
            return f"column {key!r} holds {type(value).__name__}, not a string"
        out[key] = value
    return out


class TableReader:
    """Iterates `(row number within the piece, Row)` over the rows of a piece; `consumed()` is the bytes on disk
    of the groups read so far (for progress)."""

    def __init__(self, piece: TablePiece, keys: Sequence[str]) -> None:
        self.piece, self.keys = piece, list(keys)
        self.table = open_table(piece.path)
        self.done = 0

    def consumed(self) -> int:
        return self.done

    def __iter__(self) -> Iterator[tuple[int, Row]]:
        pa, row_no = self.table.pa, 0
        end = self.table.groups if self.piece.end is None else self.piece.end
        try:
            for group in range(self.piece.start, end):
                for batch in self.table.batches(group, self.keys):
                    columns = [batch.column(key).to_pylist() for key in self.keys]
                    for values in zip(*columns):
                        row_no += 1
                        yield row_no, row_fields(self.keys, values)
                self.done += self.table.group_bytes(group)
        except (pa.ArrowException, OSError) as err:  # a damaged data page or record batch
            raise DataError(f"--input {self.piece.path}: cannot be read ({_reason(err)}); is the file complete?"
                            ) from None

    def close(self) -> None:
        self.table.close()

    def __enter__(self) -> "TableReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
