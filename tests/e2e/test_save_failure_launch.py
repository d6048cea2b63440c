"""A checkpoint save that fails on one rank of a 2-rank run: ENOSPC while rank 1 writes its ZeRO partition (DeepSpeed:
the error is held until DeepSpeed's barriers are behind every rank), or its shards of a sharded checkpoint (FSDP2,
--ckpt-format torch_dist, synchronous or --async-save: DCP gathers every rank's error). Both ranks agree, the partial
folder is removed, the previous checkpoint stays the newest, and training goes on to the next save."""
from __future__ import annotations

import re

import pytest

from megatron.checkpoint import store as ckpt
from tests.support.config import REPO, tiny_argv
from tests.support.launch import launch_checked

RUN = dict(save_interval=2, train_iters=6, micro_batch_size=2, global_batch_size=8, eval_iters=0, eval_interval=1000,
           log_interval=1)
# Rank 1's ZeRO partition, or its DCP shards, of iteration 4 hit a full disk.
FULL_DISK = r'''
import errno, os, runpy, sys
from torch.distributed.checkpoint import filesystem
from megatron.checkpoint import manifest
def full_disk(path):
    return os.environ.get("RANK") == "1" and "tmp_iter_0000004" in str(path)
write = manifest.ChecksumFile.write
def full(self, data):
    if full_disk(self.path) and self.path.name.endswith("optim_states.pt") and self.bytes > 0:
        raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, data)
manifest.ChecksumFile.write = full
write_data = filesystem._FileSystemWriter.write_data
def full_shards(self, plan, planner):
    if full_disk(self.path):
        raise OSError(errno.ENOSPC, "No space left on device")
    return write_data(self, plan, planner)
filesystem._FileSystemWriter.write_data = full_shards
sys.argv = [%r] + sys.argv[1:]
runpy.run_path(%r, run_name="__main__")
''' % (str(REPO / "pretrain_gpt.py"), str(REPO / "pretrain_gpt.py"))
ENGINES = {
    "deepspeed-zero1": ("--deepspeed", "--zero-stage", "1"),
    "fsdp2-torch-dist": ("--use-torch-fsdp2", "--ckpt-format", "torch_dist"),
    "fsdp2-async-save": ("--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--async-save"),
}


@pytest.mark.parametrize("engine", list(ENGINES.values()), ids=list(ENGINES))
def test_a_save_that_fails_on_one_rank_is_skipped_by_every_rank_and_training_goes_on(tmp_path, engine):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    run = tmp_path / "run"
    out = launch_checked(2, tiny_argv(*engine, save=run, **RUN), str(script), stdout_tail=0, stderr_tail=3000)
    log = out.stdout + out.stderr
    # Each rank says its own error, at the iteration that finds it: the save of iteration 4 itself (DeepSpeed,
    # synchronous DCP), or for a background write the poll after a later iteration, 5 (before the save of 6) or 6
    # (after it, as the write took longer than an iteration): the next save it names follows from there.
    found = re.search(r"iteration (\d+): checkpoint not saved \(1 failed in a row.*the next save is at iteration "
                      r"(\d+)", log)
    assert found and (int(found[1]), int(found[2])) in {(4, 6), (5, 6), (6, 8)}, log[-3000:]
    assert (int(found[1]) == 4) == ("--async-save" not in engine), log[-3000:]
    assert "No space left on device" in log or "no space left on device (ENOSPC)" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert sorted(p.name for p in run.iterdir() if "iter_" in p.name) == ["iter_0000002", "iter_0000006"]
    assert ckpt.read_tracker(run) == 6
