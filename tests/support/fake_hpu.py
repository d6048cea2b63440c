"""Stand-ins for Gaudi's FP8 ops on CPU tensors, implementing their documented semantics.

    torch.ops.hpu.cast_to_fp8_v2(input, scale, stochastic_rounding, is_amax, dtype) -> (fp8, amax)
        cast(input * scale) to dtype (scale multiplies; None = 1), saturating at the format's Gaudi2 maximum
    torch.ops.hpu.fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv, B_scale_inv, bias, accumulate)
        op(A) @ op(B) with op = transpose when its flag is set, each operand multiplied by its scale-inverse
        (dequantization factor), FP32 accumulation, one rounding to out_dtype, + bias

The fakes are strict where the hardware is: FP8 operands only, 2-D, contiguous (layouts are expressed through
the transpose flags, not strided views), and an E4M3 value beyond Gaudi2's 240 is an error (it would be inf
there), so a backend that forgot to clamp at the backend's maximum fails. `calls` records every call.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

from megatron.fp8.formats import format_spec
from megatron.fp8.quantize import quantize

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class FakeHpuOps:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def cast_to_fp8_v2(self, x, scale=None, stochastic_rounding=False, is_amax=False, dtype=torch.float8_e4m3fn):
        self.calls.append("cast_to_fp8_v2")
        assert dtype in FP8, dtype
        spec = format_spec("e4m3" if dtype == torch.float8_e4m3fn else "e5m2", "hpu")
        y = x.float() if scale is None else x.float() * scale.float()
        finite = y[torch.isfinite(y)]
        assert finite.numel() == 0 or float(finite.abs().max()) <= spec.max, \
            f"value beyond the Gaudi2 maximum {spec.max} reached the cast"
        q = quantize(y, torch.ones((), dtype=torch.float32), spec, stochastic_rounding)
        amax = y.abs().amax() if is_amax else torch.zeros((), dtype=torch.float32)
        return q, amax

    def fp8_gemm_v2(self, a, trans_a, b, trans_b, d, out_dtype, a_scale_inv=None, b_scale_inv=None, bias=None,
                    accumulate=False):
        self.calls.append("fp8_gemm_v2")
        for t in (a, b):
            assert t.dtype in FP8 and t.dim() == 2 and t.is_contiguous(), (t.dtype, t.shape, t.stride())
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
