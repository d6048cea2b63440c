"""--params-dtype bf16 (Megatron's layout) under DeepSpeed ZeRO-1, 2 gloo processes under torchrun (`slow`)."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint import store as ckpt
from tests.support.flags import MAIN_PARAMS_FP8 as FP8, PARAMS_BF16 as MAIN


@pytest.mark.slow
def test_deepspeed_zero1_bf16_params_resume_exactly_and_checkpoints_hold_fp32_masters(tmp_path):
    """2 gloo processes, ZeRO-1 (DeepSpeed's BF16_Optimizer around Fp8AdamW): the module states are BF16, the
    layout-free reader returns the FP32 masters of the partitions, and resuming continues bit for bit."""
    from megatron.checkpoint.full_state import read_full_state
    from tests.support.launch import run
    from tests.support.logs import losses

    flags = ("--deepspeed", "--zero-stage", "1", *FP8, *MAIN)
    straight = losses(run(2, *flags, train_iters=8, eval_iters=0))
    run(2, *flags, train_iters=8, eval_iters=0, save=tmp_path / "c", exit_interval=4)
    resumed = losses(run(2, *flags, train_iters=8, eval_iters=0, load=tmp_path / "c"))
    assert straight[4:] == resumed
    folder = ckpt.iteration_dir(tmp_path / "c", 4)
    module = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    full = read_full_state(folder)
    for name, weight in module.items():
        if weight.is_floating_point() and not name.startswith("rotary") and "fp8" not in name:
            assert weight.dtype == torch.bfloat16, name
            assert full.model[name].dtype == torch.float32, name
            assert torch.equal(full.model[name].bfloat16(), weight), name  # BF16 weights = rounded masters
