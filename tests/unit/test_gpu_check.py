"""scripts/gpu_check.py on a machine without a GPU, in this process: the plan fits its deadline with the decisive
bench first and flags that bench accepts, and a stage streams its output and keeps it when its limit kills it."""
from __future__ import annotations

import sys
import time

from tests.support.config import REPO, load_bench

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


def test_the_block_stack_bench_comes_first_with_flags_it_accepts() -> None:
    stages = gpu_check.plan(gpus=1)
    assert stages[0]["name"] == "block_stack"
    cmd = stages[0]["cmd"]
    assert cmd[1].endswith("bench/bench_block_stack.py")
    args = load_bench("bench_block_stack").build_parser().parse_args(cmd[2:])
    assert args.device == "cuda" and args.shape == "7b" and args.compile == "on" and args.profile
    assert "torchao" in args.variants.split(",")  # the peer, when its wheel was carried


def test_the_stage_limits_fit_the_deadline() -> None:
    # A stage starts only with 10 s left (main), so the limits of a one-GPU machine must leave them.
    assert sum(s["limit"] for s in gpu_check.plan(gpus=1)) <= gpu_check.DEADLINE_S - 10
    assert gpu_check.DEADLINE_S < 240  # the whole check under 4 minutes


def test_a_stage_streams_its_rows_and_keeps_them_when_killed(tmp_path) -> None:
    stage = {"name": "rows", "limit": 3, "env": {},
             "cmd": [sys.executable, "-c", "import time\nprint('row 1', flush=True)\ntime.sleep(60)"]}
    echoed = []
    start = time.monotonic()
    result = gpu_check.run_stage(stage, tmp_path, stage["limit"], echo=lambda line: echoed.append(
        (line, time.monotonic() - start)))
    assert result["rc"] == 124 and "row 1" in result["output_tail"]
    assert result["seconds"] < 30  # killed at its limit, not after the 60 s sleep
    [(line, when)] = echoed
    assert line == "  [rows] row 1" and when < 3  # printed as it came, before the kill
