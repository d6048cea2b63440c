"""The training loop's signal handling: `pretrain_gpt.py --exit-signal-handler` saves and exits cleanly on SIGTERM."""
import signal
import subprocess
import sys

from tests.support.config import REPO, tiny_argv


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    argv = tiny_argv("--exit-signal-handler", train_iters=100000, log_interval=1, eval_iters=0,
                     save=tmp_path / "c")
    proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration        3/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines) + out
    saved = int((tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 100000
    assert (tmp_path / "c" / f"iter_{saved:07d}" / "train_state.json").exists()
