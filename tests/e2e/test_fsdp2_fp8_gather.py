"""`--fp8-param-gather` in 2 processes over gloo: FSDP2 gathers each FP8 linear's weight as the FP8 bytes cast on
the shards, with the scale the whole weight gets.

The GEMMs then see exactly the FP8 weight that gathering in high precision and casting after gives, so a run with
FP8 gathers ends bitwise where the same run with high-precision gathers ends (weights, optimizer state, losses):
- delayed scaling under --bf16 with Smooth-SwiGLU (fc2, whose weight columns are scaled per call, gathers in BF16):
  the first step casts with the whole weight's current amax (one all-reduce), later ones with the history's scale;
- tensorwise scaling in FP32, gathered parameters kept from forward to backward.
A run with FP8 gathers resumes bitwise, and its checkpoint (plain tensors, the torch engine's layout) loads into the
torch engine. tests/e2e/test_perf_comm.py counts the gathered bytes.
"""
from __future__ import annotations

import pytest

from tests.support.logs import losses
from tests.support.training import assert_same_checkpoint, launched_run, straight_and_resumed

ITERS = 6
RUN = dict(train_iters=ITERS, micro_batch_size=2, global_batch_size=8, eval_iters=1, eval_interval=ITERS,
           log_interval=1, save_interval=ITERS)
FSDP2 = ("--use-torch-fsdp2",)
GATHER = ("--fp8-param-gather",)
DELAYED_BF16 = ("--bf16", "--fp8-format", "hybrid", "--smooth-swiglu")


def _train(folder, *switches, nproc: int = 2, **overrides) -> str:
    return launched_run(folder, switches, RUN, nproc, **overrides)


def _same_run(a, b) -> None:
    assert_same_checkpoint(a, b, ITERS)


@pytest.fixture(scope="module")
def delayed_runs(tmp_path_factory):
    """High-precision gathers in root/"plain"; FP8 gathers straight in root/"straight" and resumed halfway."""
    root = tmp_path_factory.mktemp("fp8_gather")
    plain = _train(root / "plain", *FSDP2, *DELAYED_BF16)
    return root, plain, *straight_and_resumed(root, (*FSDP2, *DELAYED_BF16, *GATHER), RUN)


def test_fp8_gathers_train_bitwise_what_high_precision_gathers_train(delayed_runs):
    root, plain, gathered, _ = delayed_runs
    assert "6 gather their weight in FP8 (--fp8-param-gather)" in gathered
    assert "2 FP8 layers gather their weight in high precision" in gathered  # the two blocks' fc2
    assert losses(gathered) == losses(plain)
    _same_run(root / "straight", root / "plain")


def test_a_run_with_fp8_gathers_resumes_bit_for_bit(delayed_runs):
    root, _, gathered, resumed = delayed_runs
    assert losses(resumed) == losses(gathered)[ITERS // 2:]
    _same_run(root / "resumed", root / "straight")


def test_its_checkpoint_loads_into_the_torch_engine(delayed_runs, tmp_path):
    root, _, gathered, _ = delayed_runs
    log = _train(tmp_path / "next", *DELAYED_BF16, nproc=1, load=root / "straight", train_iters=ITERS + 2)
    assert f"iteration {ITERS}" in log and len(losses(log)) == 2
    assert all(abs(loss - losses(gathered)[-1]) < 0.5 for loss in losses(log))


def test_tensorwise_fp32_with_kept_gathers_is_bitwise_the_high_precision_gathers(tmp_path):
    switches = (*FSDP2, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--no-fsdp-reshard-after-forward")
    gathered = _train(tmp_path / "gathered", *switches, *GATHER)
    plain = _train(tmp_path / "plain", *switches)
    assert "8 gather their weight in FP8" in gathered
    assert losses(gathered) == losses(plain)
    _same_run(tmp_path / "gathered", tmp_path / "plain")
