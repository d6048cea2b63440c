"""FP8 linears + Fp8AdamW under DeepSpeed ZeRO-3 (2 gloo processes): tracks ZeRO-1, resumes exactly, reads back,
and each rank holds only its 1/DP of the parameters right after the model is built (partitioned construction).

The ZeRO-3 runs use `stage3_param_persistence_threshold: 0`, so every parameter is partitioned and gathered
around its layer's forward and backward (DeepSpeed's default keeps tensors below 1e5 elements whole on every rank:
all of the tiny model's, which would test no gathering at all).

Why the comparison with ZeRO-1 is a noise bound and not bitwise: the FP8 GEMMs see the same weights and scales
(an `Fp8Linear` quantizes the gathered weight; its amaxes and delayed-scaling state never see a partition), but
(1) ZeRO-3 reduce-scatters each micro-batch's gradient and accumulates the halves, ZeRO-1 accumulates the
micro-batches and then reduces: the same fp32 sums in another order; (2) Fp8AdamW's scale blocks of 128 elements
lie on each rank's flat partition, which ZeRO-1 cuts from the concatenated group and ZeRO-3 concatenates from
each tensor's half, so blocks straddle other tensors and the rounding (and the stochastic-rounding draws) of
the FP8 moments differ. The control (tests/support/run_noise.py) is the same math in a third order of both kinds: the
torch engine in one process (4 micro-batches accumulated, per-tensor scale blocks), against ZeRO-1.
"""
from __future__ import annotations

import math
import re
import shutil

import pytest
import torch

from megatron.arguments import parse_config
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.layouts import load_file, read_checkpoint
from tests.support.config import tiny_argv, write_zero3_config
from tests.support.flags import EAGER_FP8ADAM as EAGER, ZERO3_FP8 as FP8
from tests.support.launch import BASE, base_run_weights as _weights, run
from tests.support.logs import losses
from tests.support.run_noise import assert_losses_within_noise, assert_weights_within_noise

pytest.importorskip("deepspeed")

COMMON = dict(eval_iters=0, save_interval=2)


def _model_states(folder, rank: int) -> dict:
    return load_file(folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ZeRO-3 (saving at 2 and 4), the same run at ZeRO-1 and on the torch engine (the control); logs and folders.
    The reference and the control step with the eager Fp8AdamW (tests/support/flags.py: EAGER_FP8ADAM)."""
    root = tmp_path_factory.mktemp("zero3_fp8")
    zero3 = ("--deepspeed", "--deepspeed_config", write_zero3_config(root), *FP8)
    log3 = run(2, *zero3, save=root / "z3", **COMMON)
    log1 = run(2, "--deepspeed", "--zero-stage", "1", *FP8, *EAGER, save=root / "z1", **COMMON)
    log0 = run(1, *FP8, *EAGER, save=root / "torch", **COMMON)
    return dict(root=root, zero3=zero3, z3=log3, z1=log1, torch=log0)


def _resume_from_iteration_2(runs) -> str:
    """ZeRO-3 resumed from the first run's iteration 2: a copy of its folder whose trackers point back at 2."""
    root = runs["root"]
    shutil.copytree(root / "z3", root / "resumed")
    (root / "resumed" / ckpt.TRACKER_FILE).write_text("2")
    (root / "resumed" / "latest").write_text("iter_0000002")
    shutil.rmtree(root / "resumed" / "iter_0000004")
    return run(2, *runs["zero3"], load=root / "resumed", save=root / "resumed", **COMMON)


@pytest.mark.isa_sensitive
def test_fp8_and_fp8adam_under_zero3_track_zero1(runs) -> None:
    """Losses and final weights (ZeRO-3's consolidated by the checkpoint reader) within the control's noise."""
    root = runs["root"]
    l3, l1, l0 = losses(runs["z3"]), losses(runs["z1"]), losses(runs["torch"])
    assert len(l3) == BASE["train_iters"] and all(math.isfinite(x) for x in l3)
    assert_losses_within_noise(l3, l1, l0)
    assert_weights_within_noise(_weights(root / "z3"), _weights(root / "z1"), _weights(root / "torch"))
    assert l3[-1] < l3[0] - 0.3, l3


def test_fp8_and_fp8adam_under_zero3_resume_and_checkpoint(runs) -> None:
    """Resume from iteration 2 equals the uninterrupted run: printed losses, consolidated weights and the FP8
    scaling state bit for bit. The FP8 linears and FP8 moments are really there, and the reader reads it all."""
    root, log = runs["root"], runs["z3"]
    assert "converted 8/9 linear layers to FP8" in log
    assert re.search(r"DeepSpeed \S+: ZeRO stage 3, FP32, optimizer Fp8AdamW wrapped by DeepSpeedZeroOptimizer_Stage3",
                     log), log[-3000:]
    # ZeRO-3 hands Fp8AdamW one flat partition per group: each rank holds half of every tensor (90,112 matrix
    # elements in the unwrapped optimizer), the matrices' with FP8 states, the norms' with FP32 ones.
    assert re.search(r"Fp8AdamW: m=e4m3/block128 v=e5m2/block128 states for 1 tensors \(45,056 params\); "
                     r"FP32 states for 1 tensors \(160 params\)", log), log[-3000:]
    resumed_log = _resume_from_iteration_2(runs)
    assert "loaded checkpoint" in resumed_log
    assert losses(resumed_log) == losses(log)[2:]  # the printed values, digit for digit
    straight, resumed = root / "z3" / "iter_0000004", root / "resumed" / "iter_0000004"
    for key, value in _weights(root / "z3").items():
        assert torch.equal(value, _weights(root / "resumed")[key]), key
    # The FP8 scaling state: every rank saves its own copy (equal: amaxes are max-reduced over the ranks), the
    # resumed run's equals the straight run's, and the reader hands rank 0's to the tools.
    fp8 = [_model_states(folder, r)["megatron"]["fp8"] for folder in (straight, resumed) for r in (0, 1)]
    payload, _, _ = read_checkpoint(straight)
    fp8.append(payload["fp8"])
    layers = fp8[0]["layers"]
    assert len(layers) == 8 and all(entry["num_updates"] == 4 for entry in layers.values())
    for other in fp8[1:]:
        assert other["layers"].keys() == layers.keys()
        for name, entry in layers.items():
            for role in ("input", "weight", "grad_output"):
                for key, value in entry[role].items():
                    assert torch.equal(value, other["layers"][name][role][key]), (name, role, key)
    # Fp8AdamW's moments in ZeRO-3's partition files: the matrix group's in FP8 with block scales, the norms' FP32.
    optim = load_file(straight / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    states = optim["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    assert [s["exp_avg"].dtype for s in states.values()] == [torch.float8_e4m3fn, torch.float32]
    assert [s["exp_avg_sq"].dtype for s in states.values()] == [torch.float8_e5m2, torch.float32]


def test_zero3_builds_the_model_partitioned(runs) -> None:
    """Right after build (before `deepspeed.initialize`) each rank holds only its slices: DeepSpeed cuts every
    tensor into DP parts of ceil(numel / DP) elements (the last one padded), here exactly half of the FP32 model.
    Building whole first would print 1.000. The model is the unpartitioned one: the first loss (the initial weights'
    forward) prints as ZeRO-1's, and tests/e2e/test_checkpoint_layouts.py reads the ZeRO-3 layout back bitwise."""
    from megatron.model.gpt import GPTModel

    config = parse_config(tiny_argv(*FP8, micro_batch_size=2, global_batch_size=8))
    sizes = [p.numel() for p in GPTModel(config.model, device="meta").parameters()]
    held, full = 4 * sum(-(-n // 2) for n in sizes), 4 * sum(sizes)
    assert (f"ZeRO-3: this rank holds {held:,} bytes of parameters after build, {held / full:.3f} of the model's "
            f"{full:,}") in runs["z3"], runs["z3"][-3000:]
    assert held / full == 0.5
    assert losses(runs["z3"])[0] == losses(runs["z1"])[0]
