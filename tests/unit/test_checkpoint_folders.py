"""`--load` and `--save` folders checked before a run trains (megatron/checkpoint/folders.py): a mistyped `--load`
and a `--save` holding newer checkpoints are refused in one line; a run that resumes itself is not."""
from __future__ import annotations

import pytest

from megatron.arguments import parse_config
from megatron.checkpoint.folders import check_load_folder, check_save_folder, prune_checkpoints
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv

RUN = dict(train_iters=4, save_interval=2, eval_iters=0, eval_interval=1000, log_interval=1)


def test_a_missing_load_folder_is_an_error_unless_it_is_also_save(tmp_path):
    missing = str(tmp_path / "typo")
    with pytest.raises(FileNotFoundError, match=r"--load .*typo does not exist"):
        check_load_folder(missing, str(tmp_path / "out"))
    check_load_folder(missing, missing)  # a run that resumes itself: its first start has nothing to load
    check_load_folder(None, missing)


def test_a_save_folder_with_newer_checkpoints_is_refused_and_resuming_it_is_not(tmp_path):
    save = tmp_path / "ckpt"
    pretrain(parse_config(tiny_argv(save=save, **RUN)))  # checkpoints of iterations 2 and 4
    with pytest.raises(ValueError, match=r"--save .*ckpt holds checkpoints up to iteration 4, newer than this run's "
                                         r"start \(iteration 0\).*--load .*ckpt, or pass a new --save folder"):
        pretrain(parse_config(tiny_argv(save=save, **RUN)))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"  # untouched
    check_save_folder(str(save), None, 4)  # a start at the newest iteration overwrites nothing
    resumed = pretrain(parse_config(tiny_argv(save=save, load=save, **{**RUN, "train_iters": 6})))
    assert resumed.state.iteration == 6


def test_keep_last_n_checkpoints_removes_older_ones_after_each_save_but_never_the_healthy_one(tmp_path):
    save = tmp_path / "ckpt"
    pretrain(parse_config(tiny_argv("--keep-last-n-checkpoints", "2", save=save, **{**RUN, "train_iters": 8})))
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000006", "iter_0000008"]
    resumed = pretrain(parse_config(tiny_argv(save=save, load=save, **{**RUN, "train_iters": 10})))
    assert resumed.state.iteration == 10
    # the newest healthy checkpoint survives even when newer ones (saved while diverging) fill the K kept
    assert prune_checkpoints(str(save), 1, str(save / "iter_0000008")) == [6]
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000008", "iter_0000010"]


def test_checkpoint_count_flags_are_checked(tmp_path):
    match = "--keep-last-n-checkpoints .* needs --save and a count of at least 1"
    with pytest.raises(ValueError, match=match):
        parse_config(tiny_argv("--keep-last-n-checkpoints", "0", save=tmp_path / "ckpt", **RUN))
    with pytest.raises(ValueError, match=match):
        parse_config(tiny_argv("--keep-last-n-checkpoints", "2", **RUN))
    with pytest.raises(ValueError, match="--exit-on-save-failure must be at least 1"):
        parse_config(tiny_argv("--exit-on-save-failure", "0", save=tmp_path / "ckpt", **RUN))


def test_a_failed_interval_save_is_logged_and_training_goes_on_until_n_in_a_row(tmp_path, monkeypatch):
    import logging

    from megatron.checkpoint import store, tp_shards

    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())

    write = store.write_model_file
    failing = {2, 6}  # ENOSPC at these iterations' saves

    def flaky(staging, rank, payload, iteration, verify=None):
        if iteration in failing:
            with store.checkpoint_write_errors(staging):
                raise OSError(28, "No space left on device")
        return write(staging, rank, payload, iteration, verify)

    monkeypatch.setattr(store, "write_model_file", flaky)  # one process: store.save_checkpoint writes
    monkeypatch.setattr(tp_shards, "write_model_file", flaky)
    save = tmp_path / "ckpt"
    logging.getLogger("megatron").addHandler(handler)
    try:
        result = pretrain(parse_config(tiny_argv(save=save, **{**RUN, "train_iters": 8})))
    finally:
        logging.getLogger("megatron").removeHandler(handler)
    assert result.state.iteration == 8  # two failures, not in a row: the run went on
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000008"]
    assert not [p for p in save.iterdir() if p.name.startswith(".tmp")]  # partial folders removed
    assert sum("checkpoint not saved" in e for e in errors) == 2, errors
    failing.update({10, 12})
    with pytest.raises(store.CheckpointError, match="no space left on device"):
        pretrain(parse_config(tiny_argv("--exit-on-save-failure", "2", save=save, load=save,
                                        **{**RUN, "train_iters": 14})))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
