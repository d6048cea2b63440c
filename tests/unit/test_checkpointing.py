"""Checkpoint files: atomic saves, safe loading, clear errors."""
import os

import pytest
import torch

from megatron.arguments import parse_config
from megatron.checkpoint import manifest
from megatron.checkpoint import store as ckpt
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.training import save_tiny_checkpoint as _save


def test_layout_and_round_trip(tmp_path):
    _save(tmp_path, 100, 1.0)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "100"
    loaded = ckpt.load_checkpoint_files(tmp_path)
    assert loaded["path"].name == "iter_0000100"
    assert torch.equal(loaded["payload"]["model"]["w"], torch.ones(4))
    assert loaded["payload"]["checkpoint_version"] == ckpt.CHECKPOINT_VERSION
    assert loaded["train_state"] == {"iteration": 100} and loaded["config"] == {"note": "test"}


def test_failed_save_leaves_previous_checkpoint_loadable(tmp_path):
    _save(tmp_path, 10, 1.0)

    def crash(tmp_dir):
        assert (tmp_dir / "mp_rank_00" / "model_optim_rng.pt").exists()  # the crash happens mid-save
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 20, 2.0, _before_commit=crash)
    assert not (tmp_path / "iter_0000020").exists()
    loaded = ckpt.load_checkpoint_files(tmp_path)
    assert loaded["path"].name == "iter_0000010" and torch.equal(loaded["payload"]["model"]["w"], torch.ones(4))
    _save(tmp_path, 20, 2.0)  # the next save sweeps the debris
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
    assert ckpt.load_checkpoint_files(tmp_path)["path"].name == "iter_0000020"


def test_resaving_same_iteration_replaces_it(tmp_path):
    _save(tmp_path, 5, 1.0)
    _save(tmp_path, 5, 3.0)
    assert torch.equal(ckpt.load_checkpoint_files(tmp_path)["payload"]["model"]["w"], torch.full((4,), 3.0))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned_marker",))


def test_malicious_pickle_is_refused(tmp_path, monkeypatch):
    _save(tmp_path, 1, 1.0)
    target = ckpt.model_file(ckpt.iteration_dir(tmp_path, 1))
    torch.save({"model": _Evil()}, target)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load .* holds objects other than tensors"):
        ckpt.load_checkpoint_files(tmp_path)
    assert not (tmp_path / "pwned_marker").exists()


def test_a_truncated_checkpoint_file_is_reported_as_damaged_not_as_forbidden(tmp_path):
    _save(tmp_path, 1, 1.0)
    target = ckpt.model_file(ckpt.iteration_dir(tmp_path, 1))
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError, match=r"cannot read .*model_optim_rng.pt \([\d,]+ bytes\): the file is "
                                                   r"damaged or truncated") as error:
        ckpt.load_checkpoint_files(tmp_path)
    assert "tensors and plain data" not in str(error.value)


def test_tracker_errors(tmp_path):
    assert ckpt.load_checkpoint_files(tmp_path) is None  # nothing there: start from scratch
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(ckpt.CheckpointError, match="is corrupt"):
        ckpt.load_checkpoint_files(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(ckpt.CheckpointError, match="points at iteration 7 but"):
        ckpt.load_checkpoint_files(tmp_path)


def test_checkpoint_holds_plain_config_and_train_state(tmp_path):
    pretrain(parse_config(tiny_argv(save=tmp_path / "c", train_iters=3, eval_iters=0, lr_warmup_iters=0)))
    loaded = ckpt.load_checkpoint_files(tmp_path / "c")
    assert loaded["train_state"]["consumed_train_samples"] == 24
    assert loaded["config"]["model"]["hidden_size"] == 64
    assert set(loaded["payload"]) >= {"model", "optimizer", "lr_scheduler", "rng_state", "iteration"}
    assert "args" not in loaded["payload"]  # never a pickled Namespace


def test_no_load_optim_needed_when_optimizer_not_saved(tmp_path):
    pretrain(parse_config(tiny_argv("--no-save-optim", save=tmp_path / "c", train_iters=2, eval_iters=0,
                                    lr_warmup_iters=0)))
    with pytest.raises(ValueError, match="--no-load-optim"):
        pretrain(parse_config(tiny_argv(load=tmp_path / "c", train_iters=3, eval_iters=0, lr_warmup_iters=0)))
    result = pretrain(parse_config(tiny_argv("--no-load-optim", load=tmp_path / "c", train_iters=3, eval_iters=0,
                                             lr_warmup_iters=0)))
    assert result.state.iteration == 3


# ---------------------------------------------------------------------------- re-save, tracker, disk, errors
def test_missing_tracker_resumes_the_newest_complete_iteration(tmp_path, caplog):
    _save(tmp_path, 2, 1.0)
    _save(tmp_path, 4, 2.0)
    (tmp_path / ".tmp_iter_0000006_99").mkdir()  # an uncommitted save is not a checkpoint
    (tmp_path / ckpt.TRACKER_FILE).unlink()
    loaded = ckpt.load_checkpoint_files(tmp_path)
    assert loaded["path"].name == "iter_0000004"
    assert "resuming from the newest, 4" in caplog.text and "[2, 4]" in caplog.text


def test_missing_tracker_never_restarts_over_checkpoints(tmp_path):
    """End to end: a run whose --load folder lost its tracker continues from iteration 4 instead of starting over
    (and overwriting iter_0000004)."""
    argv = tiny_argv(train_iters=4, save=tmp_path, save_interval=2, eval_iters=0)
    pretrain(parse_config(argv, world_size=1))
    before = torch.load(ckpt.model_file(ckpt.iteration_dir(tmp_path, 4)), weights_only=True)["model"]
    (tmp_path / ckpt.TRACKER_FILE).unlink()
    result = pretrain(parse_config(tiny_argv(train_iters=6, save=tmp_path, load=tmp_path, eval_iters=0),
                                   world_size=1))
    assert result.state.iteration == 6 and len(result.losses) == 2  # iterations 5 and 6 only
    after = torch.load(ckpt.model_file(ckpt.iteration_dir(tmp_path, 4)), weights_only=True)["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("content", ['{"iteration": 4, "consum', "", "\x00\x01"])
def test_damaged_train_state_json_names_the_file(tmp_path, content):
    _save(tmp_path, 4, 1.0)
    (tmp_path / "iter_0000004" / "train_state.json").write_text(content)
    with pytest.raises(ckpt.CheckpointError, match=r"iter_0000004/train_state.json is damaged"):
        ckpt.load_checkpoint_files(tmp_path)


def test_disk_full_names_enospc_and_the_folder_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The kernel's own ENOSPC: the model file is written to /dev/full."""
    _save(tmp_path, 2, 1.0)
    real_open = open

    def open_full(path, mode="r", *args, **kwargs):
        if str(path).endswith("model_optim_rng.pt") and "w" in mode:
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(manifest, "open", open_full, raising=False)  # the model file is opened by ChecksumFile
    with pytest.raises(ckpt.CheckpointError, match=rf"no space left on device \(ENOSPC\) while writing a checkpoint "
                                                   rf"into {tmp_path}"):
        _save(tmp_path, 4, 2.0)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []  # no partial folder left
    assert ckpt.load_checkpoint_files(tmp_path)["path"].name == "iter_0000002"


@pytest.mark.parametrize("first, then", [("fp8adam", "adam"), ("adam", "fp8adam")])
def test_switching_the_optimizer_between_runs_converts_its_moments(tmp_path, first, then):
    """A checkpoint of Fp8AdamW (FP8 moments) resumed with AdamW, and the reverse: the moments come through the
    full state, converted (dequantized, or quantized), and the run goes on; the loaded moments are the saved ones."""
    from megatron.checkpoint.full_state import read_full_state
    from megatron.training.loop import Trainer

    pretrain(parse_config(tiny_argv("--optimizer", first, "--device", "cpu", save=tmp_path, train_iters=2,
                                    save_interval=2, eval_iters=0)))
    saved = read_full_state(ckpt.iteration_dir(tmp_path, 2)).optimizer["params"]
    trainer = Trainer(parse_config(tiny_argv("--optimizer", then, "--device", "cpu", load=tmp_path, train_iters=3,
                                             eval_iters=0)))
    opt = trainer.optimizer
    assert type(opt).__name__ == ("AdamW" if then == "adam" else "Fp8AdamW")
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.dim() == 2)
    state = opt.state[param]
    if then == "adam":  # the dequantized FP8 moments, exactly
        assert torch.equal(state["exp_avg"], saved[name]["exp_avg"])
    else:  # quantized from the FP32 ones: within E4M3's half-ulp of each block's scale
        assert state["exp_avg"].dtype == torch.float8_e4m3fn
    trainer.train()  # and it trains on
