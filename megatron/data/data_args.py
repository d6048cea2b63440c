"""`--data-args-path` and `--per-split-data-args-path`: the data paths of a blend of hundreds of prefixes, in a file.

A launch script blending 2,000 prefixes should not carry 4,000 arguments. Megatron-LM's two file forms:

* `--data-args-path FILE`: the file holds what `--data-path` would: `W1 P1 W2 P2 ...` or `P1 P2 ...`, separated by
  any whitespace (one pair a line reads best). We also allow `#` comments to the end of a line.
* `--per-split-data-args-path FILE.json`: `{"train": [...], "valid": [...], "test": [...]}`, each value a list
  (or one whitespace-separated string) of what `--train-data-path` etc. would hold; keys may be left out.

Paths are taken as written (relative ones from the working directory, as on the command line). A malformed
file fails when the flags are parsed, naming the file and line: a weight without a prefix, a prefix where a
weight belongs, a negative weight, bad JSON, an unknown key, and a prefix whose `.bin` or `.idx` does not
exist (so a typo on line 1,532 is found before any rank starts building indices).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron.errors import json_reason

SPLIT_KEYS = ("train", "valid", "test")


@dataclass(frozen=True)
class DataPaths:
    data_path: tuple[str, ...] = ()
    train_data_path: tuple[str, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    test_data_path: tuple[str, ...] = ()


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_blend(items: Sequence[tuple[str, str]], source: str) -> tuple[str, ...]:
    """`items`: (text, "FILE:LINE" where it is). Validates weights/prefixes and that every prefix exists."""
    if not items:
        raise ValueError(f"{source} holds no data prefixes")
    weighted = _is_number(items[0][0])
    if weighted:
        if len(items) % 2:
            text, where = items[-1]
            raise ValueError(f"{where}: {text!r} has no partner: {source} holds WEIGHT PREFIX pairs, so it needs an "
                             "even number of items")
        for k in range(0, len(items), 2):
            (weight, where_w), (prefix, where_p) = items[k], items[k + 1]
            if not _is_number(weight):
                raise ValueError(f"{where_w}: {weight!r} stands where a weight belongs ({source} starts with a weight, "
                                 "so it holds WEIGHT PREFIX pairs; give every prefix a weight or none)")
            if float(weight) < 0:
                raise ValueError(f"{where_w}: negative weight {weight}")
            if _is_number(prefix):
                raise ValueError(f"{where_p}: {prefix!r} stands where a prefix belongs: two weights in a row")
    else:
        for text, where in items:
            if _is_number(text):
                raise ValueError(f"{where}: {text!r} looks like a weight, but {source} starts with a prefix: give "
                                 "every prefix a weight or none")
    prefixes = items[1::2] if weighted else items
    for prefix, where in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(f"{where}: {prefix}{ext} not found (a data prefix is the path without .bin/.idx; "
                                 "relative paths start from the working directory)")
    return tuple(text for text, _ in items)


def read_data_args_file(path: str, flag: str = "--data-args-path") -> tuple[str, ...]:
    """The `--data-path` items held by `path` (validated, see the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror}") from None
    items = [(text, f"{path}:{n}") for n, line in enumerate(lines, start=1)
             for text in line.split("#", 1)[0].split()]
    return _check_blend(items, f"{flag} {path}")


def _line_of(text: str, needle: str) -> int:
    position = text.find(json.dumps(needle))
    return text.count("\n", 0, position) + 1 if position >= 0 else 1


def read_per_split_file(path: str, flag: str = "--per-split-data-args-path") -> dict[str, tuple[str, ...]]:
    """`{"train": items, "valid": items, "test": items}` from `path` (keys that are absent are left out)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: bad JSON ({json_reason(err)}); {flag} takes "
                         '{"train": [...], "valid": [...], "test": [...]}') from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {flag} takes a JSON object with keys train, valid, test, not a "
                         f"{type(data).__name__}")
    out = {}
    for key, value in data.items():
        where = f"{path}:{_line_of(text, key)}"
        if key not in SPLIT_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}; {flag} takes train, valid and test")
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise ValueError(f"{where}: {key!r} must be a list of weights and prefixes (or one string of them)")
        items = [(str(v), f"{path}:{_line_of(text, v) if isinstance(v, str) else _line_of(text, key)}") for v in value]
        out[key] = _check_blend(items, f"{flag} {path} ({key!r})")
    return out


def resolve_data_paths(data_path: Sequence[str], train: Sequence[str], valid: Sequence[str], test: Sequence[str],
                       data_args_path: Optional[str], per_split_data_args_path: Optional[str]) -> DataPaths:
    """The data paths of a run from the flags: given directly, or read from one of the two files."""
    if data_args_path and (data_path or train or valid or test):
        raise ValueError("--data-args-path replaces --data-path (and excludes the per-split paths): pass one of them")
    if per_split_data_args_path and (data_path or train or valid or test or data_args_path):
        raise ValueError("--per-split-data-args-path replaces --train-data-path/--valid-data-path/--test-data-path "
                         "(and excludes --data-path, --data-args-path): pass one of them")
    if data_args_path:
        return DataPaths(data_path=read_data_args_file(data_args_path))
    if per_split_data_args_path:
        splits = read_per_split_file(per_split_data_args_path)
        return DataPaths(train_data_path=splits.get("train", ()), valid_data_path=splits.get("valid", ()),
                         test_data_path=splits.get("test", ()))
    return DataPaths(tuple(data_path or ()), tuple(train or ()), tuple(valid or ()), tuple(test or ()))
