"""Tensor parallelism under DeepSpeed (gloo on CPU): ZeRO 0/1/2 and the pipeline equal the torch engine's TP runs,
resume exactly, and their checkpoints merge to full models that evaluate to the runs' own validation losses.

Every run is a `pretrain_gpt.py` subprocess on indexed data (4 iterations of 8 samples, validation at 2 and 4).
The reference is TP = 2 on the torch engine (TorchEngine: DDP-free at DP = 1, our clipping and sequence-parallel
reduction). DeepSpeed adds the same fp32 numbers in other orders (its ZeRO norm and clipping code, the sequence-
parallel gradients summed per micro-batch in backward hooks instead of once per step, the data-parallel
reduction at DP = 2, the pipeline's stage boundaries), so the runs differ by rounding that the steps amplify,
bounded by the reference's own noise (tests/support/run_noise.py): a control run of the same math in another order.
What this catches is orders of magnitude larger: a replicated norm counted twice in the gradient norm (clipping is
active), sequence-parallel gradients left partial, ZeRO partitioning over the TP ranks, DeepSpeed's pipeline
splitting sequence-parallel activations over TP ranks that hold different tokens.

Without ZeRO and without sequence parallelism DeepSpeed runs the very operations of the torch engine (the
optimizer steps the parameters themselves, we clip with the same function): equal bit for bit, FP8 and Fp8AdamW
included.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from megatron.checkpoint.configs import model_config_from_dict
from megatron.checkpoint.layouts import read_checkpoint, resolve_checkpoint_dir
from megatron.parallel.layout import shard_state_dict
from tests.support.config import load_tool
from tests.support.data import data_argv, write_indexed
from tests.support.flags import DEEPSPEED_TP_RUN as BASE, PP2, SP, TP2
from tests.support.launch import launch_checked
from tests.support.logs import values
from tests.support.run_noise import assert_losses_within_noise, assert_weights_within_noise, printed_unit

pytest.importorskip("deepspeed")

ZERO1 = ("--deepspeed", "--zero-stage", "1")
# FP8 linears and Fp8AdamW with deterministic moment rounding: stochastic rounding draws from one stream per
# tensor on the torch engine and per flattened ZeRO partition under DeepSpeed, a difference of another kind.
# Fp8AdamW eager (compiling costs seconds per process, ~40% of this test's time): its compiled kernel runs under
# TP here in test_zero0_tp2_fp8_fp8adam_is_the_torch_engine_bit_for_bit, under ZeRO-1 in test_deepspeed_launch.py.
FP8 = ("--fp8-format", "hybrid", "--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128",
       "--no-fp8-optimizer-stochastic-rounding", "--no-fp8-optimizer-compile")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return write_indexed(root / "train", 120, seed=0), write_indexed(root / "valid", 30, seed=1)


class Runs:
    """Runs `pretrain_gpt.py` on the module's data; each result is (training + validation losses, save dir, log)."""

    def __init__(self, data, root) -> None:
        self.data, self.root = data, root

    def __call__(self, name: str, nproc: int, *switches: str, **overrides):
        save = self.root / name
        argv = data_argv(*self.data, **{**BASE, "save": str(save), **overrides}) + list(switches)
        out = launch_checked(nproc, argv)
        return values(out.stderr), save, out.stderr


def merged_weights(save) -> dict:
    """The full-model state dict of the newest checkpoint under `save`, through the one checkpoint reader."""
    payload, _, _ = read_checkpoint(resolve_checkpoint_dir(save))
    return payload["model"]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    return Runs(data, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def reference(runs):
    """Torch engine, TP = 2 with sequence parallelism, 2 processes: 4 micro-batches of 2 per step."""
    return runs("torch_tp2", 2, *TP2, *SP)


@pytest.fixture(scope="module")
def control(runs):
    """The reference's noise: the same run with micro-batches of 1 and 8 accumulation steps."""
    return runs("torch_tp2_mbs1", 2, *TP2, *SP, micro_batch_size=1)


@pytest.fixture(scope="module")
def zero1(runs):
    """DeepSpeed ZeRO-1, TP = 2 x DP = 2 with sequence parallelism (4 processes), a checkpoint at 2 and at 4."""
    return runs("zero1_tp2_dp2", 4, *TP2, *SP, *ZERO1, save_interval=2)


@pytest.fixture(scope="module")
def pipeline(runs):
    """DeepSpeed pipeline, TP = 2 x PP = 2 with sequence parallelism (4 processes), a checkpoint at 2 and at 4."""
    return runs("zero1_tp2_pp2", 4, *TP2, *PP2, *SP, *ZERO1, save_interval=2)


def resume_from_iteration_2(runs, straight, name: str, nproc: int, *switches: str) -> list[float]:
    """Resume a copy of `straight`'s iteration-2 checkpoint; its values (train 3-4, valid@4)."""
    _, save, _ = straight
    copy = runs.root / name
    shutil.copytree(save / "iter_0000002", copy / "iter_0000002")
    (copy / "latest_checkpointed_iteration.txt").write_text("2")
    (copy / "latest").write_text("iter_0000002")
    resumed, _, _ = runs(name, nproc, *switches, load=str(copy))
    return resumed


# ------------------------------------------------------------------------------------------- equivalence
@pytest.mark.isa_sensitive
def test_zero1_tp2_dp2_equals_the_torch_engine(reference, control, zero1):
    assert len(zero1[0]) == 6  # train 1-4, valid@2, valid@4
    assert_losses_within_noise(zero1[0], reference[0], control[0])
    assert_weights_within_noise(merged_weights(zero1[1]), merged_weights(reference[1]), merged_weights(control[1]))
    # ZeRO partitions over the data-parallel group only: one optimizer file per (DP rank, TP rank).
    names = {p.name for p in (zero1[1] / "iter_0000004").iterdir()}
    assert {f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in range(2) for t in range(2)} <= names
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= names


@pytest.mark.isa_sensitive
def test_zero2_tp2_dp2_equals_the_torch_engine(runs, reference, control):
    tested, save, _ = runs("zero2_tp2_dp2", 4, *TP2, *SP, "--deepspeed", "--zero-stage", "2")
    assert_losses_within_noise(tested, reference[0], control[0])
    assert_weights_within_noise(merged_weights(save), merged_weights(reference[1]), merged_weights(control[1]))


@pytest.mark.isa_sensitive
def test_pipeline_tp2_pp2_equals_the_torch_engine(reference, control, pipeline):
    assert "pipeline: 2 stages x 1 data-parallel x 2 tensor-parallel, ZeRO stage 1" in pipeline[2]
    assert_losses_within_noise(pipeline[0], reference[0], control[0])
    assert_weights_within_noise(merged_weights(pipeline[1]), merged_weights(reference[1]),
                                merged_weights(control[1]))


@pytest.mark.isa_sensitive
def test_pipeline_tp2_pp2_zero0_with_partitioned_activations_equals_the_torch_engine(runs, reference, control):
    """Without sequence parallelism DeepSpeed sends each TP rank half of the stage's output and all-gathers it on
    arrival; ZeRO 0 steps through our guard, whose norm counts the replicated norms on TP rank 0 only."""
    tested, save, _ = runs("zero0_tp2_pp2", 4, *TP2, *PP2, "--deepspeed", "--zero-stage", "0")
    assert_losses_within_noise(tested, reference[0], control[0])
    assert_weights_within_noise(merged_weights(save), merged_weights(reference[1]), merged_weights(control[1]))


@pytest.mark.isa_sensitive
def test_fp8_and_fp8adam_under_zero1_tp2_equal_the_torch_engine(runs):
    """The control keeps each micro-batch whole (the FP8 amaxes see the same tokens) and moves the summation to a
    data-parallel all-reduce: TP = 2 x DP = 2 on the torch engine."""
    reference = runs("torch_tp2_fp8", 2, *TP2, *SP, *FP8)
    control = runs("torch_tp2_dp2_fp8", 4, *TP2, *SP, *FP8)
    tested = runs("zero1_tp2_fp8", 2, *TP2, *SP, *ZERO1, *FP8)
    assert "Fp8AdamW: m=e4m3/block128 v=e5m2/block128" in tested[2]
    assert_losses_within_noise(tested[0], reference[0], control[0])
    assert_weights_within_noise(merged_weights(tested[1]), merged_weights(reference[1]), merged_weights(control[1]))
    assert tested[0][3] < tested[0][0] - 0.3  # it trains


def test_zero0_tp2_fp8_fp8adam_is_the_torch_engine_bit_for_bit(runs):
    """ZeRO 0, no sequence parallelism, stochastic rounding on: the same operations in the same order."""
    flags = (*TP2, "--fp8-format", "hybrid", "--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128")
    torch_run = runs("torch_tp2_fp8_sr", 2, *flags)
    deepspeed_run = runs("zero0_tp2_fp8_sr", 2, *flags, "--deepspeed", "--zero-stage", "0")
    assert deepspeed_run[0] == torch_run[0]
    a, b = merged_weights(deepspeed_run[1]), merged_weights(torch_run[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------- checkpoints
def test_zero1_tp2_resume_at_the_same_layout_is_exact(runs, zero1):
    resumed = resume_from_iteration_2(runs, zero1, "zero1_tp2_dp2_resumed", 4, *TP2, *SP, *ZERO1)
    full = zero1[0]  # train 1-4, valid@2, valid@4
    assert resumed == full[2:4] + full[5:]  # printed values identical, not just close
    a, b = merged_weights(runs.root / "zero1_tp2_dp2_resumed"), merged_weights(zero1[1])
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_pipeline_tp2_pp2_resume_at_the_same_layout_is_exact(runs, pipeline):
    names = {p.name for p in (pipeline[1] / "iter_0000002").iterdir()}
    # one file per pipeline layer (embedding, 2 transformer layers, final norm) and TP rank; DeepSpeed's
    # model-parallel rank of a stage's TP rank t is stage x 2 + t
    assert {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(4) for t in range(2)} <= names
    assert {f"mp_rank_{r:02d}_model_states.pt" for r in range(4)} <= names
    resumed = resume_from_iteration_2(runs, pipeline, "zero1_tp2_pp2_resumed", 4, *TP2, *PP2, *SP, *ZERO1)
    full = pipeline[0]
    assert resumed == full[2:4] + full[5:]
    a, b = merged_weights(runs.root / "zero1_tp2_pp2_resumed"), merged_weights(pipeline[1])
    assert all(torch.equal(a[k], b[k]) for k in b)


def _shards_on_disk(folder, pipeline_stages: int) -> list[dict]:
    """Each TP rank's weights as DeepSpeed wrote them, under full-model names."""
    from megatron.checkpoint.layouts import load_file

    if not pipeline_stages:
        return [dict(load_file(folder / f"mp_rank_{t:02d}_model_states.pt")["module"]) for t in range(2)]
    shards = []
    for t in range(2):
        state = {}
        for i in range(4):  # embedding, transformer layers 0 and 1, final norm + output layer
            for key, tensor in load_file(folder / f"layer_{i:02d}-model_{t:02d}-model_states.pt").items():
                if i in (1, 2):
                    key = f"decoder.layers.{i - 1}.{key.removeprefix('layer.')}"
                elif i == 3 and not key.startswith("output_layer."):
                    key = f"decoder.{key}"
                state[key] = tensor
        shards.append(state)
    return shards


@pytest.mark.parametrize("which", ["zero1", "pipeline"])
def test_reader_merges_tp_shards_that_evaluate_to_the_runs_validation_loss(which, request, reference, data):
    """The merged model, cut again the way tensor parallelism cuts it, gives back every TP rank's file bit for bit;
    and tools/evaluate.py on it (one process, full matrices) reports the run's last validation loss. The bound is
    the same comparison for the torch engine's TP checkpoint (the reader's trusted TP layout): TP = 2 and one
    process add the same fp32 products in other orders."""
    run = request.getfixturevalue(which)
    folder = resolve_checkpoint_dir(run[1])
    payload, config, _ = read_checkpoint(folder)
    assert payload["layout"] == ("pipeline" if which == "pipeline" else "deepspeed")
    model_config = model_config_from_dict(config, folder)
    assert payload["model"]["embedding.word_embeddings.weight"].shape[0] == model_config.padded_vocab_size == 256
    for t, on_disk in enumerate(_shards_on_disk(folder, 2 if which == "pipeline" else 0)):
        cut = shard_state_dict(payload["model"], model_config, t, 2)
        assert cut.keys() == on_disk.keys()
        assert all(torch.equal(cut[k], on_disk[k]) for k in cut), t

    evaluate = load_tool("evaluate")

    def deviation(save, log_values) -> tuple[float, float]:
        out = evaluate.main(["--load", str(save), "--data-path", data[1], "--eval-samples", str(BASE["global_batch_size"]),
                             "--device", "cpu"])
        got, valid = out["data_path"]["loss"], log_values[-1]
        return abs(got - valid), printed_unit(valid)

    noise, _ = deviation(reference[1], reference[0])
    tested, unit = deviation(run[1], run[0])
    assert tested <= 4 * (noise + unit) + unit, (tested, noise)
