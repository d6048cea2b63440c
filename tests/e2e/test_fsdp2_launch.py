"""`--use-torch-fsdp2` in 2 processes over gloo: PyTorch's FSDP2 shards each block and the root over the
data-parallel ranks, and trains what DDP trains.

- FP32 without clipping, FSDP2 equals DDP bit for bit (weights, optimizer state): with 2 ranks both average a
  gradient as (a + b) / 2 (addition commutes; halving is exact), and AdamW is elementwise on the shards.
- With clipping, the norm is summed shard by shard instead of tensor by tensor: the clip coefficient may differ in
  its last bits, each step's weight update by a rounding of the weight, so after n steps no weight differs by more
  than n ulps of the largest weight (slow).
- FP8 (hybrid, Smooth-SwiGLU, BF16 gather, BF16 gradient reduction, parameters kept gathered from forward to
  backward, full activation recompute): a run resumed from its checkpoint ends bitwise where the straight run
  ends; the checkpoint, written in the torch engine's layout, loads into one FSDP2 rank and into the torch engine,
  which train on.
- `--torch-compile on` under FSDP2 (blocks compiled with their FP8 layers traced in) tracks the eager run.
- FSDP2's FP8 loss curve stays within BF16-and-FP8 DDP's seed-to-seed spread (slow).
"""
from __future__ import annotations

import re

import pytest
import torch

from tests.support.logs import losses
from tests.support.training import assert_same_checkpoint, checkpoint_tensors, launched_run, straight_and_resumed

ITERS = 6
RUN = dict(train_iters=ITERS, micro_batch_size=2, global_batch_size=8, eval_iters=1, eval_interval=ITERS,
           log_interval=1, save_interval=ITERS)
FSDP2 = ("--use-torch-fsdp2",)
FP8 = ("--bf16", "--fp8-format", "hybrid", "--smooth-swiglu")


KEPT_RECOMPUTED = (*FSDP2, *FP8, "--no-fsdp-reshard-after-forward", "--grad-reduce-in-bf16",
                  "--recompute-granularity", "full", "--recompute-method", "uniform")


def _train(folder, *switches, nproc: int = 2, **overrides) -> str:
    return launched_run(folder, switches, RUN, nproc, **overrides)


def test_fp32_fsdp2_equals_ddp_bit_for_bit(tmp_path):
    fsdp, ddp = tmp_path / "fsdp2", tmp_path / "ddp"
    log = _train(fsdp, *FSDP2, clip_grad=0)
    assert "FSDP2: 2 blocks and the root sharded over 2 data-parallel ranks" in log
    _train(ddp, clip_grad=0)
    assert_same_checkpoint(fsdp, ddp, ITERS)


@pytest.mark.slow
def test_fp32_fsdp2_with_clipping_is_within_a_rounding_per_step_of_ddp(tmp_path):
    fsdp, ddp = tmp_path / "fsdp2", tmp_path / "ddp"
    _train(fsdp, *FSDP2)
    _train(ddp)
    got, want = checkpoint_tensors(fsdp, ITERS), checkpoint_tensors(ddp, ITERS)
    weights = {k: v for k, v in want.items() if "/model/" in k}
    largest = max(float(v.abs().max()) for v in weights.values())
    ulp = torch.finfo(torch.float32).eps * 2.0 ** torch.tensor(largest).log2().ceil().item()
    worst = max(float((got[k].double() - v.double()).abs().max()) for k, v in weights.items())
    assert worst <= ITERS * ulp, (worst, ITERS * ulp)


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    """FSDP2 with FP8, straight to ITERS and stopped at ITERS // 2 then resumed."""
    root = tmp_path_factory.mktemp("fsdp2_fp8")
    return root, *straight_and_resumed(root, KEPT_RECOMPUTED, RUN)


def test_an_fp8_run_resumes_bit_for_bit(fp8_runs):
    root, straight, resumed = fp8_runs
    assert "8 FP8 layers cast their gathered weight per call" in straight
    assert losses(resumed) == losses(straight)[ITERS // 2:]
    assert_same_checkpoint(root / "resumed", root / "straight", ITERS)


def test_compiled_blocks_under_fsdp2_track_the_eager_run(fp8_runs, tmp_path):
    """`--torch-compile on` under FSDP2: the same graphs for both blocks, the FP8 layers traced into them (their
    gathered weight cast in the graph, per call), FSDP2's gather and reduce-scatter hooks run eagerly around them.
    Within 1e-3 of the eager run's losses (a lost reduce-scatter or a stale weight moves them by far more; the
    compiled block's fused roundings by ~1e-6)."""
    root, straight, _ = fp8_runs
    # No evaluation: the compared losses are the training ones, and evaluation's no-grad graphs would compile too.
    log = _train(tmp_path / "compiled", *KEPT_RECOMPUTED, "--torch-compile", "on", eval_iters=0)
    # Two graphs: the first step's and every later one's (delayed scaling's history holds a scale from then on).
    assert re.search(r"torch.compile: 2 transformer blocks \(2 graphs for all\)", log), log[-2000:]
    assert "tracing the FP8 layers into the transformer blocks failed" not in log
    compiled, eager = losses(log), losses(straight)
    assert len(compiled) == len(eager) == ITERS
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager)) < 1e-3, (compiled, eager)


@pytest.mark.parametrize("engine", [FSDP2, ()], ids=["fsdp2-1-rank", "torch-engine"])
def test_the_checkpoint_loads_on_one_rank_and_into_the_torch_engine(fp8_runs, tmp_path, engine):
    root, straight, _ = fp8_runs
    log = _train(tmp_path / "next", *engine, *FP8, nproc=1, load=root / "straight", train_iters=ITERS + 2)
    assert f"iteration {ITERS}" in log and len(losses(log)) == 2
    assert all(abs(loss - losses(straight)[-1]) < 0.5 for loss in losses(log))  # trains on from there


@pytest.mark.slow
def test_the_fp8_loss_curve_is_within_ddps_seed_to_seed_spread(tmp_path):
    fsdp = losses(_train(tmp_path / "fsdp2", *FSDP2, *FP8))
    ddp = losses(_train(tmp_path / "ddp", *FP8))
    other_seed = losses(_train(tmp_path / "ddp_seed", *FP8, seed=4321))
    spread = max(abs(a - b) for a, b in zip(ddp, other_seed))
    assert max(abs(a - b) for a, b in zip(fsdp, ddp)) <= spread
