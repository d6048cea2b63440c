"""An eager `Fp8Linear` is not host-bound: the ops one forward + backward dispatches, counted.

On a GPU every dispatched op is a kernel launch of several microseconds of host time, whatever its size; pipeline
parallelism and ZeRO-3 keep their blocks eager, so the eager layer's launches are the FP8 overhead they pay per
GEMM. Most of them used to be 0-d scale arithmetic: ~130 ops per forward + backward. In steady state (delayed
scaling whose history holds a scale, the FP8 weight cached for the step) a layer now dispatches at most 40: the
three GEMMs, the casts of x and dy with their amaxes, and a handful of 0-d ops (tests below). Counted with a
`TorchDispatchMode`, which sees every op that reaches the dispatcher, for the layer's forward and its backward,
the gradient accumulation of x and W included."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step
from megatron.fp8.recipe import Fp8Scaling

M, K, N = 16, 64, 32


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _micro_batch(layer: Fp8Linear, x: torch.Tensor, grad: torch.Tensor, bf16: bool) -> tuple[list[str], tuple]:
    """(the ops of one forward + backward, (y, dx, dW))."""
    x.grad = layer.weight.grad = None
    with _Ops() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = layer(x)
        y.backward(grad)
    return ops.names, (y.detach(), x.grad, layer.weight.grad)


def _steady_state(backend: str, scaling: str, bf16: bool, learn_validity: bool = True):
    """(ops of a step's first micro-batch, of its second, the second's results) at the third optimizer step."""
    torch.manual_seed(0)
    layer = Fp8Linear(K, N, bias=False, recipe=Fp8Recipe(backend=backend, scaling=Fp8Scaling(scaling)))
    x = torch.randn(M, K, requires_grad=True)
    grad = torch.randn(M, N, dtype=torch.bfloat16 if bf16 else torch.float32)
    for _ in range(2):
        for _ in range(2):
            _micro_batch(layer, x, grad, bf16)
        fp8_optimizer_step(layer)
        if not learn_validity:
            layer.fp8.forget_scale_validity()
    first, _ = _micro_batch(layer, x, grad, bf16)
    second, results = _micro_batch(layer, x, grad, bf16)
    return first, second, results


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("backend", ["scaled_mm", "emulated"])
def test_a_steady_state_micro_batch_dispatches_at_most_40_ops(backend, bf16):
    first, second, _ = _steady_state(backend, "delayed", bf16)
    gemm = "aten._scaled_mm.default" if backend == "scaled_mm" else "aten.mm.default"
    assert second.count(gemm) == 3  # fprop, dgrad, wgrad: nothing else of the layer is a GEMM
    # Under bf16 autocast the emulated backend converts its fp32 GEMM outputs and the bf16 amaxes (4 casts more).
    assert len(second) <= (44 if backend == "emulated" and bf16 else 40), second
    # The step's first micro-batch also casts W: its amax (2 ops) and record (1), the cast (3), the guarded scale
    # (1), and for _scaled_mm's dgrad the transposed copy (2). Once per step, not per micro-batch.
    assert len(first) - len(second) <= 9, (len(first), len(second))


@pytest.mark.parametrize("backend", ["scaled_mm", "emulated"])
def test_the_history_scale_path_equals_the_general_one_bitwise(backend):
    """A role known to be valid skips the current-scale arithmetic (`Fp8LayerState.scale_for`); the general path
    selects the same history scale with a `where`: the same y, dx and dW, bit for bit. The general path is the
    control of the count: it dispatches the scale arithmetic of x and dy again."""
    _, known, want = _steady_state(backend, "delayed", False)
    _, general, got = _steady_state(backend, "delayed", False, learn_validity=False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert len(general) >= len(known) + 2 * 7, (len(general), len(known))


def test_tensorwise_scaling_adds_the_current_scale_of_x_and_dy():
    """Current scaling computes a scale per tensor (`compute_scale`: 7 ops) and records it: 8 ops for each of x and
    dy on top of the delayed steady state."""
    _, delayed, _ = _steady_state("scaled_mm", "delayed", False)
    _, tensorwise, _ = _steady_state("scaled_mm", "tensorwise", False)
    assert len(tensorwise) - len(delayed) == 2 * 8, (len(tensorwise), len(delayed))
