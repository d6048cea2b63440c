"""Checkpoint files against killed processes (SIGKILL mid-save, between the renames of a re-save) and the
user-facing errors of `pretrain_gpt.py` and tools/evaluate.py: each in its own process."""
import subprocess
import sys

import torch

from megatron.checkpoint import store as ckpt
from tests.support.config import REPO, tiny_argv
from tests.support.launch import launch as _launch, pretrain_cli as _pretrain_cli
from tests.support.training import save_tiny_checkpoint as _save


def test_killed_save_process_leaves_previous_checkpoint(tmp_path):
    """A process killed (SIGKILL) while writing never exposes a half-written iter_ folder."""
    _save(tmp_path, 1, 1.0)
    script = (
        "import os, signal, torch, sys\n"
        "from megatron.checkpoint import store as c\n"
        "def die(tmp): os.kill(os.getpid(), signal.SIGKILL)\n"
        f"c.save_checkpoint({str(tmp_path)!r}, 2, {{'model': {{'w': torch.zeros(1000)}}}}, {{}}, {{}}, _before_commit=die)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO)
    assert proc.returncode == -9
    assert not (tmp_path / "iter_0000002").exists()
    assert ckpt.load_checkpoint_files(tmp_path)["path"].name == "iter_0000001"


# ---------------------------------------------------------------------------- re-save, tracker, disk, errors
def _kill_between_resave_renames(root, iteration, value) -> None:
    """Re-save `iteration` in a process killed (SIGKILL) with the old copy moved aside and the new one not yet in
    its place: the exact point between the two renames of `commit_checkpoint`."""
    script = (
        "import os, signal, torch\n"
        "from megatron.checkpoint import store as c\n"
        "def die(path): os.kill(os.getpid(), signal.SIGKILL)\n"
        "die.between_renames = True\n"
        f"c.save_checkpoint({str(root)!r}, {iteration}, {{'model': {{'w': torch.full((4,), {value})}}}}, "
        f"{{'iteration': {iteration}}}, {{}}, _before_commit=die)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], cwd=REPO).returncode == -9


def test_resave_killed_between_renames_keeps_the_old_copy(tmp_path):
    _save(tmp_path, 4, 1.0)
    _kill_between_resave_renames(tmp_path, 4, 2.0)
    assert not (tmp_path / "iter_0000004").exists()  # the crash left the tracker pointing at an aside copy
    assert any(p.name.startswith(ckpt.OLD_PREFIX) for p in tmp_path.iterdir())
    loaded = ckpt.load_checkpoint_files(tmp_path)  # recovered on load
    assert loaded["path"].name == "iter_0000004" and torch.equal(loaded["payload"]["model"]["w"], torch.ones(4))


def test_next_save_after_a_killed_resave_recovers_before_sweeping(tmp_path):
    _save(tmp_path, 4, 1.0)
    _kill_between_resave_renames(tmp_path, 4, 2.0)
    _save(tmp_path, 6, 3.0)  # sweeps the debris: the aside copy of iteration 4 must come back, not be deleted
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
    (tmp_path / ckpt.TRACKER_FILE).write_text("4")
    assert torch.equal(ckpt.load_checkpoint_files(tmp_path)["payload"]["model"]["w"], torch.ones(4))


def test_user_errors_print_one_line_without_a_traceback(tmp_path):
    _save(tmp_path, 4, 1.0)
    (tmp_path / "iter_0000004" / "train_state.json").write_text("{")
    (tmp_path / "iter_0000004" / "manifest.json").unlink()  # as saved by older versions: read, not checked first
    argv = tiny_argv(load=tmp_path, train_iters=5)
    out = _pretrain_cli(*argv)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "error: " in out.stderr and "train_state.json is damaged" in out.stderr
    shown = _pretrain_cli(*argv, env={"MEGATRON_TRACEBACK": "1"})  # for debugging: the traceback is there
    assert shown.returncode != 0 and "Traceback" in shown.stderr
    # a --save folder holding newer checkpoints, without --load: refused before anything is written
    refused = _pretrain_cli(*tiny_argv(save=tmp_path, train_iters=2))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert f"error: --save {tmp_path} holds checkpoints up to iteration 4" in refused.stderr
    tool = _launch(1, ["--load", str(tmp_path / "nowhere"), "--text-file", "x"], "tools/evaluate.py")
    assert tool.returncode == 2 and "Traceback" not in tool.stderr and "nowhere" in tool.stderr
