"""`--exit-on-stall-seconds` (megatron/training/stall.py): a rank on which no iteration finished for that long writes
every thread's stack to a file, prints one line and ends with exit code 4; a rank that keeps finishing iterations,
and one still in its first iteration, is left alone."""
from __future__ import annotations

import threading
import time

import pytest

from megatron.arguments import parse_config
from megatron.training import stall
from megatron.training.loop import Trainer, pretrain
from tests.support.config import tiny_argv


def test_a_stalled_rank_ends_with_one_line_and_its_stacks_and_a_busy_one_does_not(capsys):
    ended = threading.Event()
    codes: list[int] = []
    watchdog = stall.StallWatchdog(0.4, rank=3, exit=lambda code: (codes.append(code), ended.set()))
    time.sleep(0.8)  # the first iteration has not finished: its compilation may take any time
    for iteration in range(1, 9):
        watchdog.finished(iteration)
        time.sleep(0.1)
    assert codes == []
    assert ended.wait(10)  # nothing finishes after iteration 8
    watchdog.close()
    assert codes == [stall.STALL_EXIT_CODE] == [4]
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("error: no iteration finished for ")
    assert "since iteration 8 (--exit-on-stall-seconds 0.4)" in line
    stacks = line.split("every thread's stack is in ")[1].split(". The process")[0]
    assert "megatron-stall-rank3-" in stacks and "test_stall_watchdog.py" in open(stacks).read()


def test_the_flag_watches_the_training_loop(monkeypatch, capsys):
    codes: list[int] = []
    monkeypatch.setattr(stall, "end_process", codes.append)  # called on the watchdog's thread; the run goes on
    step = Trainer.train_step

    def stuck_at_3(self, *args, **kwargs):
        if self.state.iteration == 3:
            time.sleep(2.5)  # a stuck filesystem under the data loader
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", stuck_at_3)
    pretrain(parse_config(tiny_argv("--exit-on-stall-seconds", "1", train_iters=5, eval_iters=0, eval_interval=100)))
    assert codes == [4]
    assert "error: no iteration finished for " in capsys.readouterr().err


def test_the_flag_takes_positive_seconds():
    with pytest.raises(ValueError, match="--exit-on-stall-seconds must be > 0"):
        parse_config(tiny_argv("--exit-on-stall-seconds", "0"))
