"""`megatron.comm`'s collective guard in processes the tests start: a new interpreter that imports megatron.comm
installs it (the environment variable the session sets is inherited by torchrun, the DeepSpeed launcher and
mp.spawn workers alike)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.config import REPO


def test_spawned_workers_install_the_guard():
    code = "import torch.distributed as d, megatron.comm; print(d.barrier.megatron_collective_guard)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
