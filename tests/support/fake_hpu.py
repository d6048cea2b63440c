"""Stand-ins for Gaudi's FP8 ops on CPU tensors, implementing their documented semantics.

    torch.ops.hpu.cast_to_fp8_v2(input, scale, stochastic_rounding, is_amax, dtype) -> (fp8, amax)
        cast(input * scale) to dtype (scale multiplies; None = 1), saturating at the format's Gaudi2 maximum
    torch.ops.hpu.fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv, B_scale_inv, bias, accumulate)
        op(A) @ op(B) with op = transpose when its flag is set, each operand multiplied by its scale-inverse
        (dequantization factor), FP32 accumulation, one rounding to out_dtype, + bias

Written from Habana's documented semantics, not from this project's quantization code: rounding is torch's own
FP8 cast (nearest-even) or a stochastic choice between the two neighbouring FP8 values, and the limits are Gaudi2's
(E4M3 240, E5M2 57344). The fakes are strict where the hardware is: FP8 operands only, 2-D, row-major or a
transposed view, 0-d FP32 scale inverses, and a value beyond Gaudi2's maximum is an error (it would be inf there),
so a backend that forgot to clamp at the backend's maximum fails. `calls` records every call.

`select_as_hpu` lets megatron's own backend selection run on the CPU tensors the stand-ins compute on, as if they
were the hpu tensors they stand for.
"""
from __future__ import annotations

import functools
import importlib.machinery
import sys
import types

import torch


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Gaudi2's limits, from Habana's documentation (not from this project's format tables): E4M3 reserves its top
# exponent, so its largest value is 240; E5M2 is IEEE-like, largest 57344.
GAUDI2_MAX = {torch.float8_e4m3fn: 240.0, torch.float8_e5m2: 57344.0}


def _neighbours(y: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The representable values of `dtype` just below and just above |y| (equal when |y| is representable):
    torch's round-to-nearest-even cast, then one step of the magnitude's bit pattern (sign-magnitude codes)."""
    a = y.abs()
    near = a.to(dtype)
    code = near.view(torch.uint8).to(torch.int16)
    step = torch.where(near.float() > a, code - 1, torch.where(near.float() < a, code + 1, code))
    other = step.clamp(0, 127).to(torch.uint8).view(dtype).float()
    return torch.minimum(near.float(), other), torch.maximum(near.float(), other)


class FakeHpuOps:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def cast_to_fp8_v2(self, x, scale=None, stochastic_rounding=False, is_amax=False, dtype=torch.float8_e4m3fn):
        """Round x * scale to `dtype` (nearest-even, or stochastically between the two neighbours); any value beyond
        Gaudi2's maximum is an error here, as it would be inf on the device."""
        self.calls.append("cast_to_fp8_v2")
        assert dtype in FP8, dtype
        y = x.float() if scale is None else x.float() * scale.float()
        finite = y[torch.isfinite(y)]
        assert finite.numel() == 0 or float(finite.abs().max()) <= GAUDI2_MAX[dtype], \
            f"value beyond the Gaudi2 maximum {GAUDI2_MAX[dtype]} reached the cast"
        if stochastic_rounding:
            lo, hi = _neighbours(y, dtype)
            up = torch.rand(y.shape) * (hi - lo) < (y.abs() - lo)
            q = (torch.where(up, hi, lo) * torch.sign(y)).to(dtype)
        else:
            q = y.to(dtype)
        amax = y.abs().amax() if is_amax else torch.zeros((), dtype=torch.float32)
        return q, amax

    def fp8_gemm_v2(self, a, trans_a, b, trans_b, d, out_dtype, a_scale_inv=None, b_scale_inv=None, bias=None,
                    accumulate=False):
        self.calls.append("fp8_gemm_v2")
        for t in (a, b):  # row-major or its transposed view, as the real op takes them (other strides: an error)
            assert t.dtype in FP8 and t.dim() == 2 and (t.is_contiguous() or t.t().is_contiguous()), \
                (t.dtype, t.shape, t.stride())
        assert d is None and not accumulate
        a_ = (a.t() if trans_a else a).float()
        b_ = (b.t() if trans_b else b).float()
        for inv in (a_scale_inv, b_scale_inv):  # 0-d fp32, as the paper's reference code passes them
            assert inv is None or (inv.dim() == 0 and inv.dtype == torch.float32), inv
        if a_scale_inv is not None:
            a_ = a_ * a_scale_inv
        if b_scale_inv is not None:
            b_ = b_ * b_scale_inv
        out = a_ @ b_
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)


def install(monkeypatch) -> FakeHpuOps:
    """Put the fakes where `HpuBackend` looks: `habana_frameworks.torch` importable, `torch.ops.hpu.*`."""
    ops = FakeHpuOps()
    package = types.ModuleType("habana_frameworks")
    sub = types.ModuleType("habana_frameworks.torch")
    for module in (package, sub):  # importable and inspectable like a real package, but no device behind it
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=True)
    package.torch = sub
    monkeypatch.setitem(sys.modules, "habana_frameworks", package)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch", sub)
    monkeypatch.setattr(torch.ops, "hpu", ops, raising=False)
    return ops


def select_as_hpu(monkeypatch) -> list[str]:
    """Where the FP8 layers select their backend (`megatron.fp8.layer_state.select_backend`), call megatron's real
    `select_backend` with `torch.device("hpu")` in place of the CPU: the choice (auto or forced), the Gaudi recipe
    check and the construction of `HpuBackend` (which imports habana_frameworks.torch: call `install` first) are
    megatron's, and only the device label is not a Gaudi's. Returns the name of each backend chosen, in call order.
    The made backends are cached afresh for the test, so the HpuBackend made over the stand-ins does not outlive it."""
    from megatron.fp8 import backends, layer_state

    chosen: list[str] = []
    real = backends.select_backend

    def select(choice, device, scaling="delayed"):
        device = torch.device(device)
        backend = real(choice, torch.device("hpu") if device.type == "cpu" else device, scaling)
        chosen.append(backend.name)
        return backend

    monkeypatch.setattr(backends, "_make", functools.lru_cache(maxsize=None)(backends._make.__wrapped__))
    monkeypatch.setattr(layer_state, "select_backend", select)
    return chosen
