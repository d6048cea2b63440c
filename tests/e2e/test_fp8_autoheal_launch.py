"""`--fp8-autoheal` across ranks: the clipped fractions are max-reduced over the ranks that hold the same layers, so
the two tensor-parallel ranks (each quantizing its own shard) raise the same margins at the same iterations."""
from __future__ import annotations

from megatron.checkpoint import store as ckpt
from tests.support.config import tiny_argv
from tests.support.launch import launch_checked

ACTING = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1", "--fp8-amax-compute-algo", "most_recent",
          "--fp8-autoheal", "--fp8-autoheal-clip-threshold", "1e-6", "--fp8-autoheal-patience", "1")


def test_tensor_parallel_ranks_take_the_same_decisions(tmp_path):
    argv = tiny_argv(*ACTING, "--tensor-model-parallel-size", "2", save=tmp_path, train_iters=6, save_interval=6,
                     log_interval=1, eval_iters=0)
    launch_checked(2, argv, stdout_tail=0, stderr_tail=3000)
    margins = []
    for rank in (0, 1):
        fp8 = ckpt.load_checkpoint_files(tmp_path, mp_rank=rank)["payload"]["fp8"]
        margins.append({name: entry.get("extra_margin") for name, entry in fp8["layers"].items()})
        assert fp8["autoheal"]["actions"] > 0, rank
    assert margins[0] == margins[1] and any(margins[0].values())
