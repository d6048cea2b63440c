"""Pretrain a Llama-style GPT: parse flags -> typed config -> (dry run | train). All work is in `megatron/`."""
import sys

from megatron.arguments import parse_config
from megatron.errors import run_cli
from megatron.parallel_state import finish_distributed_run, world_size_from_env
from megatron.training.dry_run import describe
from megatron.training.loop import TrainingDiverged, pretrain


def main(argv=None) -> int:
    """Exit codes: 0 done, 2 a user error (bad flags, data or checkpoint: one line, no traceback; see
    megatron/errors.py), 3 the run diverged, 4 another rank died or stopped answering (one line)."""
    config = parse_config(argv)
    if config.training.dry_run:
        print(describe(config))
        return 0
    try:
        pretrain(config)
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    code = run_cli(main)
    if world_size_from_env() > 1:
        finish_distributed_run(code)  # skips interpreter finalization (see its docstring)
    sys.exit(code)
