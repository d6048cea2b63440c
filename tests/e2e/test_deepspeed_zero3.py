"""BF16 under DeepSpeed ZeRO-3 (2 gloo processes): tracks one process with doubled accumulation, and resumes.

ZeRO-3 partitions the parameters themselves (each rank holds half of every flattened parameter and gathers them
for forward and backward); with --bf16 the model still runs under torch autocast on FP32 parameters, as on the
torch path. What may differ is the order of the fp32 gradient reductions (reduce-scatter of per-rank halves
vs one process summing four micro-batches), i.e. ~1e-7 relative on the gradients, which bf16 autocast can
amplify by at most its own rounding: so the bound is the run's own bf16 noise, measured as the largest
|loss(bf16) - loss(fp32)| of the single-process reference over the same steps. The runs set
`stage3_param_persistence_threshold: 0`: DeepSpeed's default (1e5 elements) would keep every tensor of the tiny
model whole, and nothing would be partitioned or gathered.
"""
from __future__ import annotations

import pytest

from tests.support.config import write_zero3_config
from tests.support.launch import run
from tests.support.logs import losses

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def zero3_args(tmp_path_factory) -> tuple[str, ...]:
    return ("--deepspeed", "--deepspeed_config", write_zero3_config(tmp_path_factory.mktemp("z3json")), "--bf16")


@pytest.fixture(scope="module")
def zero3_straight(tmp_path_factory, zero3_args):
    save = tmp_path_factory.mktemp("z3")
    return losses(run(2, *zero3_args, save=save)), save


def test_bf16_zero3_dp2_tracks_single_process_with_double_accumulation(zero3_straight, torch_reference) -> None:
    l_z3, _ = zero3_straight
    l_bf16 = losses(run(1, "--bf16"))
    l_fp32, _ = torch_reference  # the same run in FP32 (tests/conftest.py)
    assert len(l_z3) == len(l_bf16) == len(l_fp32) == 4
    noise = max(abs(a - b) for a, b in zip(l_bf16, l_fp32))
    assert noise > 0
    for a, b in zip(l_z3, l_bf16):
        assert abs(a - b) <= noise, (l_z3, l_bf16, l_fp32)


def test_bf16_zero3_resume_is_exact(zero3_straight, zero3_args, tmp_path) -> None:
    l_full, _ = zero3_straight
    save = tmp_path / "ckpt"
    first = losses(run(2, *zero3_args, save=save, exit_interval=2))
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in (save / "iter_0000002").glob("*model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    second = losses(run(2, *zero3_args, load=save, save=save))
    assert first + second == l_full  # the printed values, digit for digit
