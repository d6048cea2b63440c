"""`pretrain_gpt.py`'s `__main__` for the wrapper scripts of tests/support (count_collectives.py, kill_rank.py):
they patch something, then run the CLI with `argv` and leave as it does."""
from __future__ import annotations

import sys
from pathlib import Path

from tests.support.config import REPO



def run(argv: list[str], before_exit=None) -> None:
    """Run `pretrain_gpt.main(argv)` as its script does; `before_exit(code)` is called first when given."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.errors import run_cli
    from megatron.parallel_state import finish_distributed_run, world_size_from_env

    code = run_cli(pretrain_gpt.main, argv)
    if before_exit is not None:
        before_exit(code)
    if world_size_from_env() > 1:
        finish_distributed_run(code)
    sys.exit(code)
