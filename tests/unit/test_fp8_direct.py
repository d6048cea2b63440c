"""The start-up's graphs called directly (megatron/fp8/direct.py): the bits of the eager reference for every size,
no torch.compile machinery on the way, and torch.compile's path for every call a direct graph does not take."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron.fp8 import direct, fused

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: 448.0, E5M2: 57344.0}
SHAPES = [(2, 2), (3, 5), (17, 33), (128, 352)]


@pytest.fixture(scope="module")
def warmed() -> None:
    fused.warm_up_upcasts(torch.device("cpu"), BF16)
    if getattr(torch._inductor, "standalone_compile", None) is None:
        pytest.skip("this torch has no torch._inductor.standalone_compile: the start-up graphs run through "
                    "torch.compile")


def _activations(shape: tuple, fmt: torch.dtype) -> torch.Tensor:
    """bf16 values across the format's range once scaled by 4: zeros of both signs, values that flush, subnormals,
    ties, values that saturate, and NaN."""
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randn(*shape, generator=g) * torch.logspace(-12, 6, shape[0] * shape[1]).view(shape)
    flat = x.view(-1)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, _MAX[fmt], -_MAX[fmt] * 2, float("nan")])
    flat[:min(flat.numel(), special.numel())] = special[:flat.numel()]
    return x.to(BF16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, NaN as NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        torch.where(a.isnan(), torch.zeros_like(a), a).contiguous().view(-1).view(torch.uint8),
        torch.where(b.isnan(), torch.zeros_like(b), b).contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_the_direct_casts_give_the_eager_casts_bits_for_every_shape(warmed, fmt):
    scale = torch.tensor(4.0)
    for shape in SHAPES:
        args = (_activations(shape, fmt), scale, _MAX[fmt], fmt, BF16)
        values, amax = fused._DIRECT.call(fused._known_values_amax_any_shape.fn, args)  # (None: no direct graph)
        want = fused._known_values_amax(*args)  # eager: the real FP8 cast
        assert _same(values, want[0]) and _same(amax, want[1]), shape
        assert _same(fused._DIRECT.call(fused._known_values_any_shape.fn, args), want[0]), shape
        assert not values.requires_grad


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_the_direct_upcasts_give_the_eager_bits_in_both_layouts(warmed, fmt):
    for shape in SHAPES:
        q = (torch.randn(*shape) * 20).to(fmt)
        for operand in (q, q.t()):
            got = fused._DIRECT.call(fused._upcast_any_shape.fn, (operand, BF16))
            assert _same(got, operand.float().to(BF16)), (shape, operand.stride())


def test_a_direct_call_runs_no_torch_compile_code(warmed, monkeypatch):
    def refuse(*args):
        raise AssertionError("torch.compile's path ran")

    monkeypatch.setattr(fused.CompiledOrEager, "__call__", refuse)
    x, scale = _activations((64, 48), E4M3), torch.tensor(2.0)
    with torch.autocast("cpu", dtype=BF16):  # as the eager layer calls it, with autograd recording
        fused.known_values_and_amax(x.requires_grad_(), scale, 448.0, E4M3, BF16)
    fused.upcast((torch.randn(8, 4) * 3).to(E5M2).t(), BF16)


@pytest.mark.parametrize("case", ["one row", "3-D", "a column slice", "an fp32 input", "another format maximum"])
def test_calls_a_direct_graph_does_not_take_run_through_torch_compile(warmed, case):
    """What the symbolic trace and the direct graph's layout do not cover (a size of 1, other ranks and strides,
    other dtypes and constants) is refused by the direct graphs and computed by torch.compile's graph, correctly."""
    x, fp8_max = _activations((16, 40), E4M3), 448.0
    x = {"one row": x[:1], "3-D": x.view(2, 8, 40), "a column slice": x[:, :24], "an fp32 input": x.float(),
         "another format maximum": x}[case]
    fp8_max = 240.0 if case == "another format maximum" else fp8_max
    scale = torch.tensor(2.0)
    args = (x, scale, fp8_max, E4M3, BF16)
    assert fused._DIRECT.call(fused._known_values_amax_any_shape.fn, args) is None
    values, amax = fused.call_as_compiled(fused._known_values_amax_any_shape, *args)
    want = fused._known_values_amax(*args)
    assert _same(values, want[0]) and _same(amax, want[1])


def test_without_standalone_compile_the_start_up_takes_torch_compile(monkeypatch):
    """An older torch (no `torch._inductor.standalone_compile`) makes no direct graph; the caller compiles the
    function through torch.compile instead, as the start-up always did."""
    monkeypatch.delattr(torch._inductor, "standalone_compile", raising=False)
    graphs = direct.DirectGraphs()
    assert not graphs.build(fused._upcast, torch.zeros(4, 4).to(E4M3), BF16)
    assert fused._upcast not in graphs


def test_a_function_the_direct_path_cannot_compile_is_logged_and_keeps_torch_compile(monkeypatch, caplog):
    def fail(*args):
        raise RuntimeError("no lowering for this op")

    monkeypatch.setattr(direct, "_compile", fail)
    graphs = direct.DirectGraphs()
    with caplog.at_level(logging.INFO, logger="megatron"):
        assert not graphs.build(fused._upcast, torch.zeros(4, 4).to(E4M3), BF16)
    assert "direct call of _upcast not compiled (RuntimeError: no lowering for this op)" in caplog.text
    assert graphs.call(fused._upcast, (torch.zeros(4, 4).to(E4M3), BF16)) is None


def test_tensors_without_storage_take_the_python_arithmetic(warmed):
    """`fused.uncompiled` (the performance model's fake tensors) runs every function's Python, direct graphs too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, fused.uncompiled():
        x = mode.from_tensor(torch.zeros(32, 16, dtype=BF16))
        values, amax = fused.known_values_and_amax(x, torch.tensor(1.0), 448.0, E4M3, BF16)
    assert values.shape == (32, 16) and values.dtype == BF16 and amax.dtype == torch.float32


def test_the_environment_variable_turns_the_direct_calls_off_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv(direct.ENV_VAR, "off")
    assert not direct.DirectGraphs().build(fused._upcast, torch.zeros(4, 4).to(E4M3), BF16)
    assert direct.requested({direct.ENV_VAR: " On "}) and direct.requested({})
    with pytest.raises(direct.DirectCallsConfigError, match="MEGATRON_FP8_DIRECT_CALLS='fast' is not one of on, off"):
        direct.requested({direct.ENV_VAR: "fast"})


def test_a_direct_graph_that_fails_when_called_is_dropped_with_a_warning(caplog):
    """A direct call that raises (nothing the caller sees was written) warns once and leaves every later call of
    that kind to torch.compile's path."""
    graphs = direct.DirectGraphs()
    q = (torch.randn(6, 4) * 3).to(E4M3)
    if not graphs.build(fused._upcast, q, BF16):
        pytest.skip("no direct graphs in this torch")
    key = next(iter(graphs._graphs))
    graphs._graphs[key] = (lambda *tensors: (_ for _ in ()).throw(RuntimeError("bad stride")), True)
    with caplog.at_level(logging.WARNING, logger="megatron"):
        assert graphs.call(fused._upcast, (q, BF16)) is None
        assert graphs.call(fused._upcast, (q, BF16)) is None
    assert caplog.text.count("direct call of _upcast failed (RuntimeError: bad stride)") == 1
    assert fused._upcast not in graphs


def _bytes_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """`_same` (bitwise, NaN as NaN) for FP8 tensors too, compared as their exact FP32 values; None equals None."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype:
        return False
    return _same(a.float(), b.float()) if a.dtype in (E4M3, E5M2) else _same(a, b)


@pytest.mark.parametrize("valid", [True, False], ids=["history-scale", "first-step-scale"])
def test_the_weight_cast_graph_built_on_a_square_matrix_takes_every_shape(warmed, valid):
    """`fused.quantize_tensor` on a CPU matrix (each FP8 layer's per-step weight cast) takes one direct graph built
    on its first call. Sizes that are equal in that call keep symbols of their own (no duck shaping), so a graph
    built on a square weight gives the eager cast's bits for every other shape, and the per-shape graph's."""
    graphs = direct.DirectGraphs()
    for shape in [(64, 64), (96, 64), (64, 96), (5, 5), (3, 17)]:
        w = _activations(shape, E4M3)
        args = (w, torch.tensor(4.0), torch.tensor(valid), True, 448.0, 0, False, E4M3, BF16, False, True)
        got = graphs.call_or_build(fused._quantize_tensor, args)
        assert got is not None, shape
        for a, b in zip(got, fused._quantize_tensor(*args)):
            assert _bytes_equal(a, b), shape
    assert len(graphs._graphs) == 1
    x = _activations((40, 24), E4M3)
    got = fused.quantize_tensor(x, torch.tensor(4.0), torch.tensor(valid), True, 448.0, 0, False, E4M3, BF16)
    want = fused._quantize_tensor_c(x, torch.tensor(4.0), torch.tensor(valid), True, 448.0, 0, False, E4M3, BF16,
                                    False, True)  # torch.compile's graph for this shape
    assert all(_bytes_equal(a, b) for a, b in zip(got, want))


def test_a_kind_of_call_that_does_not_compile_is_tried_once(monkeypatch):
    """`call_or_build` compiles a kind of call (function, constants, dtypes, layouts) at its first call; one that
    fails to compile is not tried again, its calls return None (the caller's torch.compile path)."""
    tries = []

    def fail(*args):
        tries.append(args)
        raise RuntimeError("no lowering for this op")

    monkeypatch.setattr(direct, "_compile", fail)
    graphs = direct.DirectGraphs()
    q = torch.zeros(4, 4).to(E4M3)
    assert graphs.call_or_build(fused._upcast, (q, BF16)) is None
    assert graphs.call_or_build(fused._upcast, (q, BF16)) is None
    assert len(tries) == 1
    assert graphs.call_or_build(fused._upcast, (q[:1], BF16)) is None  # one row: no graph is made for it
    assert len(tries) == 1


def test_a_tensor_subclass_takes_torch_compiles_path(warmed):
    """A tensor subclass (DTensor, a wrapper tensor) dispatches on its own: no direct graph takes it; a parameter
    (detached for the call) does."""
    x = _activations((16, 32), E4M3)

    class Wrapped(torch.Tensor):
        pass

    scale = torch.tensor(2.0)
    assert fused._DIRECT.call(fused._known_values_amax_any_shape.fn, (x.as_subclass(Wrapped), scale, 448.0, E4M3,
                                                                      BF16)) is None
    parameter = torch.nn.Parameter(x.clone())
    assert type(parameter) is torch.nn.Parameter
    assert fused._DIRECT.call(fused._known_values_amax_any_shape.fn, (parameter, scale, 448.0, E4M3, BF16)) is not None
