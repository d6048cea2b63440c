"""`--verify-checkpoint` (megatron/checkpoint/verify.py): every file read back and compared, bit for bit, with what
was written, before the commit; a difference is one error naming the file, and the tracker keeps the previous
checkpoint."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import parse_config
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.verify import first_difference, verify_file
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv


def test_first_difference_is_bitwise_and_names_the_entry():
    nan = torch.tensor([float("nan"), -0.0, 1.0])
    written = {"model": {"w": nan, "fp8": torch.ones(3, dtype=torch.float8_e4m3fn)}, "steps": [1, 2.5, float("nan")],
               "flag": torch.tensor(True)}
    same = {"model": {"w": nan.clone(), "fp8": torch.ones(3, dtype=torch.float8_e4m3fn)},
            "steps": [1, 2.5, float("nan")], "flag": torch.tensor(True)}
    assert first_difference(same, written) is None  # NaNs and -0.0 compare by their bytes
    plus_zero = {**same, "model": {**same["model"], "w": torch.tensor([float("nan"), 0.0, 1.0])}}
    assert first_difference(plus_zero, written) == "model/w: the tensor's bytes differ"
    assert "model/fp8" in first_difference({**same, "model": {**same["model"], "fp8": torch.ones(3)}}, written)
    assert "steps[1]" in first_difference({**same, "steps": [1, 2.0, float("nan")]}, written)
    assert "keys differ" in first_difference({"model": same["model"]}, written)


def test_a_file_that_does_not_hold_what_was_written_is_named(tmp_path):
    path = tmp_path / "f.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    verify_file(path, {"w": torch.arange(4.0)})
    with pytest.raises(ckpt.CheckpointError, match=r"f\.pt does not hold what was written \(w: the tensor's bytes"):
        verify_file(path, {"w": torch.arange(4.0) + 1})
    path.write_bytes(path.read_bytes()[:40])  # truncated
    with pytest.raises(ckpt.CheckpointError, match=r"f\.pt cannot be read back"):
        verify_file(path, {"w": torch.arange(4.0)})


def _corrupting_save(monkeypatch, after: int):
    """torch.save writes a changed first weight from the `after`+1-th checkpoint on (what a bad disk or a wrong
    serialization would leave), while the trainer believes it wrote the live state."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) > after and isinstance(obj, dict) and "model" in obj:
            model = dict(obj["model"])
            name = next(iter(model))
            model[name] = model[name] + 1
            obj = dict(obj, model=model)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_training_run_verifies_each_save_and_commits_none_that_differs(tmp_path, monkeypatch):
    argv = tiny_argv("--save", str(tmp_path), "--verify-checkpoint", "--verify-checkpoint-model-type", "LLAMA",
                     "--device", "cpu", train_iters=4, save_interval=2, eval_iters=0)
    pretrain(parse_config(argv))
    assert ckpt.read_tracker(tmp_path) == 4  # both saves verified and committed
    _corrupting_save(monkeypatch, after=0)
    resumed = tiny_argv("--save", str(tmp_path), "--load", str(tmp_path), "--verify-checkpoint", "--device", "cpu",
                        train_iters=6, save_interval=2, eval_iters=0)
    with pytest.raises(ckpt.CheckpointError, match=r"model_optim_rng\.pt does not hold what was written"):
        pretrain(parse_config(resumed))
    assert ckpt.read_tracker(tmp_path) == 4  # the tracker still names the last verified checkpoint
    assert not (tmp_path / "iter_0000006").exists() and not list(tmp_path.glob(".tmp*"))


@pytest.mark.parametrize("switches, message", [
    (["--verify-checkpoint-model-type", "LLAMA"], "--verify-checkpoint-model-type needs --verify-checkpoint"),
    (["--verify-checkpoint", "--verify-checkpoint-model-type", "BLOOM"], "use one of GPT, LLAMA"),
    (["--verify-checkpoint"], "--verify-checkpoint checks the checkpoints of --save"),
])
def test_the_flags_are_checked(switches, message):
    with pytest.raises(ValueError, match=message):
        parse_config(tiny_argv(*switches), env={})
