"""Fine-grained FP8 recipes (rowwise, blockwise, mxfp8) under tensor parallelism: TP=2 tracks TP=1 per
recipe, 2 gloo processes (torch.multiprocessing spawn, a TCP port)."""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from megatron.arguments import parse_config
from megatron.config import ParallelConfig
from tests.support import forkserver
from tests.support.config import tiny_argv
from tests.support.flags import FINE_RECIPES as FINE
from tests.support.launch import free_port
from tests.support.processes import init_gloo
from tests.support.run_noise import NOISE_FACTOR
from tests.support.tensor_parallel import errors, train_side_by_side


# ------------------------------------------------------------------------------------ TP=2 against TP=1
# Sizes whose TP=2 pieces hold whole 128-tiles (queries, keys/values and FFN channels of 128 per rank).
TP_SIZES = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, ffn_hidden_size=256,
                tensor_model_parallel_size=2, fp8_format="hybrid")


def _tp_case(parallel, scaling: str) -> dict:
    from megatron.fp8 import convert_to_fp8
    from megatron.model import GPTModel
    from megatron.parallel import parallelize_tensor

    cfg = parse_config(tiny_argv(fp8_recipe=scaling, **TP_SIZES), world_size=2)
    torch.manual_seed(1234)
    base = GPTModel(cfg.model)
    exact = copy.deepcopy(base)  # no FP8: the recipe's own FP8 error is measured against it
    tp = parallelize_tensor(copy.deepcopy(base), parallel, False)
    convert_to_fp8(base, cfg.fp8, amax_group=parallel.data_parallel_group)
    convert_to_fp8(tp, cfg.fp8, amax_group=parallel.amax_group)
    traces = train_side_by_side(parallel, cfg, {"ref": base, "tp": tp, "exact": exact}, {"tp"},
                                {"ref": False, "tp": False, "exact": False}, steps=3)
    return {"tp": errors(traces["tp"], traces["ref"]), "fp8": errors(traces["ref"], traces["exact"])}


def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    from megatron.accelerator import get_accelerator
    from megatron.parallel_state import initialize_parallel_state

    torch.set_num_threads(1)
    init_gloo(rank, port, 2)
    parallel = initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=2), get_accelerator("cpu"))
    results = {scaling: _tp_case(parallel, scaling) for scaling in FINE}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_tp2_tracks_tp1_per_recipe(tmp_path):
    """TP=2 against TP=1 (same weights and batches, 3 steps) within the recipe's own FP8-vs-FP32 difference:
    final weights and logits strictly, per-step losses within NOISE_FACTOR of it (two roundings of the same
    kind, which one is larger is chance: tests/support/run_noise.py). Blockwise and MXFP8 tiles fall on the same
    elements at TP=2 (validated sizes), so TP changes only fp32 summation orders, which move FP8 roundings
    where a value sits at a rounding boundary (and, with fp32 scales, a tile's scale by an ulp); rowwise scales
    of the row-parallel GEMMs cover the local half of K (no collective), a real but smaller change than FP8."""
    forkserver.spawn(_tp_worker, (free_port(), str(tmp_path)), 2)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results.keys() == set(FINE)
        for scaling, r in results.items():
            for quantity in ("weights_all", "logits"):
                assert r["tp"][quantity] < r["fp8"][quantity], (rank, scaling, quantity, r)
            assert max(r["tp"]["loss"]) < NOISE_FACTOR * max(r["fp8"]["loss"]), (rank, scaling, r)
