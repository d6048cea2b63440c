"""Resharding on resume: a checkpoint written at one TP / PP / DP layout (or engine) continues at another.

Four source runs (2 iterations, FP8 linears + Fp8AdamW with blocks of 24, which straddle the boundaries of
the new pieces: rows of 32 or 64, ZeRO partitions): torch TP=2, DeepSpeed ZeRO-1 DP=2, DeepSpeed pipeline PP=2
(ZeRO-1), DeepSpeed ZeRO-1 TP=2. Each is loaded at other
layouts, covering TP 2->1 and 1->2, DP 2->1 and 1->2 under ZeRO-1, PP 2->1 and 1->2 (and engine switches).

Two kinds of checks:
- State: the target run saves at once (--train-iters = the loaded iteration, no step), and its checkpoint, read
  back without its layout (`read_full_state`), equals the source's: weights, FP32 moments, steps, FP8 scaling
  state, LR schedule and data position bit for bit; Fp8AdamW's FP8 moments within one rounding of their format
  under the new pieces' scales (`requantization_bound`, derived from the format, not fitted).
- Loss: the next step at the new layout computes the loss of a same-layout resume within the runs' own noise (a
  control resumes at the same layout with half the micro-batch size, tests/support/run_noise.py). A same-layout
  resume repeats the uninterrupted run bit for bit (tests/e2e/test_tensor_parallel_launch.py,
  test_deepspeed_launch.py, test_pipeline_launch.py assert it per engine), so the reference is the source run's
  own third step: each source trains 3 iterations, saving at 2, and is then pointed back at iteration 2 (the
  learning rate decays over 3 iterations in every run, so the schedule saved at 2 is the one every later run uses).
"""
from __future__ import annotations

import shutil

import pytest

from megatron.checkpoint import store as ckpt
from megatron.checkpoint.full_state import read_full_state
from tests.support.config import tiny_argv
from tests.support.logs import losses
from tests.support.reshard import FP8, V256, Z1, assert_same_state, run
from tests.support.run_noise import assert_losses_within_noise

pytest.importorskip("deepspeed")

TP2 = ("--tensor-model-parallel-size", "2")
PP2 = (*Z1, "--pipeline-model-parallel-size", "2")
SOURCES = {"tp2": (2, TP2), "zero1_dp2": (2, (*Z1, *V256)), "pp2": (2, (*PP2, *V256)), "zero1_tp2": (2, (*Z1, *TP2))}


class Sources:
    """The source checkpoints, each trained on first use (CI's AVX2 pass needs three of the four): 3 iterations
    saving at 2, then the folder points back at iteration 2 (the documented way to resume from an older one,
    megatron/checkpoint/store.py). `sources / name` is the folder; `straight[name]` the run's 3 losses."""

    def __init__(self, root) -> None:
        self.root, self.straight = root, {}

    def __truediv__(self, name: str):
        if name not in self.straight:
            nproc, switches = SOURCES[name]
            save = self.root / name
            self.straight[name] = losses(run(nproc, *switches, save=save, train_iters=3, save_interval=2))
            assert len(self.straight[name]) == 3 and ckpt.read_tracker(save) == 3
            shutil.rmtree(ckpt.iteration_dir(save, 3))
            (save / ckpt.TRACKER_FILE).write_text("2")
            if (save / "latest").exists():  # DeepSpeed's own pointer
                (save / "latest").write_text("iter_0000002")
            assert ckpt.read_tracker(save) == 2
        return self.root / name


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return Sources(tmp_path_factory.mktemp("reshard_sources"))


TARGETS = [  # (source, nproc, switches at the new layout, what changes): all six directions
    ("tp2", 1, (), "TP 2 -> 1"),  # no --make-vocab-size-divisible-by: the checkpoint's 256 rows are kept
    # --params-dtype bf16 (torch engine): the FP32 values fill the masters, which the resaved checkpoint holds
    ("tp2", 1, (*V256, "--bf16", "--params-dtype", "bf16"), "TP 2 -> 1 into --params-dtype bf16"),
    ("zero1_dp2", 2, TP2, "TP 1 -> 2, DeepSpeed -> torch"),
    ("pp2", 2, (*Z1, *V256), "PP 2 -> 1, DP 1 -> 2 under ZeRO-1"),
    ("zero1_dp2", 2, (*PP2, *V256), "PP 1 -> 2, DP 2 -> 1 under ZeRO-1"),
    ("zero1_tp2", 2, (*PP2, *V256), "TP 2 -> 1 under ZeRO-1, into a pipeline"),
]


@pytest.mark.parametrize("source, nproc, switches, what", TARGETS, ids=[t[3] for t in TARGETS])
def test_resharded_state_equals_the_source(sources, tmp_path, source, nproc, switches, what):
    log = run(nproc, *switches, load=sources / source, save=tmp_path / "resaved")
    assert "resharded" in log, what
    target = read_full_state(ckpt.iteration_dir(tmp_path / "resaved", 2))
    worst = assert_same_state(target, read_full_state(ckpt.iteration_dir(sources / source, 2)))
    print(f"{what}: worst FP8 moment requantization error = {worst:.3f} of the bound")


DOWN = [("tp2", (2, TP2), (1, ())), ("zero1_dp2", (2, (*Z1, *V256)), (1, (*Z1, *V256))),
        ("pp2", (2, (*PP2, *V256)), (2, (*Z1, *V256)))]


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("source, same, other", DOWN, ids=["TP 2 -> 1", "DP 2 -> 1 ZeRO-1", "PP 2 -> 1"])
def test_next_step_loss_equals_a_same_layout_resume(sources, tmp_path, source, same, other):
    """The step after loading computes its loss from the restored weights and FP8 scales: the same as a same-layout
    resume (= the source run's own third step) within the layouts' rounding noise. (The requantized moments act
    from the step after; their error is bounded above on the state, and its effect on the loss measured in
    docs/checkpoints.md.)"""
    control = losses(run(same[0], *same[1], load=sources / source, train_iters=3, micro_batch_size=1))
    reference = sources.straight[source][2:]
    tested = losses(run(other[0], *other[1], load=sources / source, train_iters=3))
    assert len(tested) == 1
    assert_losses_within_noise(tested, reference, control)


def test_padded_vocabulary_mismatch_names_the_flag(sources):
    """Without the flag the TP=2 checkpoint's 256 rows are kept (a note for the log); an explicit
    --make-vocab-size-divisible-by that contradicts them is one error naming the value that keeps them."""
    from megatron.arguments import parse_config
    from megatron.training.loop import Trainer

    kept = parse_config(tiny_argv(*FP8, "--load", str(sources / "tp2")), world_size=1)
    assert kept.model.padded_vocab_size == 256
    assert any("keeping the checkpoint's padded vocabulary of 256 rows" in note for note in kept.compat.notes)
    with pytest.raises(ckpt.CheckpointError, match="--make-vocab-size-divisible-by 256 to keep 256"):
        Trainer(parse_config(tiny_argv(*FP8, "--load", str(sources / "tp2"), "--make-vocab-size-divisible-by",
                                       "128"), world_size=1))
