"""megatron/errors.py: how entry points end. User errors: one line, exit 2; a collective that failed because another
rank died or stopped answering: one line, exit 4; anything else keeps its traceback."""
from __future__ import annotations

import pytest

from megatron.errors import PEER_FAILURE_EXIT_CODE, USER_ERROR_EXIT_CODE, json_reason, run_cli


def _raising(exc: BaseException):
    def main(argv):
        raise exc
    return main


def test_a_failed_peer_is_one_line_and_exit_4(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13024: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging\nmore")
    assert run_cli(_raising(gloo)) == PEER_FAILURE_EXIT_CODE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rank 1] error: a collective failed because another rank died")
    assert "Connection reset by peer" in lines[0] and "more" not in lines[0]
    timeout = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                           "3000ms for recv operation to complete")
    assert run_cli(_raising(timeout)) == PEER_FAILURE_EXIT_CODE


def test_user_errors_exit_2_and_bugs_keep_their_traceback(capsys):
    assert run_cli(_raising(ValueError("--foo is wrong"))) == USER_ERROR_EXIT_CODE
    assert capsys.readouterr().err.strip() == "error: --foo is wrong"
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_cli(_raising(RuntimeError("shape mismatch")))


def test_tracebacks_on_request(monkeypatch):
    monkeypatch.setenv("MEGATRON_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        run_cli(_raising(RuntimeError("Connection closed by peer")))


@pytest.mark.parametrize("text,want", [('{"a": ', "Expecting value at column 7"),
                                       ('{"a": "b', "Unterminated string starting at column 7")])
def test_a_json_error_names_its_column_once(text, want):
    import json

    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(text)
    assert json_reason(err.value) == want
    assert " at at " not in json_reason(err.value)
