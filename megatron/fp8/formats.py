"""FP8 element formats and their ranges.

Two OCP formats are used: E4M3 (`torch.float8_e4m3fn`, max 448, no infinities: a plain cast
saturates even inf to 448) for forward operands, and E5M2 (`torch.float8_e5m2`, max 57344, has inf:
a plain cast of a too-large value overflows to inf) for gradients. The largest finite value is a
property of the *backend*, not of the dtype alone: Gaudi2 implements E4M3 with a maximum of 240.
So every place that needs a maximum asks `Fp8FormatSpec.max` of a spec built by `format_spec`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Fp8Dtype(str, enum.Enum):
    E4M3 = "e4m3"
    E5M2 = "e5m2"


@dataclass(frozen=True)
class Fp8FormatSpec:
    """One FP8 format as a given backend implements it."""

    name: Fp8Dtype
    torch_dtype: torch.dtype
    max: float  # largest finite magnitude
    min_normal: float  # smallest positive normal
    min_subnormal: float  # smallest positive subnormal; values below ~half of it flush to zero
    mantissa_bits: int


_OCP = {
    Fp8Dtype.E4M3: Fp8FormatSpec(Fp8Dtype.E4M3, torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, 3),
    Fp8Dtype.E5M2: Fp8FormatSpec(Fp8Dtype.E5M2, torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, 2),
}

# Gaudi2 hardware clamps E4M3 at 240 (its E4M3 reserves the top exponent like IEEE); E5M2 is OCP.
_GAUDI2_E4M3_MAX = 240.0


def format_backend_of(device: torch.device | str) -> str:
    """Whose FP8 limits apply to tensors on `device`: "hpu" (Gaudi2's E4M3 maximum of 240) or "cpu" (OCP: 448,
    as on CUDA). The one place that maps a device to its formats: Fp8AdamW's moments and the emulated GEMM backend
    take it from their tensors' device; the hardware backends declare theirs (`backends.HpuBackend`: "hpu",
    `CudaScaledMmBackend`: OCP), which agrees with it on the devices they run on."""
    return "hpu" if torch.device(device).type == "hpu" else "cpu"


def format_spec(dtype: Fp8Dtype | str, backend: str = "cpu") -> Fp8FormatSpec:
    """The spec of `dtype` on `backend` ("cpu", "cuda", "hpu"/"gaudi2", "emulated")."""
    if not isinstance(dtype, Fp8Dtype):  # Fp8Dtype(member) inside a graph dynamo traces fails on torch 2.11
        dtype = Fp8Dtype(dtype)
    spec = _OCP[dtype]
    if backend in ("hpu", "gaudi2") and dtype is Fp8Dtype.E4M3:
        spec = Fp8FormatSpec(spec.name, spec.torch_dtype, _GAUDI2_E4M3_MAX, spec.min_normal,
                             spec.min_subnormal, spec.mantissa_bits)
    return spec
