"""How the emulated FP8 backend multiplies on CPU: FP32 GEMMs that round once, or BF16 GEMMs where they are faster.

The emulated GEMMs take FP8 values, which BF16 holds exactly; products of two BF16 values are exact in FP32, and a
CPU BF16 GEMM (oneDNN) accumulates them in FP32, as the tensor cores do. torch has no CPU BF16 GEMM with an FP32
output, but `addmm`'s `alpha` multiplies the FP32 accumulator before the output is rounded to BF16: with
alpha = 1 / (s_a s_b) that is the hardware's single rounding (`scaled_bf16_gemm`; alpha is a Python number, so the
scales are read, and a compiled graph calls it as the op `megatron::scaled_bf16_gemm`). Two modes:

- `exact`: every GEMM gives the hardware's single rounding, bitwise the same eager and traced. FP32 GEMMs, whose
  output is scaled and rounded once; a BF16 GEMM only where it gives the same number: a BF16 output with
  power-of-two scales (dividing by a power of two is exact), on a CPU with fast BF16 GEMMs (`megatron.cpu_bf16`).
- `bf16`: in `--bf16` runs every FP8 GEMM is a BF16 GEMM, and the FP8 values are kept in BF16 (half the bytes of
  FP32). Forward and dgrad (BF16 outputs) are the single rounding at any scales, eager and compiled alike; what
  differs from `exact` is the summation order of the BF16 kernel. Wgrad's FP32 output keeps 8 significant bits
  instead of 24 (the scaled accumulator rounded to BF16), which is the precision of the BF16 run's own wgrad
  (autocast's BF16 GEMM returns BF16 too). Runs without `--bf16` keep FP32 GEMMs.

`auto` (the default) is `bf16` on CPUs with AMX-BF16 and on AMD CPUs with AVX512-BF16 (the `amx_bf16` CPU flag, or
`avx512_bf16` with vendor AuthenticAMD; oneDNN not capped below them by `ONEDNN_MAX_CPU_ISA`): a BF16 GEMM runs there
4-10x faster than FP32 (4096 x 256 x 704 on 2 cores, torch 2.13: 0.53 vs 4.98 ms on an Intel Xeon with AMX, 1.53 vs
8.81 ms on an AMD EPYC with AVX512-BF16; capped at AVX512_CORE the EPYC's BF16 GEMM took FP32's time), and the FP32
GEMMs made the FP8 step slower than BF16's. On other CPUs, `exact`: on an Intel Xeon with AVX512-BF16 but no AMX,
2048^3 in BF16 took 1.41-1.56x FP32's time (docs/performance.md). `MEGATRON_CPU_FP8_GEMM` = auto | exact | bf16
overrides it (`bf16` on a CPU without fast BF16 GEMMs runs torch's slow BF16 kernels). Decided once, at import: a
module constant, which compiled graphs read without a graph break. `describe()` is the start-up log line.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
from typing import Iterator

import torch

from megatron.cpu_bf16 import cpu_flags, decided_at_import, emulates_bf16_gemms, env_choice, onednn_isa_cap

ENV_VAR = "MEGATRON_CPU_FP8_GEMM"
CHOICES = ("auto", "exact", "bf16")


class CpuFp8GemmConfigError(ValueError):
    """`MEGATRON_CPU_FP8_GEMM` holds a value we do not know."""


# oneDNN ISA caps that keep its BF16 dot-product kernels (AVX512-BF16, AMX-BF16); lower caps run BF16 GEMMs at FP32's
# speed (AVX512_CORE) or far slower (AVX2).
_BF16_CAP_MARKS = ("BF16", "FP16", "AMX", "AVX10")


def cpu_vendor() -> str:
    """The CPU's `vendor_id` ("GenuineIntel", "AuthenticAMD"), "" where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def fast_bf16_gemm_reason() -> str | None:
    """Why this CPU's BF16 GEMMs are not faster than its FP32 ones, or None where they are: AMX-BF16, or AVX512-BF16
    on an AMD CPU (measured 4-6x FP32's speed on an AMD EPYC; 0.64-0.71x on an Intel Xeon without AMX)."""
    flags = cpu_flags()
    if "amx_bf16" not in flags and not ("avx512_bf16" in flags and cpu_vendor() == "AuthenticAMD"):
        return "no AMX-BF16 on this CPU, nor AVX512-BF16 on an AMD CPU"
    cap = onednn_isa_cap()
    if cap is not None and not any(mark in cap for mark in _BF16_CAP_MARKS):
        return f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off its BF16 kernels"
    return None


def decide_mode() -> str:
    """"exact" or "bf16" from `MEGATRON_CPU_FP8_GEMM` and the CPU; raises on a value we do not know."""
    return env_choice(ENV_VAR, CHOICES, CpuFp8GemmConfigError,
                      "exact (FP32 GEMMs, one rounding) or bf16 (BF16 GEMMs, docs/performance.md)",
                      lambda: "bf16" if fast_bf16_gemm_reason() is None else "exact")


_MODE = decided_at_import(decide_mode, CpuFp8GemmConfigError)  # reported by mode() where bad
_forced: str | None = None  # use_mode()


def mode() -> str:
    """"exact" or "bf16": how the emulated FP8 GEMMs run on CPU in this process."""
    if _forced is not None:
        return _forced
    return _MODE if _MODE is not None else decide_mode()


@contextlib.contextmanager
def use_mode(forced: str) -> Iterator[None]:
    """Run the emulated FP8 GEMMs as `forced` inside the block, whatever this CPU's default: how a benchmark times
    both modes side by side and a test checks both on any CPU."""
    global _forced
    if forced not in ("exact", "bf16"):
        raise ValueError(f"mode must be exact or bf16, got {forced!r}")
    previous, _forced = _forced, forced
    try:
        yield
    finally:
        _forced = previous


def bf16_gemm(a: torch.Tensor, out_dtype: torch.dtype, run_dtype: torch.dtype | None, pow2: bool) -> bool:
    """Whether an emulated FP8 GEMM of operand `a` with output `out_dtype` in a run computing in `run_dtype` (the
    layer's input dtype; None: unknown, taken as `out_dtype`) is a BF16 GEMM (module docstring)."""
    if a.device.type == "cpu" and mode() == "bf16":
        return (run_dtype or out_dtype) == torch.bfloat16
    return out_dtype == torch.bfloat16 and pow2 and not (a.device.type == "cpu" and emulates_bf16_gemms())


def _fp32(x: float) -> float:
    """`x` rounded to the nearest FP32 number (inf beyond its range, NaN kept)."""
    return ctypes.c_float(x).value


def dequantization_factor(a_scale: torch.Tensor, b_scale: torch.Tensor) -> float:
    """1 / (s_a s_b) in FP32 arithmetic, as a Python number: the product of two FP32 numbers is exact in a double and
    so is its rounding to FP32; the double's reciprocal rounded to FP32 is the FP32 reciprocal (53 >= 2 * 24 + 2
    bits: the double rounding is innocuous). A NaN scale (the non-finite guard) gives NaN, a zero product inf."""
    product = _fp32(a_scale.item() * b_scale.item())
    return _fp32(1.0 / product) if product != 0.0 else math.inf


_ZERO = torch.zeros((), dtype=torch.bfloat16)  # addmm's `self`, broadcast and not read (beta = 0)


def _scaled_bf16_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    return torch.addmm(_ZERO, a, b.t(), beta=0, alpha=dequantization_factor(a_scale, b_scale))


def _scaled_bf16_gemm_shape(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor
                            ) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]))


# The op compiled graphs call (a CPU kernel and a shape function). Registered through `torch.library.Library`, not
# `torch.library.custom_op`, whose Python wrapping cost ~15 us more per call (~20 us for a small BF16 GEMM itself).
# `flexible_layout`: the op takes its operands with any strides (addmm does), so inductor hands it a transposed view
# of a buffer it wrote, as eager does. Without it, each operand had to keep its traced strides: backward wrote the
# cast of dy twice, once for dgrad and once more, transposed in name only, for wgrad (the same bytes).
# Inductor's cache key does not see an op's definition: a change here changes partition.py's `uuid` too.
_LIBRARY = torch.library.Library("megatron", "FRAGMENT")
_LIBRARY.define("scaled_bf16_gemm(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale) -> Tensor",
                tags=(torch.Tag.flexible_layout,))
_LIBRARY.impl("scaled_bf16_gemm", _scaled_bf16_gemm, "CPU")
torch.library.register_fake("megatron::scaled_bf16_gemm", _scaled_bf16_gemm_shape, lib=_LIBRARY)


def scaled_bf16_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b^T` of two BF16 CPU operands holding FP8 values, the GEMM's FP32 accumulator multiplied by
    1 / (s_a s_b) inside the GEMM (addmm's `alpha`, applied before the output is rounded) and rounded once to BF16:
    the tensor cores' single rounding at any scales, with no pass over the output of its own. An FP32 `out_dtype`
    (wgrad) takes that BF16 result to FP32 (traced, in the kernel that reads it). The scales are read as numbers:
    traced into a compiled graph, the call is the custom op `megatron::scaled_bf16_gemm`, which the graph calls as
    it calls a GEMM (the same bits as eager)."""
    if torch.compiler.is_compiling():
        out = torch.ops.megatron.scaled_bf16_gemm.default(a, b, a_scale, b_scale)
    else:
        out = _scaled_bf16_gemm(a, b, a_scale, b_scale)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def values_dtype() -> torch.dtype:
    """The dtype the emulated backend keeps FP8 values in for its GEMMs (both hold every FP8 value exactly)."""
    return torch.bfloat16 if mode() == "bf16" else torch.float32


def describe() -> str:
    """The start-up line: the mode and why."""
    chosen = mode()
    forced = os.environ.get(ENV_VAR, "").strip()
    why = f"{ENV_VAR}={forced}" if forced and forced.lower() != "auto" else (
        "this CPU has fast BF16 GEMMs" if chosen == "bf16" else fast_bf16_gemm_reason())
    if chosen == "bf16":
        return (f"FP8 GEMMs (emulated on CPU): BF16 GEMMs in --bf16 runs ({why}; their weight gradients keep 8 "
                f"significant bits, docs/performance.md; {ENV_VAR}=exact runs FP32 GEMMs)")
    return (f"FP8 GEMMs (emulated on CPU): FP32 GEMMs rounded once ({why}; {ENV_VAR}=bf16 runs BF16 GEMMs, "
            "docs/performance.md)")
