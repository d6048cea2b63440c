"""scripts/gpu_check.sh on a machine without a GPU: the plan (--dry-run), the one-line refusal, and flags that
parse: each training stage's command passes `pretrain_gpt.py --dry-run` here (with --device cpu)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.config import REPO
from tests.support.launch import pretrain_cli

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

ENV = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")


def test_dry_run_prints_every_stage_and_exits_0() -> None:
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for stage in ("env", "block_stack", "gpu_tests", "train_1gpu", "train_tp2"):
        assert f"  {stage}" in out.stdout, stage
    assert "MEGATRON_FORCE_COLLECTIVES=1" in out.stdout and "bench_block_stack.py" in out.stdout


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2() -> None:
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stdout.strip().count("\n") == 0 and "no CUDA GPU" in out.stdout and not out.stderr.strip()


@pytest.mark.parametrize("name", ["train_1gpu", "train_tp2"])
def test_training_stage_flags_are_valid(name: str) -> None:
    stage = next(s for s in gpu_check.plan(gpus=2) if s["name"] == name)
    args = stage["cmd"][stage["cmd"].index(str(REPO / "pretrain_gpt.py")) + 1:]
    args = [("cpu" if a == "cuda" and args[i - 1] == "--device" else a) for i, a in enumerate(args)]
    world = 2 if name == "train_tp2" else 1
    out = pretrain_cli(*args, "--dry-run", env={"WORLD_SIZE": str(world)}, timeout=120)
    assert out.returncode == 0, out.stderr
