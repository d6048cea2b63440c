"""One kernel of a training step as the model sees it, and the time it takes on a device (a roofline).

A kernel is what one launch does: its class, its floating-point work, the bytes it must read and write, and, for a
GEMM, whether its operands are FP8. Its time on a device is the larger of its compute time and its memory time,
and never less than the device's launch floor:

    GEMM        max(flops / (peak(dtype) * GEMM_EFFICIENCY), bytes / (hbm * MEMORY_EFFICIENCY), launch)
    attention   max(flops / (bf16 peak * ATTENTION_EFFICIENCY), bytes / (hbm * MEMORY_EFFICIENCY), launch)
    the rest    max(bytes / (hbm * MEMORY_EFFICIENCY), launch)

Kernels of the same kind across a model repeat with the same size, so a list of `Kernel`s with a `count` each is
the whole description of a step's compute.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from megatron.perf.hardware import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, MEMORY_EFFICIENCY, Device


class KernelClass(str, enum.Enum):
    GEMM = "GEMM"
    ATTENTION = "attention"
    QUANTIZATION = "FP8 quantization"
    POINTWISE = "other pointwise"
    OPTIMIZER = "optimizer"
    COMMUNICATION = "communication"
    BUBBLE = "pipeline bubble"


@dataclass(frozen=True)
class Kernel:
    """`count` launches of one kernel. `flops`, `bytes` per launch. `fp8`: a GEMM on FP8 operands."""

    name: str
    kind: KernelClass
    flops: float = 0.0
    bytes: float = 0.0
    fp8: bool = False
    count: float = 1.0
    where: str = ""  # forward, backward, step (once per optimizer step)

    def seconds(self, dev: Device) -> float:
        """Time of all `count` launches on `dev` (the roofline of the module docstring)."""
        memory = self.bytes / (dev.hbm_gbps * 1e9 * MEMORY_EFFICIENCY)
        if self.kind is KernelClass.GEMM:
            compute = self.flops / (dev.gemm_tflops(self.fp8) * 1e12 * GEMM_EFFICIENCY)
        elif self.kind is KernelClass.ATTENTION:
            compute = self.flops / (dev.bf16_tflops * 1e12 * ATTENTION_EFFICIENCY)
        else:
            compute = 0.0
        return self.count * max(compute, memory, dev.launch_us * 1e-6)

    def times(self, n: float) -> "Kernel":
        return replace(self, count=self.count * n)


def seconds_by_class(kernels: list[Kernel], dev: Device) -> dict[KernelClass, float]:
    """Projected seconds per kernel class (every class present, zero where none)."""
    out = {k: 0.0 for k in KernelClass}
    for k in kernels:
        out[k.kind] += k.seconds(dev)
    return out
