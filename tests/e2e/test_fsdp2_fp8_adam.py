"""`--optimizer fp8adam` under `--use-torch-fsdp2` (gloo, 2 and 4 processes): Fp8AdamW steps each rank's rows of
every parameter (megatron/optimizer/fp8_adam_shards.py) and ends where the same optimizer on whole tensors ends.

- FP32 without clipping, FSDP2 with Fp8AdamW equals DDP with Fp8AdamW bit for bit, weights and the FP8 moments'
  codes and scales (the checkpoint holds the unsharded optimizer's state): per-tensor scales (the shards' amaxes
  max-reduced), blocks of 64 (no block straddles a shard), stochastic rounding keyed on the whole tensor's positions.
- TP=2 x FSDP2=2 with FP8 linears (FP32 weights: FSDP2's BF16 gathers under --bf16 round the weight before its FP8
  cast, where DDP casts the FP32 weight), Smooth-SwiGLU, per-tensor scales or blocks of 32 (the row-parallel
  pieces' rows are 32 long), and sharded checkpoints (each TP piece's per-tensor scale its own) equals TP=2 x DDP=2
  bit for bit, resumes bit for bit, loads at data parallel 1 and saves there DDP's full checkpoint bit for bit, and
  reshards to TP=1 as DDP's full checkpoint does.
- Sharded checkpoints (--ckpt-format torch_dist: codes shaped and sharded as their parameter, scales by rows): read
  whole they hold the values of the full checkpoint of the same run, a run resumed from them ends bitwise where the
  straight run ends, and they load at data parallel 1 bitwise.
- A checkpoint of AdamW's FP32 moments loads into FSDP2 with Fp8AdamW (converted, rank by rank) and trains on.
"""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint import store as ckpt
from megatron.checkpoint.full_state import read_full_state
from tests.support.logs import losses
from tests.support.training import assert_same_checkpoint, launched_run, straight_and_resumed

ITERS = 6
RUN = dict(train_iters=ITERS, micro_batch_size=2, global_batch_size=8, eval_iters=1, eval_interval=ITERS,
           log_interval=1, save_interval=ITERS // 2)
FP8_ADAM = ("--optimizer", "fp8adam", "--no-fp8-optimizer-compile")
FSDP2 = ("--use-torch-fsdp2",)


def _train(folder, *switches, nproc: int = 2, **overrides) -> str:
    return launched_run(folder, switches, RUN, nproc, **overrides)


@pytest.mark.parametrize("blocks", [(), ("--fp8-optimizer-block-size", "64")], ids=["per-tensor", "blocks-of-64"])
def test_fsdp2_with_fp8_adam_equals_ddp_with_fp8_adam_bit_for_bit(tmp_path, blocks):
    fsdp2 = _train(tmp_path / "fsdp2", *FSDP2, *FP8_ADAM, *blocks, clip_grad=0)
    ddp = _train(tmp_path / "ddp", *FP8_ADAM, *blocks, clip_grad=0)
    assert losses(fsdp2) == losses(ddp)
    assert_same_checkpoint(tmp_path / "fsdp2", tmp_path / "ddp", ITERS)


@pytest.mark.parametrize("blocks", [(), pytest.param(("--fp8-optimizer-block-size", "32"), marks=pytest.mark.slow)],
                         ids=["per-tensor", "blocks-of-32"])  # blockwise scales: pieces of the parameter (slow)
def test_tp2_fsdp2_with_fp8_adam_and_fp8_linears_equals_tp2_ddp_and_resumes_bitwise(tmp_path, blocks):
    switches = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--fp8-format", "hybrid",
                "--smooth-swiglu", *FP8_ADAM, *blocks)
    unclipped = dict(RUN, clip_grad=0)  # clipping sums the norm in another order under FSDP2: its last bits differ
    straight, resumed = straight_and_resumed(tmp_path, (*FSDP2, *switches, "--ckpt-format", "torch_dist"),
                                             unclipped, nproc=4)
    ddp = launched_run(tmp_path / "ddp", switches, unclipped, 4)
    assert losses(straight) == losses(ddp)
    assert losses(resumed) == losses(straight)[ITERS // 2:]
    assert_same_checkpoint(tmp_path / "resumed", tmp_path / "straight", ITERS)
    sharded = read_full_state(ckpt.iteration_dir(tmp_path / "straight", ITERS))  # TP pieces, one scale each
    whole = read_full_state(ckpt.iteration_dir(tmp_path / "ddp", ITERS))
    assert sharded.model.keys() == whole.model.keys()
    assert all(torch.equal(sharded.model[k], v) for k, v in whole.model.items())
    for name, entry in whole.optimizer["params"].items():
        assert all(torch.equal(sharded.optimizer["params"][name][m], entry[m]) for m in ("exp_avg", "exp_avg_sq"))
    # loaded in place at data parallel 1, saved at once as full checkpoints (the unsharded optimizer's state): DDP's
    launched_run(tmp_path / "dp1", (*FSDP2, *switches), unclipped, 2, load=tmp_path / "straight")
    assert_same_checkpoint(tmp_path / "dp1", tmp_path / "ddp", ITERS)
    for source in ("straight", "ddp"):  # at TP=1 through the full state: each run saves what it loaded, at once
        log = launched_run(tmp_path / f"tp1_{source}", (*FSDP2, "--fp8-format", "hybrid", "--smooth-swiglu",
                                                        *FP8_ADAM, *blocks), unclipped, 2, load=tmp_path / source)
        assert "into this run's layout (FSDP2, tensor parallel 1)" in log
    assert_same_checkpoint(tmp_path / "tp1_straight", tmp_path / "tp1_ddp", ITERS)


@pytest.mark.parametrize("blocks", [(), ("--fp8-optimizer-block-size", "64")], ids=["per-tensor", "blocks-of-64"])
def test_sharded_checkpoints_of_fp8_adam_resume_and_reshard_bitwise(tmp_path, blocks):
    switches = (*FSDP2, *FP8_ADAM, *blocks)
    full = _train(tmp_path / "full", *switches)
    straight, resumed = straight_and_resumed(tmp_path, (*switches, "--ckpt-format", "torch_dist"), RUN)
    assert losses(straight) == losses(full) and losses(resumed) == losses(straight)[ITERS // 2:]
    assert_same_checkpoint(tmp_path / "resumed", tmp_path / "straight", ITERS)
    sharded = read_full_state(ckpt.iteration_dir(tmp_path / "straight", ITERS))
    whole = read_full_state(ckpt.iteration_dir(tmp_path / "full", ITERS))
    assert all(torch.equal(sharded.model[k], v) for k, v in whole.model.items())
    for name, entry in whole.optimizer["params"].items():
        assert all(torch.equal(sharded.optimizer["params"][name][m], entry[m]) for m in ("exp_avg", "exp_avg_sq"))
    _train(tmp_path / "one", *switches, "--ckpt-format", "torch_dist", nproc=1, load=tmp_path / "straight")
    assert_same_checkpoint(tmp_path / "one", tmp_path / "straight", ITERS)


def test_an_adamw_checkpoint_loads_into_fsdp2_with_fp8_adam(tmp_path):
    adamw = _train(tmp_path / "adamw", *FSDP2)
    log = _train(tmp_path / "fp8", *FSDP2, *FP8_ADAM, load=tmp_path / "adamw", train_iters=ITERS + 2)
    assert "optimizer adam -> fp8adam" in log
    assert len(losses(log)) == 2 and all(abs(loss - losses(adamw)[-1]) < 0.5 for loss in losses(log))
