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
    # A stage starts only with 10 s left (main), so the limits of a one-GPU machine must leave them; the model's
    # table (CPU work, last) runs in what is left, and can be made afterwards from block_stack.json.
    stages = gpu_check.plan(gpus=1)
    assert sum(s["limit"] for s in stages if not s.get("leftover")) <= gpu_check.DEADLINE_S - 10
    assert [s["name"] for s in stages if s.get("leftover")] == ["model"] and stages[-1]["name"] == "model"
    assert gpu_check.DEADLINE_S < 300  # the whole check under 5 minutes


def test_the_model_stage_reads_what_the_bench_writes(tmp_path) -> None:
    """The last stage puts the model next to the block-stack rows: bench/project.py --against the bench's JSON."""
    stages = {s["name"]: s for s in gpu_check.plan(gpus=1)}
    bench_json = stages["block_stack"]["cmd"][stages["block_stack"]["cmd"].index("--json") + 1]
    model = stages["model"]["cmd"]
    assert model[1].endswith("bench/project.py") and model[model.index("--against") + 1] == bench_json
    project = load_bench("project")
    assert [project.device_of(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA B200", "Tesla T4")] == \
        ["h200", "h100", "b200", None]
    measured = {"device": "NVIDIA H200", "shape": "tiny", "layers": 2, "tokens_per_step": 32,
                "rows": [{"variant": "bf16", "median_step_s": 0.010, "vs_bf16": 1.0},
                         {"variant": "fp8-tensorwise", "median_step_s": 0.015, "vs_bf16": 1.5},
                         {"variant": "torchao", "skipped": "torchao is not installed"}]}
    rows = project.against(measured)
    assert [r["variant"] for r in rows] == ["bf16", "fp8-tensorwise"]
    for r, m in zip(rows, measured["rows"]):
        assert r["measured_ms"] == m["median_step_s"] * 1e3 and r["projected_ms"] > 0
        assert r["residual"] == r["projected_ms"] / r["measured_ms"] - 1
        assert r["ratio_residual"] == r["projected_vs_bf16"] / m["vs_bf16"] - 1
    assert rows[0]["projected_vs_bf16"] == 1.0


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


def test_with_two_gpus_fsdp2_trains_the_fp8_recipe_with_fp8_gathers_and_its_collectives_counted() -> None:
    from megatron.arguments import parse_config

    assert "train_fsdp2" not in {s["name"] for s in gpu_check.plan(gpus=1)}
    cmd = {s["name"]: s for s in gpu_check.plan(gpus=2)}["train_fsdp2"]["cmd"]
    script = cmd.index(str(REPO / "tests" / "support" / "count_collectives.py"))
    assert cmd[script + 1] == "{out}/fsdp2_counts" and cmd[script + 2] == "--"
    config = parse_config(cmd[script + 3:], world_size=2)
    assert config.parallel.use_torch_fsdp2 and config.parallel.fp8_param_gather and config.fp8 is not None
    assert config.model.smooth_swiglu is not None and config.optimizer.optimizer == "fp8adam"
