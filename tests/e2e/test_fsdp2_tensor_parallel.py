"""`--use-torch-fsdp2` with `--tensor-model-parallel-size 2` in 4 processes over gloo: FSDP2 shards each tensor-parallel
rank's pieces over its data-parallel group (a 2-D layout: dp x tp).

- FP32 without clipping, with sequence parallelism: TP=2 x FSDP2=2 equals TP=2 x DDP=2 bit for bit (the same
  tensor-parallel arithmetic; FSDP2 and DDP both average a gradient over 2 ranks as (a + b) / 2).
- FP8 (delayed scaling, BF16, sequence parallelism, clipping on): gathering each weight in FP8 trains bitwise what
  gathering in BF16 trains (the clip norm counts every tensor-parallel piece once, the FP8-gathered weights
  included); its sharded checkpoint (--ckpt-format torch_dist: every rank's shards as pieces of the global
  tensors) read whole holds the bits of the full checkpoint (one file per TP rank) of the BF16-gathered run, and a
  run resumed from it ends bitwise where the straight run ends.
- Resharding: the sharded TP=2 checkpoint loads at data parallel 1 (DCP reads the overlapping pieces) bitwise, and
  into FSDP2 at TP=1 through the full state; a TP=1 DDP checkpoint loads into TP=2 x FSDP2. Loaded and saved at
  once, each holds the bits the torch engine holds after the same load.
- `--async-save` under tensor parallelism writes bitwise what the synchronous save writes.
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
TP2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
FSDP2 = ("--use-torch-fsdp2",)
FP8 = ("--bf16", "--fp8-format", "hybrid")
SHARDED = ("--fp8-param-gather", "--ckpt-format", "torch_dist")


def _train(folder, *switches, nproc: int = 4, **overrides) -> str:
    return launched_run(folder, switches, RUN, nproc, **overrides)


def test_fp32_tp2_fsdp2_equals_tp2_ddp_bit_for_bit(tmp_path):
    log = _train(tmp_path / "fsdp2", *TP2, *FSDP2, clip_grad=0)
    assert "sharded over 2 data-parallel ranks (of each of 2 tensor-parallel ranks' pieces)" in log
    ddp = _train(tmp_path / "ddp", *TP2, clip_grad=0)
    assert losses(log) == losses(ddp)
    assert_same_checkpoint(tmp_path / "fsdp2", tmp_path / "ddp", ITERS)


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    """BF16 gathers and full checkpoints in root/"plain"; FP8 gathers and sharded checkpoints straight in
    root/"straight" and resumed halfway."""
    root = tmp_path_factory.mktemp("tp_fsdp2_fp8")
    plain = _train(root / "plain", *TP2, *FSDP2, *FP8)
    return root, plain, *straight_and_resumed(root, (*TP2, *FSDP2, *FP8, *SHARDED), RUN, nproc=4)


def test_fp8_gathers_under_tensor_parallelism_train_bitwise_what_bf16_gathers_train(fp8_runs):
    root, plain, straight, _ = fp8_runs
    assert "8 gather their weight in FP8 (--fp8-param-gather)" in straight
    assert losses(straight) == losses(plain)
    sharded = read_full_state(ckpt.iteration_dir(root / "straight", ITERS))
    full = read_full_state(ckpt.iteration_dir(root / "plain", ITERS))
    assert sharded.layout == "torch_dist" and full.layout == "tensor_parallel"
    assert sharded.model.keys() == full.model.keys()
    assert all(torch.equal(sharded.model[k], v) for k, v in full.model.items())
    for name, entry in full.optimizer["params"].items():
        assert all(torch.equal(sharded.optimizer["params"][name][m], entry[m]) for m in ("exp_avg", "exp_avg_sq"))
        assert sharded.optimizer["params"][name]["step"] == entry["step"]


def test_a_tp2_fsdp2_run_resumes_bit_for_bit(fp8_runs):
    root, _, straight, resumed = fp8_runs
    assert losses(resumed) == losses(straight)[ITERS // 2:]
    assert_same_checkpoint(root / "resumed", root / "straight", ITERS)


def test_its_sharded_checkpoint_loads_at_data_parallel_1_bitwise(fp8_runs, tmp_path):
    root, _, _, _ = fp8_runs
    log = _train(tmp_path / "dp1", *TP2, *FSDP2, *FP8, *SHARDED, nproc=2, load=root / "straight")
    assert f"loaded checkpoint {ckpt.iteration_dir(root / 'straight', ITERS)}" in log
    assert_same_checkpoint(tmp_path / "dp1", root / "straight", ITERS)


def test_its_checkpoint_reshards_to_tp1_as_the_torch_engine_reshards_it(fp8_runs, tmp_path):
    root, _, _, _ = fp8_runs
    log = _train(tmp_path / "fsdp2", *FSDP2, *FP8, nproc=2, load=root / "straight")  # saves what it loaded, at once
    assert "into this run's layout (FSDP2, tensor parallel 1)" in log
    _train(tmp_path / "torch", *FP8, nproc=1, load=root / "straight")
    assert_same_checkpoint(tmp_path / "fsdp2", tmp_path / "torch", ITERS)


def test_a_tp1_ddp_checkpoint_reshards_into_tp2_fsdp2_as_into_tp2_ddp(tmp_path):
    _train(tmp_path / "ddp", *FP8, nproc=2)
    log = _train(tmp_path / "fsdp2", *TP2, *FSDP2, *FP8, load=tmp_path / "ddp")
    assert "into this run's layout (FSDP2, tensor parallel 2)" in log
    _train(tmp_path / "tp2_ddp", *TP2, *FP8, load=tmp_path / "ddp")
    assert_same_checkpoint(tmp_path / "fsdp2", tmp_path / "tp2_ddp", ITERS)


def test_an_async_save_under_tensor_parallelism_writes_what_the_synchronous_one_writes(fp8_runs, tmp_path):
    root, _, straight, _ = fp8_runs
    log = _train(tmp_path / "async", *TP2, *FSDP2, *FP8, *SHARDED, "--async-save")
    assert "written in the background (--async-save)" in log and losses(log) == losses(straight)
    for iteration in (ITERS // 2, ITERS):
        assert_same_checkpoint(tmp_path / "async", root / "straight", iteration)
