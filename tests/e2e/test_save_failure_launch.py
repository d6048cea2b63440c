"""A checkpoint save that fails on one rank of a 2-rank DeepSpeed run (ENOSPC while rank 1 writes its ZeRO partition):
the error is held until DeepSpeed's barriers are behind every rank, both ranks agree, the partial folder is removed,
the previous checkpoint stays the newest, and training goes on to the next save."""
from __future__ import annotations

import pytest

from megatron.checkpoint import store as ckpt
from tests.support.config import REPO, tiny_argv
from tests.support.launch import launch_checked

pytest.importorskip("deepspeed")

RUN = dict(save_interval=2, train_iters=6, micro_batch_size=2, global_batch_size=8, eval_iters=0, eval_interval=1000,
           log_interval=1)
# Rank 1's ZeRO partition of iteration 4 hits a full disk halfway through the file.
FULL_DISK = r'''
import errno, os, runpy, sys
from megatron.checkpoint import manifest
write = manifest.ChecksumFile.write
def full(self, data):
    if (os.environ.get("RANK") == "1" and "tmp_iter_0000004" in str(self.path)
            and self.path.name.endswith("optim_states.pt") and self.bytes > 0):
        raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, data)
manifest.ChecksumFile.write = full
sys.argv = [%r] + sys.argv[1:]
runpy.run_path(%r, run_name="__main__")
''' % (str(REPO / "pretrain_gpt.py"), str(REPO / "pretrain_gpt.py"))


def test_a_save_that_fails_on_one_deepspeed_rank_is_skipped_by_every_rank_and_training_goes_on(tmp_path):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    run = tmp_path / "run"
    out = launch_checked(2, tiny_argv("--deepspeed", "--zero-stage", "1", save=run, **RUN), str(script),
                         stdout_tail=0, stderr_tail=3000)
    log = out.stdout + out.stderr
    assert "iteration 4: checkpoint not saved (1 failed in a row" in log, log[-3000:]
    assert "no space left on device (ENOSPC)" in log, log[-3000:]
    assert sorted(p.name for p in run.iterdir() if "iter_" in p.name) == ["iter_0000002", "iter_0000006"]
    assert ckpt.read_tracker(run) == 6
