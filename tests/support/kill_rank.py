"""`pretrain_gpt.py` whose rank RANK kills itself (SIGKILL) when iteration ITERATION starts, in torchrun's first
attempt only: `kill_rank.py RANK ITERATION -- <flags>`. A restarted attempt (TORCHELASTIC_RESTART_COUNT > 0) runs
untouched. For tests/e2e/test_rank_restart.py."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def install(rank: int, iteration: int) -> None:
    from megatron.training.loop import Trainer

    step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if (self.state.iteration == iteration and int(os.environ.get("RANK", "0")) == rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, *args, **kwargs)

    Trainer.train_step = train_step


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support import pretrain_main

    install(int(sys.argv[1]), int(sys.argv[2]))
    pretrain_main.run(sys.argv[sys.argv.index("--") + 1:])
