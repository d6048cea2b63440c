"""In-process helpers: training runs through `pretrain` and checkpoint files written directly."""
from __future__ import annotations

from tests.support.config import tiny_argv


def assert_resume_is_exact(tmp_path, switches: tuple, stop: int, **common):
    """Train straight through; train again saving at iteration `stop` (`--exit-interval`), then resume in a new
    run: the losses after `stop` and the final weights equal the straight run's bit for bit. Returns both runs."""
    import torch

    from megatron.arguments import parse_config
    from megatron.training.loop import pretrain

    straight = pretrain(parse_config(tiny_argv(*switches, **common)))
    pretrain(parse_config(tiny_argv(*switches, save=tmp_path / "c", exit_interval=stop, **common)))
    resumed = pretrain(parse_config(tiny_argv(*switches, load=tmp_path / "c", **common)))
    assert straight.losses[stop:] == resumed.losses
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k
    return straight, resumed


def save_tiny_checkpoint(root, iteration: int, value: float, **kw):
    """A checkpoint written directly (no training) at `iteration` in `root`: model {"w": four times `value`}, train
    state {"iteration": iteration}, config {"note": "test"}; `kw` goes to `save_checkpoint`."""
    import torch

    from megatron.checkpoint import store as ckpt

    return ckpt.save_checkpoint(root, iteration, {"model": {"w": torch.full((4,), float(value))}},
                                {"iteration": iteration}, {"note": "test"}, **kw)
