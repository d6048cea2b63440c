"""`pretrain_gpt.py` with every collective counted: `python tests/support/count_collectives.py OUT -- <flags>`.

Each rank writes OUT.rank<r>.json: per training iteration, per collective, the calls and the bytes one device moves
over the wire with ring algorithms (megatron/perf/comm.py's convention): all-reduce of B bytes 2 (n-1)/n B,
all-gather producing B and reduce-scatter consuming B (n-1)/n B, send or receive of B: B, broadcast (n-1)/n B.
Counted: torch.distributed's Python collectives (megatron.comm, DeepSpeed, torch's FSDP2: its `*_single` forms),
and DDP's gradient buckets, which a comm hook (DDP's default all-reduce, written in Python) sends through
torch.distributed.all_reduce instead of the C++ reducer's direct call. Collectives outside an iteration (startup,
checkpointing, evaluation) are filed under iteration null.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

_COUNTS: dict[Optional[int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
_ITERATION: list[Optional[int]] = [None]


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def record(op: str, group: Any, nbytes: int) -> None:
    from megatron.perf.comm import ring_factor

    entry = _COUNTS[_ITERATION[0]][op]
    entry[0] += 1
    entry[1] += ring_factor(op, _group_size(group)) * nbytes


# name -> (op, index of the tensor argument that has the collective's full size)
_COLLECTIVES = {
    "all_reduce": ("all-reduce", 0), "all_gather": ("all-gather", 0), "all_gather_into_tensor": ("all-gather", 0),
    "all_gather_single": ("all-gather", 0),
    "reduce_scatter": ("reduce-scatter", 1), "reduce_scatter_tensor": ("reduce-scatter", 1),
    "reduce_scatter_single": ("reduce-scatter", 1),
    "broadcast": ("broadcast", 0), "send": ("send", 0), "recv": ("recv", 0), "isend": ("send", 0),
    "irecv": ("recv", 0),
}


def _counted(op: str, full: int, fn: Any) -> Any:
    import inspect

    params = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(params, args), **kwargs)
        record(op, bound.get("group"), _nbytes(bound[params[full]]))
        return fn(*args, **kwargs)

    return call


def _count_ddp_buckets() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    init = torch.nn.parallel.DistributedDataParallel.__init__

    def counting_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # DDP's default reduction in Python: its all-reduce is torch.distributed.all_reduce, counted there
        return default_hooks.allreduce_hook(group, bucket)

    # DDP checks the hook's annotations as objects (this module's are strings: `from __future__ import annotations`)
    counting_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, counting_hook)

    torch.nn.parallel.DistributedDataParallel.__init__ = patched


def _mark_iterations() -> None:
    from megatron.training.loop import Trainer

    step = Trainer.train_step

    def train_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        _ITERATION[0] = self.state.iteration
        try:
            return step(self, *args, **kwargs)
        finally:
            _ITERATION[0] = None

    Trainer.train_step = train_step


def install() -> None:
    import megatron.comm  # noqa: F401 - its collective guard first; the counters wrap it

    for name, (op, full) in _COLLECTIVES.items():
        setattr(dist, name, _counted(op, full, getattr(dist, name)))
    _count_ddp_buckets()
    _mark_iterations()


def main() -> None:
    from tests.support import pretrain_main

    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    install()

    def write(_code: int) -> None:
        rank = os.environ.get("RANK", "0")
        Path(f"{out}.rank{rank}.json").write_text(json.dumps({str(k): v for k, v in _COUNTS.items()}))

    pretrain_main.run(argv, write)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
