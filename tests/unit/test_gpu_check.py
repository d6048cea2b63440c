"""scripts/gpu_check.py's plan on a machine without a GPU, in this process: the benchmark stages name variants
that bench/bench_train_step.py has."""
from __future__ import annotations

import sys

import pytest

from tests.support.config import REPO, load_bench

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("name", ["bench_step", "bench_traced"])
def test_bench_step_variants_exist(name: str) -> None:
    bench = load_bench("bench_train_step")
    stage = next(s for s in gpu_check.plan(gpus=1) if s["name"] == name)
    variants = stage["cmd"][stage["cmd"].index("--variants") + 1].split(",")
    assert set(variants) <= set(bench.VARIANTS) and "bf16" in variants
    if "--torch-compile" in stage["cmd"]:
        modes = stage["cmd"][stage["cmd"].index("--torch-compile") + 1].split(",")
        assert set(modes) <= set(bench.MODE_LABELS)


def test_bench_traced_compares_traced_fp8_layers_with_graph_breaks() -> None:
    """bench_traced exists to time FP8 layers traced into the compiled blocks against FP8 graph breaks, so its
    command must carry `--torch-compile` with both modes. Without the flag bench_train_step.py runs its default
    (eager and compiled) and the stage measures something else, which the check above lets through: it reads
    the modes only when the flag is there."""
    bench = load_bench("bench_train_step")
    stage = next(s for s in gpu_check.plan(gpus=1) if s["name"] == "bench_traced")
    assert "--torch-compile" in stage["cmd"], stage["cmd"]
    modes = stage["cmd"][stage["cmd"].index("--torch-compile") + 1].split(",")
    assert {"on", "on-break"} <= set(modes) <= set(bench.MODE_LABELS)
