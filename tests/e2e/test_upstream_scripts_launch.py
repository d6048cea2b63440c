"""Upstream commands at PP = 2: Microsoft's activation-checkpointing command runs full recompute under
DeepSpeed's pipeline (2 processes under torchrun)."""
import pytest


def test_pipeline_full_recompute_is_recompute(pp2_fp32_log):
    """Microsoft's activation-checkpointing command runs full recompute at PP=2: DeepSpeed checkpoints the
    stage's transformer layers; recomputing is exact (same ops again, no dropout), so the losses are equal.
    Without recompute: tests/conftest.py's `pp2_fp32_log` (ZeRO 0, clipping at 0.05), shared with
    test_pipeline_launch."""
    pytest.importorskip("deepspeed")
    from tests.support.launch import run
    from tests.support.logs import values

    switches = ["--deepspeed", "--zero-stage", "0", "--pipeline-model-parallel-size", "2"]
    plain = pp2_fp32_log("0")
    recomputed = run(2, *switches, "--deepspeed-activation-checkpointing", eval_interval=2, clip_grad=0.05)
    assert "full activation recompute" not in plain
    assert "full activation recompute of every 1 transformer layer(s)" in recomputed
    assert values(recomputed) == values(plain) and len(values(plain)) == 7
