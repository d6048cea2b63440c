"""Reading raw corpora: JSONL (one JSON object per line) or plain text (one document per line).

A file is read as JSONL when its name ends in `.jsonl` or `.json`; anything else is plain text
where each line is one document, stored under the first `--json-keys` key. Lines are read as bytes
and decoded one at a time, so a bad byte or bad JSON is reported with its file and line number
(`BadLineError`) instead of aborting a whole read. Blank lines are not documents and are skipped.
"""
from __future__ import annotations

import json
from typing import Iterator, Sequence

from megatron.data.errors import DataError

JSON_SUFFIXES = (".jsonl", ".json")


class BadLineError(DataError):
    """A malformed input line; `str()` reads `FILE:LINE: reason`."""

    def __init__(self, path: str, line_no: int, reason: str) -> None:
        super().__init__(f"{path}:{line_no}: {reason}")
        self.path, self.line_no, self.reason = path, line_no, reason


def is_json_input(path: str) -> bool:
    return path.endswith(JSON_SUFFIXES)


def check_keys(path: str, json_keys: Sequence[str]) -> None:
    if not json_keys:
        raise ValueError("--json-keys needs at least one key, e.g. --json-keys text")
    if not is_json_input(path) and len(json_keys) != 1:
        raise ValueError(f"--input {path!r} is plain text (one document per line, not .jsonl/.json), which has "
                         f"one field: pass a single --json-keys key, not {list(json_keys)}")


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
        raise ValueError(f"bad JSON ({err.msg} at column {err.colno})") from None
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


def iter_raw_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) for every non-blank line of `path`."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if raw.strip():
                yield line_no, raw


def iter_documents(path: str, json_keys: Sequence[str]) -> Iterator[dict[str, str]]:
    """Parsed documents of `path`; the first malformed line raises `BadLineError`."""
    check_keys(path, json_keys)
    as_json = is_json_input(path)
    for line_no, raw in iter_raw_lines(path):
        try:
            yield parse_line(raw, json_keys, as_json)
        except ValueError as err:
            raise BadLineError(path, line_no, str(err)) from None
