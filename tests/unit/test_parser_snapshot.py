"""The parser a user sees does not change unnoticed: every flag's spellings, default, choices, type, help and group
equal the snapshot (tests/support/parser_snapshot.py says how to regenerate it after a deliberate change)."""
import json

from megatron.arguments import build_parser
from tests.support.config import REPO
from tests.support.parser_snapshot import parser_snapshot

SNAPSHOT = REPO / "tests" / "unit" / "snapshots" / "parser.json"


def test_parser_equals_its_snapshot():
    expected = json.loads(SNAPSHOT.read_text())
    actual = json.loads(json.dumps(parser_snapshot(build_parser())))
    assert actual["groups"] == expected["groups"]
    assert (actual["usage"], actual["description"]) == (expected["usage"], expected["description"])
    assert sorted(actual["flags"]) == sorted(expected["flags"])
    for flag, described in expected["flags"].items():
        assert actual["flags"][flag] == described, flag
