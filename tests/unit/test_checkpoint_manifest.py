"""Each checkpoint's manifest (megatron/checkpoint/manifest.py) and the resume's fallback to the newest intact
checkpoint (megatron/checkpoint/fallback.py): written from the bytes saved, checked before loading, a damaged newest
checkpoint reported in one line and left in place, and the run resumed from the one before it bit for bit."""
from __future__ import annotations

import json
import logging
import zlib

import pytest
import torch

from megatron.arguments import parse_config
from megatron.checkpoint import manifest
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.fallback import resume_iteration
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.training import save_tiny_checkpoint

MODEL = "mp_rank_00/model_optim_rng.pt"


def flip_bit(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.fixture
def megatron_log():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("megatron").addHandler(handler)
    yield records
    logging.getLogger("megatron").removeHandler(handler)


def test_the_manifest_holds_each_files_written_size_and_crc32(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, 10, 1.0)
    files = json.loads((folder / manifest.MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == ["config.json", MODEL, "train_state.json"]
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": zlib.crc32(data)}, name
    assert not (folder / manifest.PARTS_DIR).exists()
    assert manifest.problems(folder) is None


def test_checksum_file_counts_what_torch_save_writes_in_both_serializations(tmp_path):
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": [1, 2.5, "x"]}
    for zipfile in (True, False):  # DeepSpeed's checkpoint engine may use the legacy format
        path = tmp_path / f"f{zipfile}.pt"
        with manifest.ChecksumFile(path) as f:
            torch.save(state, f, _use_new_zipfile_serialization=zipfile)
        data = path.read_bytes()
        assert f.entry() == {"bytes": len(data), "crc32": zlib.crc32(data)}
        assert torch.equal(torch.load(path, weights_only=True)["a"], state["a"])


def test_a_truncated_flipped_or_missing_file_is_named_with_what_is_wrong(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, 10, 1.0)
    model = folder / MODEL
    original = model.read_bytes()
    truncate(model, len(original) - 7)
    assert manifest.problems(folder) == (f"{model} is truncated or overwritten: {len(original) - 7:,} bytes, "
                                         f"{len(original):,} were written")
    model.write_bytes(original)
    flip_bit(model, len(original) // 2)
    assert manifest.problems(folder).startswith(f"{model} fails its checksum: CRC-32 ")
    model.write_bytes(original)
    (folder / "config.json").unlink()
    assert manifest.problems(folder) == f"{folder / 'config.json'} is missing"
    (folder / manifest.MANIFEST_FILE).write_text("{not json")
    assert manifest.problems(folder).startswith(f"{folder / manifest.MANIFEST_FILE} is damaged")
    (folder / manifest.MANIFEST_FILE).unlink()  # a folder without a manifest (older saves, upstream): not checked
    assert manifest.problems(folder) is None


def test_ranks_share_the_checksum_reading_and_together_read_every_file(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, 10, 1.0)
    names = sorted(json.loads((folder / manifest.MANIFEST_FILE).read_text())["files"])
    assert names == ["config.json", MODEL, "train_state.json"]
    flip_bit(folder / MODEL, 100)  # the second name: read by part 1 of 2
    assert manifest.problems(folder, 0, 2) is None
    assert "fails its checksum" in manifest.problems(folder, 1, 2)
    assert "fails its checksum" in manifest.problems(folder, 1, 3)


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_leaves_the_damaged_one(tmp_path, megatron_log):
    for iteration in (10, 20, 30):
        save_tiny_checkpoint(tmp_path, iteration, iteration)
    damaged = ckpt.iteration_dir(tmp_path, 30) / MODEL
    flip_bit(damaged, 64)
    before = damaged.read_bytes()
    assert resume_iteration(str(tmp_path), fallback=True) == 20
    assert damaged.read_bytes() == before and ckpt.read_tracker(tmp_path) == 30  # untouched
    errors = [r.getMessage() for r in megatron_log if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"checkpoint of iteration 30 under {tmp_path} is damaged: {damaged} fails its " \
                                  "checksum" in errors[0]
    assert ckpt.load_checkpoint_files(tmp_path, iteration=20)["payload"]["model"]["w"].eq(20).all()
    with pytest.raises(ckpt.CheckpointError, match=r"iteration 30 .* is damaged: .* --no-checkpoint-fallback is set"):
        resume_iteration(str(tmp_path), fallback=False)
    (ckpt.iteration_dir(tmp_path, 20) / "train_state.json").write_text("{}")  # changed on disk: size differs
    truncate(ckpt.iteration_dir(tmp_path, 10) / MODEL, 100)
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint under .* matches its manifest \(iteration 30: .* "
                                                   r"fails its checksum.*; iteration 20: .*train_state.json is "
                                                   r"truncated.*; iteration 10: .*model_optim_rng.pt is truncated"):
        resume_iteration(str(tmp_path), fallback=True)


def test_a_tracker_pointing_at_a_removed_folder_falls_back_too(tmp_path):
    for iteration in (10, 20):
        save_tiny_checkpoint(tmp_path, iteration, iteration)
    (tmp_path / ckpt.TRACKER_FILE).write_text("30")
    assert resume_iteration(str(tmp_path), fallback=True) == 20


def test_a_run_resumed_past_a_damaged_newest_checkpoint_ends_with_the_uninterrupted_runs_weights(tmp_path):
    run = dict(eval_iters=0, eval_interval=1000, log_interval=1, save_interval=2)
    straight = pretrain(parse_config(tiny_argv(**run, train_iters=6)))
    save = tmp_path / "ckpt"
    pretrain(parse_config(tiny_argv(**run, train_iters=4, save=save)))  # checkpoints of iterations 2 and 4
    model = ckpt.iteration_dir(save, 4) / MODEL
    truncate(model, model.stat().st_size // 2)
    with pytest.raises(ckpt.CheckpointError, match="--no-checkpoint-fallback is set"):
        pretrain(parse_config(tiny_argv("--no-checkpoint-fallback", **run, train_iters=6, save=save, load=save)))
    resumed = pretrain(parse_config(tiny_argv(**run, train_iters=6, save=save, load=save)))  # from 2, re-saves 4
    assert resumed.losses == straight.losses[2:]
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k
    assert manifest.problems(ckpt.iteration_dir(save, 4)) is None  # the re-save replaced the damaged copy
