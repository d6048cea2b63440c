"""`--ckpt-format torch_dist` under FSDP2, 2 processes over gloo: each rank writes its shards through
torch.distributed.checkpoint into our folder layout (megatron/checkpoint/dcp_io.py).

- A run stopped halfway and resumed from its sharded checkpoint ends bitwise where the straight run ends (every
  saved key: weights, Adam's moments and steps, FP8 scaling state, RNG).
- Resharded: loaded into FSDP2 on one rank and saved again at once, the checkpoint holds the same bits.
- A bit flipped in a shard file of the newest checkpoint: both ranks fall back to the one before it and the run ends
  bitwise where the straight run ends. A checkpoint of another model size is refused with an error naming the
  mismatched parameters.
- Every other reader takes it whole: the torch and DeepSpeed engines (one rank) resume from it and train on, and the
  Hugging Face export reads its weights (tests/e2e/test_checkpoint_layouts.py: under TP=2, exported and evaluated
  alike with every other layout).
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from megatron.checkpoint import store as ckpt
from tests.support.config import tiny_argv
from tests.support.launch import REPO, launch
from tests.support.logs import losses
from tests.support.training import assert_same_checkpoint, checkpoint_tensors, launched_run, straight_and_resumed

ITERS = 6
RUN = dict(train_iters=ITERS, micro_batch_size=2, global_batch_size=8, eval_iters=1, eval_interval=ITERS,
           log_interval=1, save_interval=ITERS // 2)
SHARDED = ("--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--bf16", "--fp8-format", "hybrid",
           "--fp8-param-gather")


def _train(folder, *switches, nproc: int = 2, **overrides) -> str:
    return launched_run(folder, switches, RUN, nproc, **overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return root, *straight_and_resumed(root, SHARDED, RUN)


def test_each_rank_writes_its_shards_and_a_resume_is_bitwise(runs):
    root, straight, resumed = runs
    final = root / "straight" / f"iter_{ITERS:07d}"
    assert sorted(p.name for p in (final / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (final / "mp_rank_00").exists()
    assert losses(resumed) == losses(straight)[ITERS // 2:]
    assert_same_checkpoint(root / "resumed", root / "straight", ITERS)


def test_it_reshards_to_one_rank_bitwise(runs, tmp_path):
    root, _, _ = runs
    log = _train(tmp_path / "one", *SHARDED, nproc=1, load=root / "straight")
    assert f"loaded checkpoint {root / 'straight' / f'iter_{ITERS:07d}'}" in log
    assert_same_checkpoint(tmp_path / "one", root / "straight", ITERS)


def test_a_damaged_shard_of_the_newest_checkpoint_falls_back_and_ends_bitwise(runs, tmp_path):
    root, straight, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "straight", run)
    damaged = ckpt.iteration_dir(run, ITERS) / "dcp" / "__1_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # the disk flipped one bit of rank 1's shards in the newest checkpoint
    damaged.write_bytes(bytes(data))
    log = _train(run, *SHARDED, load=run)
    assert f"{damaged} fails its checksum" in log, log[-3000:]
    assert f"resuming from iteration {ITERS // 2}, the newest checkpoint" in log, log[-3000:]
    assert losses(log) == losses(straight)[ITERS // 2:]
    assert_same_checkpoint(run, root / "straight", ITERS)


def test_a_checkpoint_of_another_model_size_is_refused_naming_the_parameters(runs, tmp_path):
    root, _, _ = runs
    out = launch(1, tiny_argv(*SHARDED, **{**RUN, "load": root / "straight", "save": tmp_path / "x",
                                           "hidden_size": 32}))
    assert out.returncode != 0
    assert "does not match the model built from the current flags" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_the_torch_engine_resumes_from_it(runs, tmp_path):
    root, straight, _ = runs
    torch_engine = ("--bf16", "--fp8-format", "hybrid")
    log = _train(tmp_path / "on", *torch_engine, nproc=1, load=root / "straight", train_iters=ITERS + 2)
    assert f"iteration {ITERS}" in log and len(losses(log)) == 2
    assert all(abs(loss - losses(straight)[-1]) < 0.5 for loss in losses(log))
    _train(tmp_path / "torch", *torch_engine, nproc=1, load=root / "straight")  # saves what it loaded, at once
    saved = checkpoint_tensors(tmp_path / "torch", ITERS)
    sharded = checkpoint_tensors(root / "straight", ITERS)
    for key, value in saved.items():
        if key.startswith("mp_rank_00/model_optim_rng.pt/model/"):
            assert torch.equal(value, sharded["dcp/model/" + key.rsplit("/model/", 1)[1]]), key


def test_the_deepspeed_engine_resumes_from_it(runs, tmp_path):
    pytest.importorskip("deepspeed")
    root, straight, _ = runs
    log = _train(tmp_path / "ds", "--deepspeed", "--zero-stage", "1", "--bf16", "--fp8-format", "hybrid", nproc=1,
                 load=root / "straight", train_iters=ITERS + 2)
    assert "into this run's layout" in log and len(losses(log)) == 2
    assert all(abs(loss - losses(straight)[-1]) < 0.5 for loss in losses(log))


def test_the_hugging_face_export_reads_it(runs, tmp_path):
    root, _, _ = runs
    out = subprocess.run([sys.executable, "tools/convert_to_hf.py", "--load", str(root / "straight"), "--no-tokenizer",
                          "--output", str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert any((tmp_path / "hf").glob("*.safetensors"))


def test_an_async_save_writes_bitwise_what_a_synchronous_one_writes(runs, tmp_path):
    root, straight, _ = runs
    log = _train(tmp_path / "async", *SHARDED, "--async-save")
    assert "written in the background (--async-save)" in log and "committed" in log
    assert losses(log) == losses(straight)
    for iteration in (ITERS // 2, ITERS):
        assert_same_checkpoint(tmp_path / "async", root / "straight", iteration)
    assert (tmp_path / "async" / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
