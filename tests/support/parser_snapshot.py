"""What a user sees of the command-line parser, as plain data: every flag's spellings, destination, default, choices,
type, action, nargs, metavar, help text and group. tests/unit/test_parser_snapshot.py compares it with the snapshot
in tests/unit/snapshots/parser.json, so a change to how the parser is built cannot change a flag unnoticed.

Regenerate (after a deliberate change to a flag):
    python -m tests.support.parser_snapshot > tests/unit/snapshots/parser.json
"""
from __future__ import annotations

import argparse
import json
import sys


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "__name__", None) or repr(value)


def parser_snapshot(parser: argparse.ArgumentParser) -> dict:
    """{first option string: its description}, plus the parser's usage, description and group titles in order."""
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    flags = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flags[action.option_strings[0]] = {
            "option_strings": list(action.option_strings), "dest": action.dest, "default": _plain(action.default),
            "choices": _plain(action.choices),
            # a store action without a type parses strings: the same as type=str
            "type": _plain(action.type or (str if type(action).__name__ == "_StoreAction" else None)),
            "action": type(action).__name__,
            "nargs": _plain(action.nargs), "const": _plain(action.const), "metavar": _plain(action.metavar),
            "required": action.required, "help": action.help, "group": group_of[id(action)],
        }
    return {"usage": parser.usage, "description": parser.description,
            "groups": [g.title for g in parser._action_groups], "flags": flags}


if __name__ == "__main__":
    from megatron.arguments import build_parser

    json.dump(parser_snapshot(build_parser()), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
