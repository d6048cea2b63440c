"""Fp8Linear: SQNR of the three GEMMs, formats, autocast, saved FP8 input, weight caching, backends."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import megatron.fp8.layer_state as layer_state
from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step
from megatron.fp8.backends import (CudaScaledMmBackend, EmulatedBackend, backend_format_spec,
                                   select_backend)
from megatron.fp8.formats import format_spec
from megatron.fp8.quantize import quantize
from megatron.fp8.stats import sqnr_db
from tests.support.fp8_reference import kept_state_and_weight, linear_pair


def _pair(recipe: Fp8Recipe, cls: type = Fp8Linear, in_f: int = 256, out_f: int = 512,
          bias: bool = True) -> tuple[nn.Linear, Fp8Linear]:
    return linear_pair(recipe, in_f, out_f, bias, cls)


def _run(ref: nn.Linear, fp8: Fp8Linear, x: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fp8(xa), ref(xb)
    ya.backward(dy)
    yb.backward(dy)
    return {"out": sqnr_db(ya, yb), "dgrad": sqnr_db(xa.grad, xb.grad),
            "wgrad": sqnr_db(fp8.weight.grad, ref.weight.grad)}


def _data(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 64, 256, generator=g) * scale, torch.randn(4, 64, 512, generator=g)


class _E5M2Forward(Fp8Linear):
    """Wrong on purpose: E5M2 for the forward operands too."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.fp8.specs = lambda backend: (backend_format_spec(backend, "e5m2"),) * 3


def test_hybrid_sqnr_of_the_three_gemms() -> None:
    ref, fp8 = _pair(Fp8Recipe())
    s = _run(ref, fp8, *_data())
    # E4M3 x E4M3 forward ~28.7 dB; E5M2 gradients (2 mantissa bits) ~24.6 dB.
    assert 27 < s["out"] < 32, s
    assert 23 < s["dgrad"] < 28, s
    assert 23 < s["wgrad"] < 28, s


def test_e4m3_format_uses_e4m3_for_gradients() -> None:
    ref, fp8 = _pair(Fp8Recipe(format="e4m3"))
    s = _run(ref, fp8, *_data())
    assert s["dgrad"] > 27 and s["wgrad"] > 27, s  # one more mantissa bit than E5M2: ~4 dB better


def test_e5m2_forward_is_worse_than_e4m3() -> None:
    ref, good = _pair(Fp8Recipe())
    _, bad = _pair(Fp8Recipe(), cls=_E5M2Forward)
    x, dy = _data()
    good_s, bad_s = _run(ref, good, x, dy), _run(copy.deepcopy(ref), bad, x, dy)
    assert bad_s["out"] < 24 < 27 < good_s["out"], (good_s, bad_s)


@pytest.mark.parametrize("magnitude", [1e-4, 1e3])
def test_scaling_handles_tiny_and_huge_activations(magnitude: float) -> None:
    # Unscaled E4M3 would flush 1e-4 to zero (smallest subnormal 2**-9) and saturate 1e3 at 448.
    ref, fp8 = _pair(Fp8Recipe())
    s = _run(ref, fp8, *_data(magnitude))
    assert s["out"] > 27 and s["wgrad"] > 23, s


def test_high_precision_wgrad() -> None:
    ref, fp8 = _pair(Fp8Recipe(fp8_wgrad=False))
    s = _run(ref, fp8, *_data())
    assert s["wgrad"] > 60 and s["out"] > 27, s  # dW = dy^T x in fp32 from unquantized operands
    assert "wgrad=high-precision" in repr(fp8)


def test_bias_grad_and_no_bias() -> None:
    ref, fp8 = _pair(Fp8Recipe())
    x, dy = _data()
    _run(ref, fp8, x, dy)
    assert sqnr_db(fp8.bias.grad, ref.bias.grad) > 100  # the bias gradient is summed in fp32
    ref2, fp8b = _pair(Fp8Recipe(), bias=False)
    assert _run(ref2, fp8b, x, dy)["out"] > 27


def test_autocast_bf16_and_dtypes() -> None:
    ref, fp8 = _pair(Fp8Recipe())
    x, dy = _data()
    xa = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(xa)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 64, 512)
    y.backward(dy.bfloat16())
    assert xa.grad.dtype == torch.float32 and fp8.weight.grad.dtype == torch.float32
    assert sqnr_db(y.float(), ref(x)) > 26
    # bf16 input without autocast: bf16 output and input gradient.
    xb = x.bfloat16().requires_grad_()
    yb = fp8(xb)
    yb.backward(dy.bfloat16())
    assert yb.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16


def test_input_is_saved_as_fp8() -> None:
    _, fp8 = _pair(Fp8Recipe())
    x = torch.randn(4, 64, 256, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fp8(x)
    fp8_saved = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert len(fp8_saved) == 1 and fp8_saved[0].numel() == x.numel() and fp8_saved[0].element_size() == 1
    assert not any(t.dtype == torch.float32 and t.numel() == x.numel() for t in saved)


def test_weight_quantized_once_per_step_and_invalidated_by_the_hook() -> None:
    _, fp8 = _pair(Fp8Recipe())
    opt = torch.optim.SGD(fp8.parameters(), lr=0.1)
    for _ in range(3):  # three micro-batches of one step
        fp8(torch.randn(2, 8, 256)).sum().backward()
    assert fp8.fp8.weight_quantizations == 1
    # An update through .data is invisible to autograd's version counter: only the hook can notice it.
    # (Negation keeps the amax, so the delayed weight scale of the previous step still fits.)
    with torch.no_grad():
        fp8.weight.data.neg_()
    fp8(torch.randn(2, 8, 256))
    assert fp8.fp8.weight_quantizations == 1
    fp8_optimizer_step(fp8)
    x = torch.randn(2, 8, 256)
    y = fp8(x)
    assert fp8.fp8.weight_quantizations == 2
    assert sqnr_db(y, nn.functional.linear(x, fp8.weight, fp8.bias)) > 27  # uses the negated weight
    opt.step()  # a regular in-place optimizer update bumps the version: re-quantized even without the hook
    fp8(x)
    assert fp8.fp8.weight_quantizations == 3


def test_print_shows_fp8_and_state_dict_keys_unchanged() -> None:
    ref, fp8 = _pair(Fp8Recipe(amax_history_len=16, amax_compute_algo="max"))
    text = repr(fp8)
    assert "Fp8Linear" in text and "E4M3 fwd / E5M2 bwd" in text and "delayed(history=16, algo=max" in text
    assert list(fp8.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]


def test_forced_backend_the_device_cannot_run_is_a_value_error_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--fp8-backend"):
        select_backend("hpu", "cpu")
    with pytest.raises(ValueError, match="--fp8-backend scaled_mm"):
        select_backend("scaled_mm", "meta")  # neither an sm89+ GPU nor the CPU
    _, fp8 = _pair(Fp8Recipe(backend="hpu"))
    with pytest.raises(ValueError, match="--fp8-backend"):
        fp8(torch.randn(2, 256))
    assert isinstance(select_backend("auto", "cpu"), EmulatedBackend)
    assert isinstance(select_backend("emulated", "cpu"), EmulatedBackend)
    # torch._scaled_mm runs on the CPU, so the CUDA backend (and its old name) is accepted there.
    assert isinstance(select_backend("scaled_mm", "cpu"), CudaScaledMmBackend)
    assert select_backend("cuda", "cpu") is select_backend("scaled_mm", "cpu")


@pytest.mark.parametrize("shape", [(32, 64, 48), (30, 60, 20), (7, 33, 100)])
def test_scaled_mm_layout_matches_emulation(shape: tuple[int, int, int]) -> None:
    """The CUDA backend's layout/padding/scale logic, run through torch._scaled_mm on CPU."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    e4, e5 = format_spec("e4m3"), format_spec("e5m2")
    sa, sb = torch.tensor(3.0), torch.tensor(0.25)
    a = quantize(torch.randn(m, k, generator=g), sa, e5)
    b = quantize(torch.randn(n, k, generator=g), sb, e4)
    cuda, emu = CudaScaledMmBackend(), EmulatedBackend()
    want = emu.gemm_nt(a, sa, b, sb, torch.float32)
    assert torch.allclose(cuda.gemm_nt(a, sa, b, sb, torch.float32), want, rtol=1e-5, atol=1e-5)
    # Transposed views, as dgrad and wgrad pass them.
    at, bt = a.t().contiguous(), b.t().contiguous()
    assert torch.allclose(cuda.gemm_nt(at.t(), sa, bt.t(), sb, torch.float32), want, rtol=1e-5, atol=1e-5)


def test_fp8_linear_with_scaled_mm_backend_matches_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    x, dy = _data()
    results = {}
    for backend in (EmulatedBackend(), CudaScaledMmBackend()):
        monkeypatch.setattr(layer_state, "select_backend", lambda choice, device, scaling=None, b=backend: b)
        _, fp8 = _pair(Fp8Recipe(), in_f=256, out_f=200)  # 200: not a multiple of 16 -> padding
        xa = x.clone().requires_grad_()
        y = fp8(xa)
        y.backward(dy[..., :200])
        results[backend.name] = (y, xa.grad, fp8.weight.grad)
    for got, want in zip(results["scaled_mm"], results["emulated"]):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def _per_call_run(recipe: Fp8Recipe, per_call: bool, fused: bool, column_scale: bool) -> list[torch.Tensor]:
    """Two optimizer steps of two micro-batches; outputs, input and weight gradients of every micro-batch."""
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, bias=False, recipe=recipe)
    layer.fp8.configure(weight_per_call=per_call, fused_quantization=fused)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    c = torch.rand(256, generator=g) + 0.5 if column_scale else None
    out = []
    for _ in range(2):
        for _ in range(2):
            x = (torch.randn(64, 256, generator=g) * 3).requires_grad_(True)
            y = layer(x, weight_column_scale=c)
            if per_call:  # nothing FP8 of the weight outlives the forward
                assert layer.fp8.weight_cache is None and kept_state_and_weight(y)[1] is None
            (y.float() * torch.linspace(-1, 1, 128)).square().sum().backward()
            out += [y.detach(), x.grad]
        out.append(layer.weight.grad.clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8_optimizer_step(layer)  # the delayed weight scale of step 2 is not the current amax's: a requantization
    return out  # with a recomputed scale would differ


@pytest.mark.parametrize("scaling,fused", [("delayed", False), ("delayed", True), ("tensorwise", False),
                                          ("rowwise", False), ("blockwise", True), ("mxfp8", False)])
@pytest.mark.parametrize("column_scale", [False, True], ids=["plain", "smooth-swiglu"])
def test_per_call_weight_requantized_in_backward_is_bitwise_the_cached_one(scaling, fused, column_scale) -> None:
    """ZeRO-3's mode (`Fp8LayerState.weight_per_call`): no FP8 weight kept from forward to backward; backward
    requantizes the weight with the forward's scale. Outputs and both gradients equal the cached path's bit for bit."""
    recipe = Fp8Recipe(scaling=scaling, amax_history_len=4)
    cached = _per_call_run(recipe, False, fused, column_scale)
    per_call = _per_call_run(recipe, True, fused, column_scale)
    for a, b in zip(cached, per_call):
        assert torch.equal(a, b)
