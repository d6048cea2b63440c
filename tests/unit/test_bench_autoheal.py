"""bench/bench_autoheal.py at a tiny shape: both variants build through the CLI's path, time whole log intervals,
and the JSON holds the figures it prints; the iteration count must cover whole log intervals."""
from __future__ import annotations

import json
import math

import pytest

from tests.support.config import load_bench

bench = load_bench("bench_autoheal")
TINY = ("--num-layers 1 --hidden-size 64 --num-attention-heads 4 --num-key-value-heads 2 --ffn-hidden-size 128 "
        "--seq-length 32")


def test_both_variants_run_and_the_json_matches(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.main(["--iters", "4", "--log-interval", "2", "--micro-batch-size", "2", "--torch-compile", "off",
                         "--extra", TINY, "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["mean_step_s"]) == {"fp8", "fp8 + --fp8-autoheal", "fp8 + --log-fp8-stats", "fp8 + both"}
    assert math.isfinite(result["overhead"]) and math.isfinite(result["overhead_over_log_fp8_stats"])
    assert result["controller_actions"] >= 0
    assert "overhead of --fp8-autoheal" in capsys.readouterr().out


def test_iterations_must_be_whole_log_intervals(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--iters", "5", "--log-interval", "2"])
    assert "--iters must be a multiple of --log-interval" in capsys.readouterr().err
