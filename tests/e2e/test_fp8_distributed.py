"""The batched amax all-reduce of `fp8_optimizer_step`, on 2 gloo processes."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron.fp8 import Fp8Linear, Fp8Recipe, convert_to_fp8, fp8_optimizer_step
from tests.support import forkserver
from tests.support.fp8_reference import TinyGPT
from tests.support.launch import free_port
from tests.support.processes import init_gloo

WORLD = 2


def _amaxes(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([m.fp8_step_amax.clone() for m in model.modules() if isinstance(m, Fp8Linear)])


def _worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, port, WORLD)
    try:
        torch.manual_seed(0)  # same weights on both ranks (data parallel)
        model = TinyGPT()
        convert_to_fp8(model, Fp8Recipe(amax_history_len=2), amax_group=dist.group.WORLD)
        # Rank-dependent data: the amaxes of inputs and gradients differ between ranks.
        torch.manual_seed(100 + rank)
        tokens = torch.randint(0, 128, (2, 16))
        model(tokens).float().square().mean().mul(10.0 ** rank).backward()
        local = _amaxes(model)
        calls = []
        original = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(tuple(tensor.shape))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        try:
            fp8_optimizer_step(model)
        finally:
            dist.all_reduce = original
        histories = torch.stack([m.fp8_amax_history[:, 0].clone() for m in model.modules()
                                 if isinstance(m, Fp8Linear)])
        scales = torch.stack([m.fp8_scale.clone() for m in model.modules() if isinstance(m, Fp8Linear)])
        torch.save({"local": local, "history": histories, "scales": scales, "calls": calls},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_one_batched_all_reduce_gives_every_rank_the_max(tmp_path: os.PathLike) -> None:
    forkserver.spawn(_worker, (free_port(), str(tmp_path)), WORLD)
    r0, r1 = (torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(WORLD))
    assert r0["calls"] == [(8, 3)] and r1["calls"] == [(8, 3)]  # ONE all-reduce of [n_modules, 3 roles]
    assert not torch.equal(r0["local"], r1["local"])  # the ranks really saw different amaxes
    expected = torch.maximum(r0["local"], r1["local"])
    assert torch.equal(r0["history"], expected) and torch.equal(r1["history"], expected)
    assert torch.equal(r0["scales"], r1["scales"])  # hence identical scales on both ranks
