"""What a resume says, said once: a warning every rank would print alike comes from the logging rank only."""
from __future__ import annotations

from tests.support.training import launched_run

RUN = dict(train_iters=2, micro_batch_size=2, global_batch_size=4, eval_iters=0, log_interval=1, save_interval=2)


def test_a_changed_lr_schedule_is_warned_about_once_on_a_two_rank_resume(tmp_path):
    launched_run(tmp_path / "run", (), RUN, 2)
    log = launched_run(tmp_path / "resumed", (), RUN, 2, load=tmp_path / "run", train_iters=4, lr=1e-3)
    # One line per changed setting (the time stamp dropped: two ranks print the same message at different times).
    warnings = [line.split("] ", 1)[-1] for line in log.splitlines()
                if "learning-rate schedule differs from the checkpoint" in line]
    assert warnings and len(set(warnings)) == len(warnings), log[-3000:]
