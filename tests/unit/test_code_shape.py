"""The package's functions stay readable: none in megatron/ is longer than 60 lines (docs/architecture.md)."""
from __future__ import annotations

import ast

from tests.support.config import REPO

LONGEST = 60


def test_no_function_in_the_package_is_longer_than_sixty_lines():
    long = []
    for path in sorted((REPO / "megatron").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into named steps: " + "; ".join(long)
