"""Two ranks, one of which stops answering (SIGSTOP: alive and silent) before a collective on the data-parallel
group; the other prints how long the collective waited before it failed, then leaves as `run_cli` makes a rank whose
peer failed leave (one line naming the call and the suspect rank, exit code 4). Run by tests/e2e/test_hung_rank.py:
`hung_rank.py TIMEOUT_MINUTES`."""
import os
import signal
import sys
import time

import torch

from megatron import comm
from megatron.accelerator import Accelerator
from megatron.config import ParallelConfig
from megatron.errors import report_peer_failure
from megatron.parallel_state import initialize_parallel_state

state = initialize_parallel_state(ParallelConfig(distributed_timeout_minutes=float(sys.argv[1])), Accelerator("cpu"))
comm.all_reduce(torch.ones(4), state.data_parallel_group)  # both ranks answer once: the group is formed
if state.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
start = time.monotonic()
try:
    comm.all_reduce(torch.ones(4), state.data_parallel_group)
except RuntimeError as exc:
    print(f"rank {state.rank}: the collective failed after {time.monotonic() - start:.2f} s", flush=True)
    os._exit(report_peer_failure(exc))
print(f"rank {state.rank}: the collective returned", flush=True)
