"""`--params-dtype bf16` (Megatron's layout: BF16 weights, FP32 main gradients, FP32 masters) under DeepSpeed ZeRO-3,
with FP8 linears and Fp8AdamW, 2 gloo processes: tracks ZeRO-1 with the same layout, holds 2 bytes per parameter
in its partitions, resumes exactly, and the checkpoint reader returns the FP32 masters.

What ZeRO-3 does with `bf16.enabled` + `data_types.grad_accum_dtype: fp32` (DeepSpeed 0.19, stage3.py): each
micro-batch's BF16 gradients are reduce-scattered (in `communication_data_type`, BF16 by default, as ZeRO-1's
all-reduce of its FP32 buffer also is) and each rank adds its piece into an FP32 partition buffer
(`grad_partitions_flat_buffer`, dtype `gradient_accumulation_dtype`): the accumulation over micro-batches is FP32.
The masters are FP32 partitions made from the BF16 partitions when the optimizer is wrapped, as ZeRO-1's
BF16_Optimizer makes them from the cast module: both start at the initial values rounded once to BF16, which is
why the first losses print equal. The ZeRO-3 runs use `stage3_param_persistence_threshold: 0` (every parameter
partitioned and gathered: tests/e2e/test_zero3_fp8_launch.py says why).

Why a noise bound against ZeRO-1 and not bitwise: ZeRO-3 reduces every micro-batch's gradient and accumulates the
pieces, ZeRO-1 accumulates and then reduces; Fp8AdamW's blocks of 128 lie on differently cut flat partitions.
The control (tests/support/run_noise.py) is ZeRO-2 with the same layout: the same initial masters and the same math in a
third order (its gradients are reduced and partitioned as backward produces them).
"""
from __future__ import annotations

import math
import re
import shutil

import pytest
import torch

from megatron.arguments import parse_config
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.layouts import load_file
from tests.support.config import tiny_argv, write_zero3_config
from tests.support.flags import EAGER_FP8ADAM as EAGER, ZERO3_BF16_PARAMS as LAYOUT
from tests.support.launch import BASE, base_run_weights as _weights, run
from tests.support.logs import losses
from tests.support.run_noise import assert_losses_within_noise, assert_weights_within_noise

pytest.importorskip("deepspeed")

COMMON = dict(eval_iters=0, save_interval=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ZeRO-3 (saving at 2 and 4), the same layout at ZeRO-1 and at ZeRO-2 (the control); logs and folders. The
    reference and the control step with the eager Fp8AdamW (tests/support/flags.py: EAGER_FP8ADAM)."""
    root = tmp_path_factory.mktemp("zero3_bf16")
    zero3 = ("--deepspeed", "--deepspeed_config", write_zero3_config(root), *LAYOUT)
    log3 = run(2, *zero3, save=root / "z3", **COMMON)
    log1 = run(2, "--deepspeed", "--zero-stage", "1", *LAYOUT, *EAGER, save=root / "z1", **COMMON)
    log2 = run(2, "--deepspeed", "--zero-stage", "2", *LAYOUT, *EAGER, save=root / "z2", **COMMON)
    return dict(root=root, zero3=zero3, z3=log3, z1=log1, z2=log2)


@pytest.mark.isa_sensitive
def test_zero3_bf16_params_track_zero1(runs) -> None:
    """Losses and final FP32 masters (as the checkpoint reader returns them) within the control's noise; the first
    loss (the initial BF16 weights' forward) prints equal to ZeRO-1's: the same once-rounded weights."""
    root = runs["root"]
    l3, l1, l2 = losses(runs["z3"]), losses(runs["z1"]), losses(runs["z2"])
    assert len(l3) == BASE["train_iters"] and all(math.isfinite(x) for x in l3)
    assert l3[0] == l1[0] == l2[0], (l3, l1, l2)
    assert_losses_within_noise(l3, l1, l2)
    assert_weights_within_noise(_weights(root / "z3"), _weights(root / "z1"), _weights(root / "z2"))


def test_zero3_bf16_params_hold_two_bytes_per_parameter(runs) -> None:
    """After build each rank holds half of every tensor in FP32 (zero.Init partitions what it gets); they are then
    rounded to BF16: 2 bytes per parameter of this rank's half. The engine runs DeepSpeed's bf16 mode."""
    from megatron.model.gpt import GPTModel

    log = runs["z3"]
    config = parse_config(tiny_argv(*LAYOUT, micro_batch_size=2, global_batch_size=8))
    half = sum(-(-p.numel() // 2) for p in GPTModel(config.model, device="meta").parameters())
    assert f"ZeRO-3: this rank holds {4 * half:,} bytes of parameters after build" in log, log[-3000:]
    assert f"--params-dtype bf16: ZeRO-3: this rank holds {2 * half:,} bytes of parameters in BF16, 0.500" in log
    assert re.search(r"ZeRO stage 3, BF16 autocast, BF16 weights with FP32 main gradients and FP32 masters in the "
                     r"ZeRO partitions, optimizer Fp8AdamW wrapped by DeepSpeedZeroOptimizer_Stage3", log), log[-3000:]
    assert "converted 8/9 linear layers to FP8" in log


@pytest.mark.slow  # one more 2-process launch: the module's three others already take ~40 s on 2 loaded cores
def test_zero3_bf16_params_resume_exactly_and_checkpoint_holds_fp32_masters(runs) -> None:
    """Resume from iteration 2 equals the uninterrupted run (printed losses, FP32 masters bit for bit); the saved
    partitions are FP32 masters that are not BF16 values (the steps moved them off the BF16 grid)."""
    root, log = runs["root"], runs["z3"]
    shutil.copytree(root / "z3", root / "resumed")
    (root / "resumed" / ckpt.TRACKER_FILE).write_text("2")
    (root / "resumed" / "latest").write_text("iter_0000002")
    shutil.rmtree(root / "resumed" / "iter_0000004")
    resumed_log = run(2, *runs["zero3"], load=root / "resumed", save=root / "resumed", **COMMON)
    assert "loaded checkpoint" in resumed_log
    assert losses(resumed_log) == losses(log)[2:]
    straight, resumed = _weights(root / "z3"), _weights(root / "resumed")
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        assert value.dtype == torch.float32, key
        assert torch.equal(value, resumed[key]), key
    matrices = [v for v in straight.values() if v.dim() == 2]
    assert all(not torch.equal(v, v.bfloat16().float()) for v in matrices)
    # The masters live in ZeRO-3's partition files as FP32; each rank's flat groups hold its half.
    # DeepSpeed names them as ZeRO-1's BF16_Optimizer does (`bf16_` prefix); the readers match both names.
    optim = load_file(root / "z3" / "iter_0000004" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    flat = optim["optimizer_state_dict"]["fp32_flat_groups"]
    assert [t.dtype for t in flat] == [torch.float32] * len(flat)
