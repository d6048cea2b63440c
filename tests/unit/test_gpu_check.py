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
