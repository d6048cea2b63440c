"""`--fp8-autoheal` across ranks: the statistics are max-reduced over the ranks that hold the same layers, so the two
tensor-parallel ranks (each quantizing its own shard) take the same actions at the same iterations; under DeepSpeed
ZeRO-3 (weights gathered around each layer) the controller climbs every rung and a resumed run repeats its actions."""
from __future__ import annotations

import math
import re
import shutil

import pytest

from megatron.checkpoint import store as ckpt
from tests.support.config import tiny_argv, write_zero3_config
from tests.support.launch import launch_checked, run
from tests.support.logs import losses

# Thresholds no tensor of the tiny run stays under: the controller climbs within a few iterations.
ACTING = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1", "--fp8-amax-compute-algo", "most_recent",
          "--fp8-autoheal", "--fp8-autoheal-clip-threshold", "1e-6", "--fp8-autoheal-patience", "1",
          "--fp8-autoheal-max-margin", "1", "--fp8-autoheal-flush-threshold", "1e-6")
_ACTION = re.compile(r"fp8 autoheal: iteration \d+: .*$", re.MULTILINE)


def test_tensor_parallel_ranks_take_the_same_decisions(tmp_path):
    argv = tiny_argv(*ACTING, "--tensor-model-parallel-size", "2", save=tmp_path, train_iters=6, save_interval=6,
                     log_interval=1, eval_iters=0)
    launch_checked(2, argv, stdout_tail=0, stderr_tail=3000)
    margins = []
    for rank in (0, 1):
        fp8 = ckpt.load_checkpoint_files(tmp_path, mp_rank=rank)["payload"]["fp8"]
        margins.append(({name: entry.get("extra_margin") for name, entry in fp8["layers"].items()},
                        fp8["autoheal"]["level"]))
        assert fp8["autoheal"]["actions"] > 0, rank
    assert margins[0] == margins[1] and any(margins[0][0].values())


def test_under_zero3_every_rung_is_taken_and_a_resume_repeats_the_actions(tmp_path):
    pytest.importorskip("deepspeed")
    zero3 = ("--deepspeed", "--deepspeed_config", write_zero3_config(tmp_path), "--bf16", *ACTING)
    common = dict(train_iters=6, save_interval=3, log_interval=1, eval_iters=0)
    straight = run(2, *zero3, save=tmp_path / "z3", **common)
    acted = _ACTION.findall(straight)
    assert len(acted) == len(set(acted))  # one line per action, from one rank
    for rung in ("extra margin 0 -> 1", "current scaling", "Smooth-SwiGLU channel scaling on", "high precision"):
        assert any(rung in line for line in acted), (rung, acted)
    assert all(math.isfinite(x) for x in losses(straight))
    # The same run resumed from its iteration-3 checkpoint: the actions after 3 are the straight run's.
    shutil.copytree(tmp_path / "z3", tmp_path / "resumed")
    (tmp_path / "resumed" / ckpt.TRACKER_FILE).write_text("3")
    (tmp_path / "resumed" / "latest").write_text("iter_0000003")
    shutil.rmtree(tmp_path / "resumed" / "iter_0000006")
    resumed = run(2, *zero3, load=tmp_path / "resumed", save=tmp_path / "resumed", **common)
    after = [line for line in acted if int(line.split()[3].rstrip(":")) > 3]
    assert _ACTION.findall(resumed) == after
    assert losses(resumed) == losses(straight)[3:]


def test_each_pipeline_stage_heals_its_own_layers(tmp_path):
    """PP = 2 (DeepSpeed's pipeline engine): each stage's controller watches the layers it holds and logs its actions
    (the first stage holds one transformer layer, the second the other; named as the pipeline module names them,
    as in the FP8 statistics)."""
    pytest.importorskip("deepspeed")
    log = run(2, "--deepspeed", "--zero-stage", "1", "--pipeline-model-parallel-size", "2", *ACTING,
              save=tmp_path / "pp", train_iters=6, save_interval=6, log_interval=1, eval_iters=0)
    acted = _ACTION.findall(log)
    layers = {line.split()[4].split(".self_attention")[0].split(".mlp")[0] for line in acted
              if "current scaling" in line}
    assert len(layers) == 2, acted
    assert len(acted) == len(set(acted))
    assert all(math.isfinite(x) for x in losses(log))
