"""torch DDP (2 processes, gloo): DP=2 equals one process with twice the gradient accumulation."""
import pytest

from megatron.checkpoint import store as ckpt
from tests.support.launch import run
from tests.support.logs import losses
from tests.support.run_noise import assert_losses_within_noise, assert_weights_within_noise


# Bounded by the run's own rounding noise (tests/support/run_noise.py): the control is one process with micro-batches
# of 1 and 8 accumulation steps, the same math as both runs in a third summation order. The one-process reference
# and the control are tests/support/launch.py's BASE run, shared with the DeepSpeed tests (session fixtures,
# tests/conftest.py).
@pytest.mark.isa_sensitive
def test_dp2_equals_single_process_with_double_accumulation(torch_reference, torch_control, tmp_path):
    (l1, w1), (l_control, w_control) = torch_reference, torch_control
    l2 = losses(run(2, save=tmp_path / "ddp"))
    assert len(l1) == len(l2) == 4
    assert_losses_within_noise(l2, l1, l_control)
    assert_weights_within_noise(ckpt.load_checkpoint_files(tmp_path / "ddp")["payload"]["model"], w1, w_control)
