"""Smooth-SwiGLU under tensor parallelism: the token form's scales max-reduced over the TP group, 2 gloo processes
(torch.multiprocessing spawn, a TCP port)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron.model.smooth_swiglu import pow2_scales, token_maxima
from tests.support import forkserver
from tests.support.launch import free_port
from tests.support.processes import init_gloo


# ----------------------------------------------------------------------------- tensor parallel
def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, port, 2)
    try:
        torch.manual_seed(0)
        up = torch.randn(3, 5, 64) * torch.logspace(-1, 1, 64)  # the full [b, s, F] on every rank
        shard = up.chunk(2, dim=-1)[rank]  # this rank's FFN channels (column-parallel fc1)
        torch.save({"local": token_maxima(shard), "reduced": token_maxima(shard, dist.group.WORLD),
                    "full": token_maxima(up)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_token_scales_max_reduced_over_tp_group_match_one_rank(tmp_path):
    forkserver.spawn(_tp_worker, (free_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert torch.equal(r["reduced"], r["full"])
        assert torch.equal(pow2_scales(r["reduced"])[0], pow2_scales(r["full"])[0])
    assert not torch.equal(ranks[0]["local"], ranks[1]["local"])  # without the reduction ranks disagree
