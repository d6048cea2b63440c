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


def checkpoint_tensors(folder, iteration: int) -> dict:
    """Every tensor of every file of checkpoint `iteration` under `folder` (weights, optimizer, FP8 and RNG state, in
    any engine's layout), keyed by file and path inside it: for bitwise comparisons of whole runs."""
    import torch

    final = folder / f"iter_{iteration:07d}"
    out = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)

    for path in sorted(final.rglob("*.pt")):
        walk(str(path.relative_to(final)), torch.load(path, map_location="cpu", weights_only=False))
    if (final / "dcp").is_dir():  # --ckpt-format torch_dist: every saved key, whole
        from megatron.checkpoint import dcp_io

        walk("dcp", dcp_io.read_full(final))
    assert out, f"no tensors in {final}"
    return out


def bitwise_differences(got: dict, want: dict) -> list[str]:
    """The keys whose tensors differ in dtype or in any bit (after checking both hold the same keys)."""
    import torch

    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:10]
    return [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


def launched_run(folder, switches: tuple, run: dict, nproc: int = 2, **overrides) -> str:
    """Train `nproc` processes (tests.support.launch) on the tiny config with `switches` and `run`'s settings,
    saving to `folder`; `overrides` replace settings. Returns the run's log (stderr)."""
    from tests.support.launch import launch_checked

    return launch_checked(nproc, tiny_argv(*switches, **{**run, "save": folder, **overrides}), stdout_tail=0).stderr


def straight_and_resumed(root, switches: tuple, run: dict, nproc: int = 2) -> tuple[str, str]:
    """Launched runs of `switches` in `nproc` processes: straight to `run["train_iters"]` in root/"straight", and in
    root/"resumed" stopped halfway (`--exit-interval`) then resumed from its own checkpoint. Returns (straight log,
    resumed log)."""
    straight = launched_run(root / "straight", switches, run, nproc)
    launched_run(root / "resumed", switches, run, nproc, exit_interval=run["train_iters"] // 2)
    return straight, launched_run(root / "resumed", switches, run, nproc, load=root / "resumed")


def assert_same_checkpoint(got_folder, want_folder, iteration: int) -> None:
    """Checkpoint `iteration` holds the same keys with the same bits in both folders."""
    different = bitwise_differences(checkpoint_tensors(got_folder, iteration),
                                    checkpoint_tensors(want_folder, iteration))
    assert not different, different[:10]
