"""Resharding on resume into and out of DeepSpeed ZeRO-3 (megatron/checkpoint/reshard.py, full_state.py).

Two source runs (3 iterations saving at 2, then pointed back at 2, as in tests/e2e/test_reshard.py; FP8 linears +
Fp8AdamW with blocks of 24, which straddle the ZeRO-3 pieces of every parameter): ZeRO-3 at DP = 2 and ZeRO-1
at DP = 2. The ZeRO-3 runs use `stage3_param_persistence_threshold: 0`, so every parameter is really partitioned
(DeepSpeed's default keeps all of the tiny model's tensors whole).

- State (as tests/e2e/test_reshard.py): ZeRO-3 DP 2 -> ZeRO-3 DP 1 and -> the torch engine (ZeRO-3's partitioned
  moments read out), ZeRO-1 DP 2 -> ZeRO-3 DP 2 (into ZeRO-3's partitions): the target saves at once, and its
  checkpoint read back without its layout equals the source's (weights, FP32 moments, steps, FP8 scaling state,
  LR schedule, data position bit for bit; Fp8AdamW's FP8 moments within `requantization_bound`).
- Loss: the first step after loading computes the loss of a same-layout resume (the source's own third step)
  within the runs' noise, measured by a control that resumes at the source's layout with half the micro-batch
  (ZeRO-3 DP 2 -> 1; ZeRO-1 -> ZeRO-3 under MEGATRON_SLOW_TESTS=1).
"""
from __future__ import annotations

import shutil

import pytest
import torch

from megatron.checkpoint import store as ckpt
from megatron.checkpoint.full_state import read_full_state
from tests.support.config import write_zero3_config
from tests.support.logs import losses
from tests.support.reshard import V256, Z1, assert_same_state, run
from tests.support.run_noise import assert_losses_within_noise

pytest.importorskip("deepspeed")


class Zero3Sources:
    """The two source checkpoints, each trained on first use; `straight[name]` is the run's 3 losses."""

    def __init__(self, root) -> None:
        self.root, self.straight = root, {}
        self.z3 = ("--deepspeed", "--deepspeed_config", write_zero3_config(root))
        self.switches = {"zero3_dp2": (*self.z3, *V256), "zero1_dp2": (*Z1, *V256)}

    def __truediv__(self, name: str):
        if name not in self.straight:
            save = self.root / name
            self.straight[name] = losses(run(2, *self.switches[name], save=save, train_iters=3, save_interval=2))
            assert len(self.straight[name]) == 3 and ckpt.read_tracker(save) == 3
            shutil.rmtree(ckpt.iteration_dir(save, 3))
            (save / ckpt.TRACKER_FILE).write_text("2")
            (save / "latest").write_text("iter_0000002")  # DeepSpeed's own pointer
        return self.root / name


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return Zero3Sources(tmp_path_factory.mktemp("reshard_zero3_sources"))


TARGETS = [  # (source, nproc, ZeRO-3 at the target?, what changes)
    ("zero3_dp2", 1, True, "ZeRO-3 DP 2 -> 1"),
    ("zero3_dp2", 1, False, "ZeRO-3 DP 2 -> torch engine"),
    ("zero1_dp2", 2, True, "ZeRO-1 -> ZeRO-3 at DP 2"),
]


@pytest.mark.parametrize("source, nproc, zero3, what", TARGETS, ids=[t[3] for t in TARGETS])
def test_resharded_state_equals_the_source(sources, tmp_path, source, nproc, zero3, what):
    switches = (*sources.z3, *V256) if zero3 else V256
    log = run(nproc, *switches, load=sources / source, save=tmp_path / "resaved")
    assert "resharded" in log, what
    target = read_full_state(ckpt.iteration_dir(tmp_path / "resaved", 2))
    assert target.layout == ("deepspeed_zero3" if zero3 else "single")
    source_state = read_full_state(ckpt.iteration_dir(sources / source, 2))
    assert source_state.optimizer is not None and target.optimizer is not None
    worst = assert_same_state(target, source_state)
    print(f"{what}: worst FP8 moment requantization error = {worst:.3f} of the bound")


# ZeRO-1 -> ZeRO-3 is slow-marked (two more DP = 2 launches, ~12 s each, would take the module past 40 s): the
# module partitions it fills are written by the same code as in ZeRO-3 DP 2 -> 1, whose loss test catches stale
# ones, and its masters (the other rank's pieces included) are checked bit for bit by the state test.
LOSS = [pytest.param("zero3_dp2", 1, "ZeRO-3 DP 2 -> 1", id="ZeRO-3 DP 2 -> 1"),
        pytest.param("zero1_dp2", 2, "ZeRO-1 -> ZeRO-3 at DP 2", id="ZeRO-1 -> ZeRO-3 at DP 2",
                     marks=pytest.mark.slow)]


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("source, nproc, what", LOSS)
def test_next_step_loss_equals_a_same_layout_resume(sources, source, nproc, what):
    """The step after loading computes its loss from the restored weights and FP8 scales (tests/e2e/test_reshard.py
    says why this step, and not later ones, is the reference)."""
    folder = sources / source
    control = losses(run(2, *sources.switches[source], load=folder, train_iters=3, micro_batch_size=1))
    tested = losses(run(nproc, *sources.z3, *V256, load=folder, train_iters=3))
    assert len(tested) == 1, what
    assert_losses_within_noise(tested, sources.straight[source][2:], control)


def test_zero3_moments_read_out_match_zero1s(sources):
    """An independent check of the reader (`full_state._read_zero3`), which the state tests above use on both
    sides: the ZeRO-3 and ZeRO-1 sources trained the same model on the same data, so their moments at iteration 2
    are the same FP32 values up to the runs' rounding, each stored once in its own format and scale blocks.
    The FP32-stored moments (vectors) measure the runs' own divergence (`noise`). An FP8 moment is one
    rounding away on each side: round-to-nearest m (E4M3) within eps/2 relative per element, stochastically
    rounded v (E5M2) within eps; two sides double it. A misread (rank order, offsets, sub-group order) pairs
    unrelated elements: relative distances near 1 (measured 0.7-1.5 with the two ranks' pieces swapped)."""
    z3 = read_full_state(ckpt.iteration_dir(sources / "zero3_dp2", 2))
    z1 = read_full_state(ckpt.iteration_dir(sources / "zero1_dp2", 2))
    assert z3.optimizer is not None and z3.optimizer["params"].keys() == z1.optimizer["params"].keys()
    fp8 = {"exp_avg": (torch.float8_e4m3fn, 0.5), "exp_avg_sq": (torch.float8_e5m2, 1.0)}  # dtype, ulps per rounding

    def rel(name: str, moment: str) -> float:
        a, b = (s.optimizer["params"][name][moment].double() for s in (z3, z1))
        assert z3.optimizer["params"][name]["step"] == z1.optimizer["params"][name]["step"]
        return float((a - b).norm() / b.norm())

    stored_fp32 = [n for n in z1.optimizer["params"] if z1.model[n].ndim < 2]  # Fp8AdamW keeps vectors' in FP32
    noise = max(rel(n, m) for n in stored_fp32 for m in fp8)
    assert noise < 1e-4, noise  # the two engines' FP32 sums in other orders, nothing else
    for name in z1.optimizer["params"]:
        if name in stored_fp32:
            continue
        for moment, (dtype, ulps) in fp8.items():
            bound = 2 * ulps * torch.finfo(dtype).eps + 4 * noise
            assert rel(name, moment) <= bound, (name, moment, rel(name, moment), bound)
