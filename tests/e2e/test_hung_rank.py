"""A rank that stops answering is detected within `--distributed-timeout-minutes` on every group we make (a group
created without the timeout waited for a stopped peer without end on gloo)."""
from __future__ import annotations

import re

from tests.support.launch import launch

TIMEOUT_MINUTES = 0.05  # 3 s


def test_a_stopped_rank_fails_the_others_collective_within_the_timeout():
    out = launch(2, [str(TIMEOUT_MINUTES)], script="tests/support/hung_rank.py", timeout=120)
    waited = re.search(r"rank 0: the collective failed after ([\d.]+) s", out.stdout)
    assert out.returncode != 0 and waited, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    # gloo's timeout starts when the collective is issued: it fails no earlier than that, and far before the
    # launch's limit (a group without the timeout would wait the default 10 minutes, or forever)
    assert 0.9 * TIMEOUT_MINUTES * 60 <= float(waited.group(1)) < 60
    # it leaves with one line naming the call and the rank whose heartbeat stopped
    lines = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] error: torch.distributed.all_reduce failed because "
                                                   "another rank died or stopped answering: rank 1 stopped answering "
                                                   "(no heartbeat for 2 s)"), out.stderr[-2000:]
