"""The package's floors hold: `.importlinter` names them (megatron.stability at the top, the small shared modules at
the bottom) and import-linter checks every import, those inside functions included. No file of megatron/, tools/,
bench/ or scripts/ imports a private name (a leading underscore) of another module."""
from __future__ import annotations

import ast

from importlinter import cli  # import-linter, in the test extra (setup.py)

from tests.support.config import REPO


def test_every_import_runs_down_the_floors(capsys):
    code = cli.lint_imports(config_filename=str(REPO / ".importlinter"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out  # the broken contract names the offending import and its line


def test_no_private_name_is_imported_across_modules():
    found = []
    for folder in ("megatron", "tools", "bench", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megatron":
                    found += [f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{alias.name}"
                              for alias in node.names if alias.name.startswith("_")]
    assert not found, found
