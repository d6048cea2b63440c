"""Tensor parallelism under DeepSpeed, what is decided before any process starts: our rank layout is DeepSpeed's
topology, the flags and DeepSpeed configs that are accepted, and those refused. The runs are in
tests/e2e/test_deepspeed_tp_launch.py."""
from __future__ import annotations

import re

import pytest

from megatron.arguments import parse_config
from megatron.parallel_state import RankLayout
from megatron.training.deepspeed_config import DeepSpeedConfigError, build_deepspeed_config
from tests.support.config import tiny_argv
from tests.support.flags import DEEPSPEED_TP_RUN as BASE, PP2, SP, TP2

pytest.importorskip("deepspeed")


# -------------------------------------------------------------------------------------------- validation
def test_rank_layout_is_deepspeeds_topology():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    for pp, dp, tp in [(1, 2, 2), (2, 1, 2), (2, 2, 2), (3, 2, 4), (2, 4, 1), (1, 4, 1)]:
        ours, theirs = RankLayout(tp=tp, pp=pp, dp=dp), PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        world = pp * dp * tp
        for r in range(world):
            c = theirs.get_coord(r)
            assert ours.coordinates(r) == (c.pipe, c.data, c.model)
            assert ours.rank(c.pipe, c.data, c.model) == r
        singles = [[r] for r in range(world)]
        assert sorted(ours.tensor_parallel_groups()) == sorted(theirs.get_axis_comm_lists("model") or singles)
        assert sorted(ours.data_parallel_groups()) == sorted(theirs.get_axis_comm_lists("data") or singles)
        stages = [sorted(r for r in range(world) if theirs.get_coord(r).pipe == s) for s in range(pp)]
        assert ours.stage_groups() == stages
    # Without a pipeline, Megatron's layout: TP ranks consecutive.
    assert RankLayout(tp=2, pp=1, dp=2).tensor_parallel_groups() == [[0, 1], [2, 3]]


def _tp_config(*switches, world_size=2, **overrides):
    return parse_config(tiny_argv("--deepspeed", *TP2, *switches, **{**BASE, **overrides}), world_size=world_size)


def test_tensor_parallel_is_accepted_with_deepspeed_and_the_pipeline():
    assert _tp_config("--zero-stage", "1").parallel.tensor_model_parallel_size == 2
    cfg = _tp_config("--zero-stage", "1", *PP2, *SP, world_size=4)
    assert cfg.parallel.sequence_parallel and cfg.parallel.pipeline_model_parallel_size == 2
    # Sequence parallel between stages: DeepSpeed must send every TP rank's own activations whole.
    ds = build_deepspeed_config(cfg)
    assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert "pipeline" not in build_deepspeed_config(_tp_config("--zero-stage", "1", *PP2, world_size=4))


@pytest.mark.parametrize("switches, user, message", [
    (("--zero-stage", "3"), None, "is not supported with --tensor-model-parallel-size 2"),
    ((), {"zero_optimization": {"stage": 3}}, "is not supported with --tensor-model-parallel-size 2"),
    (("--zero-stage", "1", *PP2, *SP), {"pipeline": {"pipe_partitioned": True}},
     "`pipeline.pipe_partitioned` must be false with --sequence-parallel"),
])
def test_unsupported_tensor_parallel_deepspeed_combinations_are_refused(switches, user, message):
    world = 4 if "--pipeline-model-parallel-size" in switches else 2
    with pytest.raises(DeepSpeedConfigError, match=re.escape(message)):
        build_deepspeed_config(_tp_config(*switches, world_size=world), user_json=user)
