"""TensorBoard tags: Megatron-DeepSpeed's names with their "vs samples" / "vs tokens" twins, read back from the
event files of a tiny run, and `tools/compare_runs` still reading runs written with the older names."""
from __future__ import annotations

import pytest

from megatron.arguments import parse_config
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv

GBS, SEQ = 8, 32  # tiny_argv's global batch and sequence length


def _scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tb")
    result = pretrain(parse_config(tiny_argv("--log-batch-size-to-tensorboard", "--log-timers-to-tensorboard",
                                             tensorboard_dir=folder, train_iters=10, eval_interval=5), env={}))
    return _scalars(folder), result


def test_megatron_tags_and_their_twins(run):
    scalars, result = run
    for tag in ("lm-loss-training/lm loss", "learning-rate/learning-rate", "grad-norm/grad-norm",
                "batch-size/batch-size", "iteration-time/iteration-time", "lm-loss-validation/lm loss validation",
                "lm-loss-validation/lm loss validation ppl"):
        by_iteration = scalars[tag]
        assert [s for s, _ in by_iteration] in ([5, 10], [10]), tag
        # the twins hold the same values, keyed by consumed samples and tokens
        assert scalars[f"{tag} vs samples"] == [(s * GBS, v) for s, v in by_iteration], tag
        assert scalars[f"{tag} vs tokens"] == [(s * GBS * SEQ, v) for s, v in by_iteration], tag
    assert [v for _, v in scalars["batch-size/batch-size"]] == [GBS, GBS]
    assert all(v > 0 for _, v in scalars["iteration-time/iteration-time"])
    assert scalars["lm-loss-validation/lm loss validation"][-1][1] == pytest.approx(result.valid[-1][1], rel=1e-6)
    assert scalars["lm-loss-validation/lm loss test"][0][1] == pytest.approx(result.test_loss, rel=1e-6)
    assert scalars["steps-vs-samples/y=samples,x=steps"] == [(5, 5 * GBS), (10, 10 * GBS)]
    assert scalars["steps-vs-tokens/y=steps,x=tokens"] == [(5 * GBS * SEQ, 5), (10 * GBS * SEQ, 10)]
    # our own tags keep their names
    assert "throughput/tokens-per-sec" in scalars and "memory/mem-max-rss-MiB vs tokens" in scalars


def test_batch_size_and_timers_only_when_asked(tmp_path):
    pretrain(parse_config(tiny_argv(tensorboard_dir=tmp_path, train_iters=5, eval_iters=0), env={}))
    tags = set(_scalars(tmp_path))
    assert "lm-loss-training/lm loss vs samples" in tags
    assert not any(t.startswith(("batch-size/", "iteration-time/")) for t in tags)


def test_compare_runs_reads_the_old_tag_names(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from megatron.evaluation.run_compare import TRAIN_LOSS, VALID_LOSS, read_scalars, summarize

    with SummaryWriter(str(tmp_path)) as writer:
        for step, loss in ((1, 4.0), (2, 3.5)):
            writer.add_scalar("lm-loss vs tokens", loss, step * 256)
            writer.add_scalar("lm-loss-validation/lm loss vs tokens", loss + 0.1, step * 256)
        writer.add_scalar("lm-loss-test/lm loss", 3.7, 2)
    scalars = read_scalars(str(tmp_path))
    assert TRAIN_LOSS in scalars and VALID_LOSS in scalars
    summary = summarize("old", scalars)
    assert summary.final_valid == pytest.approx(3.6) and summary.test == pytest.approx(3.7)
