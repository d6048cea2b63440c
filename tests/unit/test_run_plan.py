"""What a run says at start-up (layout, split sizes) and how many batches its evaluations read
(megatron/training/run_plan.py): without an explicit --eval-iters an evaluation reads at most one pass over its
split; training ends with a validation, as Megatron's does."""
import dataclasses
import logging

import numpy as np
import pytest

from megatron.arguments import parse_config
from megatron.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.split_size import SplitSize, split_size
from megatron.parallel_state import ParallelState
from megatron.tokenizer import NullTokenizer
from megatron.training import run_plan
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.data import VOCAB, data_argv, write_builder, write_indexed
from tests.support.logs import LogLines

SEQ = 8


def _config(*switches, **overrides):
    return parse_config(tiny_argv(*switches, **overrides))


def _gpt(tmp_path, docs, num_samples: int, name: str = "ds") -> GPTDataset:
    write_builder(tmp_path / name, docs)
    return GPTDataset("valid", MMapIndexedDataset(str(tmp_path / name)), (0, len(docs)), SEQ, 1, num_samples,
                      str(tmp_path / "cache"))


def test_one_pass_is_the_samples_whose_tokens_all_lie_in_the_first_epoch(tmp_path):
    """5 documents of 7 tokens: 35 tokens give (35 - 1) // 8 = 4 samples of 9 tokens; 10 samples need 3 epochs.
    The first 4 samples of the shuffle are distinct and come from the first epoch."""
    docs = [list(range(10 * d, 10 * d + 7)) for d in range(5)]
    ds = _gpt(tmp_path, docs, 10)
    size = split_size(ds, SEQ)
    assert (size.documents, size.tokens, size.one_pass, size.samples) == (5, 35, 4, len(ds))
    assert len(ds) >= 10 and size.passes(8) == 2.0
    first = [tuple(ds[i]["text"]) for i in range(size.one_pass)]
    assert len(set(first)) == size.one_pass
    assert all(int(ds.shuffle_idx[i]) < size.one_pass + 1 for i in range(size.one_pass))  # epoch 0's samples


def test_a_blends_pass_ends_where_its_first_part_repeats(tmp_path):
    """Two parts, 2:1 by tokens: the exact end (scanned in the blend's index) is the first sample some part draws
    beyond its own pass; the estimate from the shares is within one sample of it."""
    write_builder(tmp_path / "a", [list(range(40))] * 4)   # 160 tokens: 19 samples of 9 tokens per pass
    write_builder(tmp_path / "b", [list(range(40))] * 2)   # 80 tokens: 9 per pass
    cfg = dataclasses.replace(_config().data, mock_data=False, data_path=(str(tmp_path / "a"), str(tmp_path / "b")),
                              split="100,0,0", tokenizer_type="NullTokenizer", data_cache_path=str(tmp_path / "c"))
    blend, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), SEQ, 1, (90, 0, 0))
    exact = split_size(blend, SEQ, scan=len(blend))
    estimate = split_size(blend, SEQ)
    assert (exact.documents, exact.tokens) == (6, 240)
    drawn = {0: 0, 1: 0}
    for k in np.asarray(blend.dataset_index[:exact.one_pass]):
        drawn[int(k)] += 1
    assert drawn[0] <= 19 and drawn[1] <= 9  # no part beyond its pass
    k = int(blend.dataset_index[exact.one_pass])
    assert int(blend.dataset_sample_index[exact.one_pass]) >= (19, 9)[k]  # the next sample repeats
    assert abs(estimate.one_pass - exact.one_pass) <= 1


@pytest.mark.parametrize("explicit", [False, True])
def test_the_default_eval_iters_reads_one_pass_and_a_given_one_is_warned_about(explicit):
    config = _config(eval_iters=100 if explicit else None, global_batch_size=8)
    assert config.training.eval_iters == 100 and config.training.eval_iters_capped is not explicit
    size = SplitSize(samples=800, documents=3, tokens=250, one_pass=31)  # 3 global batches of 8, and 7
    with LogLines() as log:
        iterations = run_plan.eval_iterations("valid", size, config)
    assert iterations == (100 if explicit else 3)
    text = "\n".join(log.lines)
    assert "validation split 25.8 times over" in text
    wanted = "--eval-iters 3 reads at most one pass" if explicit else "reads 3 iterations, at most one pass"
    assert wanted in text


def test_a_split_smaller_than_a_batch_reads_one_iteration_and_says_so():
    config = _config(eval_iters=None, global_batch_size=8)
    with LogLines() as log:
        assert run_plan.eval_iterations("test", SplitSize(800, 1, 30, 3), config) == 1
    assert any("fewer than one global batch (8)" in line for line in log.lines)


def test_mock_data_and_a_large_split_read_what_was_asked():
    config = _config(eval_iters=None, global_batch_size=8)
    with LogLines() as log:
        assert run_plan.eval_iterations("valid", SplitSize(samples=800), config) == 100
        assert run_plan.eval_iterations("valid", SplitSize(800, 50, 10_000, 800), config) == 100
    assert not log.lines


def test_the_layout_line_names_the_engine():
    state = ParallelState(world_size=8, data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    config = _config()
    assert run_plan.layout_line(config, ParallelState()) == \
        "layout: world 1 = DP 1 x TP 1 x PP 1, engine torch (one data-parallel replica)"
    pp = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, pipeline_model_parallel_size=2,
                                                                         deepspeed=True, zero_stage=0))
    assert run_plan.layout_line(pp, state) == "layout: world 8 = DP 2 x TP 2 x PP 2, engine DeepSpeed pipeline"
    zero = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, deepspeed=True, zero_stage=3))
    assert run_plan.layout_line(zero, state).endswith("engine DeepSpeed ZeRO-3")


def test_progress_is_logged_with_the_time_left(monkeypatch):
    clock = iter([0.0, 12.0, 15.0, 30.0])
    monkeypatch.setattr(run_plan.time, "monotonic", lambda: next(clock))
    progress = run_plan.EvalProgress("validation", 40, enabled=True)  # began at 0
    with LogLines() as log:
        progress(10)  # 12 s: 10 of 40 done, 36 s left
        progress(12)  # 15 s: within 10 s of the last line
        progress(20)  # 30 s: 20 done, 30 s left
    assert log.lines == ["validation evaluation: 10/40 batches, 12 s, about 36 s left",
                         "validation evaluation: 20/40 batches, 30 s, about 30 s left"]


def test_a_small_corpus_run_says_its_splits_caps_eval_and_validates_at_the_end(tmp_path):
    """Training on 60 documents, validating on 12: the start-up lines give the layout and both splits; the
    validation split holds fewer samples than --eval-iters' default asks, so each evaluation reads one pass; the
    run ends with a validation at its last iteration (not a multiple of --eval-interval)."""
    train = write_indexed(tmp_path / "train", 60, seed=1)
    valid = write_indexed(tmp_path / "valid", 12, seed=2)
    argv = data_argv(train, valid, train_iters=6, eval_interval=4, eval_iters=None, log_interval=2)
    with LogLines() as log:
        result = pretrain(parse_config(argv + ["--data-cache-path", str(tmp_path / "cache")]))
    text = "\n".join(log.lines)
    assert "layout: world 1 = DP 1 x TP 1 x PP 1" in text
    valid_ds = MMapIndexedDataset(valid)
    tokens = int(valid_ds.sizes.sum())
    one_pass = (tokens - 1) // 32
    assert f"training split: 60 documents, {int(MMapIndexedDataset(train).sizes.sum()):,} tokens" in text
    assert f"validation split: 12 documents, {tokens:,} tokens = {one_pass:,} samples of 32 tokens per pass" in text
    batches = one_pass // 8
    plural = "" if batches == 1 else "s"
    assert f"each validation evaluation reads {batches} iteration{plural}, at most one pass" in text
    assert [it for it, _ in result.valid] == [4, 6]
    assert sum(line.startswith(" validation loss at iteration") for line in log.lines) == 2
