"""`--async-save`'s saver in one process (a one-rank gloo group): the snapshot is taken before `start` returns, the
checkpoint is committed only by `poll`, a save that never reached its commit (a killed process) leaves the previous
checkpoint the newest, and a failed background write fails the save with the previous one intact.
tests/e2e/test_fsdp2_sharded_checkpoints.py compares async and synchronous saves of whole runs."""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

from megatron.checkpoint import dcp_io
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.dcp_async import AsyncSaver
from tests.support.processes import one_rank_world


@pytest.fixture
def saver():
    with one_rank_world():
        yield AsyncSaver(0, None)


def _state(value: float) -> dict:
    return {"model/w": torch.full((4, 3), value), "model/b": torch.arange(3.0) + value}


def test_the_snapshot_is_taken_before_start_returns(saver, tmp_path, monkeypatch):
    import threading

    import torch.distributed.checkpoint as dcp

    changed, write = threading.Event(), dcp.FileSystemWriter.write_data

    def write_after_the_change(self, *args, **kwargs):  # the background write starts only after training went on
        assert changed.wait(60)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_after_the_change)
    state = _state(1.0)
    saver.start(str(tmp_path), 10, state, {"rng": torch.tensor([7])}, {"iteration": 10}, {})
    for tensor in state.values():  # training goes on: the weights change in place
        tensor.add_(100.0)
    changed.set()
    assert saver.poll(wait=True) == 10
    saved = dcp_io.nested_state(dcp_io.read_full(ckpt.iteration_dir(tmp_path, 10), dcp_io.MODEL))[0]
    assert torch.equal(saved["w"], torch.full((4, 3), 1.0)) and torch.equal(saved["b"], torch.arange(3.0) + 1)
    assert ckpt.read_tracker(tmp_path) == 10
    assert dcp_io.read_extras(ckpt.iteration_dir(tmp_path, 10))["rng"].tolist() == [7]


def test_only_the_commit_makes_it_the_newest(saver, tmp_path):
    saver.start(str(tmp_path), 5, _state(0.0), {}, {"iteration": 5}, {})
    assert saver.poll(wait=True) == 5
    saver.start(str(tmp_path), 10, _state(1.0), {}, {"iteration": 10}, {})
    saver.pending.future.result()  # written, and the process killed before its next poll
    assert ckpt.read_tracker(tmp_path) == 5 and not ckpt.iteration_dir(tmp_path, 10).exists()
    assert list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))  # the uncommitted staging folder
    restarted = AsyncSaver(0, None)  # the next run resumes from 5 and its first save sweeps the leftovers
    restarted.start(str(tmp_path), 6, _state(2.0), {}, {"iteration": 6}, {})
    assert not [p for p in tmp_path.glob(ckpt.TMP_PREFIX + "*") if "0000010" in p.name]
    assert restarted.poll(wait=True) == 6 and ckpt.read_tracker(tmp_path) == 6


def test_a_failed_background_write_fails_the_save_and_keeps_the_previous(saver, tmp_path):
    saver.start(str(tmp_path), 5, _state(0.0), {}, {"iteration": 5}, {})
    assert saver.poll(wait=True) == 5
    saver.start(str(tmp_path), 10, _state(1.0), {}, {"iteration": 10}, {})
    saver.pending.future.result()
    failed = concurrent.futures.Future()
    failed.set_exception(OSError(28, "No space left on device"))
    saver.pending.future = failed
    with pytest.raises(ckpt.CheckpointError, match="background write of checkpoint 10 .* checkpoint is intact"):
        saver.poll(wait=True)
    assert saver.pending is None and ckpt.read_tracker(tmp_path) == 5
    assert not list(tmp_path.glob(ckpt.TMP_PREFIX + "*"))
