"""The devices a run can be projected on, each figure with its public source, and the achievable fractions.

Peaks are dense (no 2:4 sparsity) vendor figures. Bandwidths are per device and per direction. The achievable
fractions are set once, here, from public measurements named beside them; nothing in this file is fitted to the
figures the model is compared with (docs/performance.md, "Calibration"): those comparisons show how far off the
model is, they do not tune it.
"""
from __future__ import annotations

from dataclasses import dataclass

# Fraction of the dense peak a large GEMM reaches: torchao's float8 roofline script (torchao/testing/training/
# roofline_utils.py, "based on experimental observation with sample large inputs") uses 0.78 for H100; an H200
# ran a BF16 8192^3 matmul at ~790 of 989 TFLOP/s (0.80). The same fraction is used for FP8 and for Gaudi's
# matrix engine (measured best-shape matmuls: H200 FP8 0.73, Gaudi2 BF16 0.97, stas00/ml-engineering's table).
GEMM_EFFICIENCY = 0.78
# Fraction of peak HBM bandwidth a memory-bound kernel (pointwise, reduction, cast) reaches: torchao's roofline
# script uses 0.92 ("pointwise triton kernels ... about 2.2k GBPS" of 2.4 TB/s on its H100s).
MEMORY_EFFICIENCY = 0.92
# Fraction of the BF16 dense peak reached by fused causal attention: torch's SDPA runs FlashAttention-2 on H100,
# ~319 TFLOP/s forward (causal) and ~310 backward at head dim 128, sequence 4k, out of 989 (the FlashAttention-3
# paper's FA2 baseline, arXiv 2407.08608, figures 5-6).
ATTENTION_EFFICIENCY = 0.32
# Fraction of the link bandwidth a large NCCL/HCCL collective reaches (NCCL's all-reduce bus bandwidth on
# 8x H100 NVLink is ~360-480 of 450 GB/s per direction; 400 Gb/s InfiniBand/RoCE ~45-48 of 50 GB/s).
COMM_EFFICIENCY = 0.80


@dataclass(frozen=True)
class Device:
    """One accelerator as the step model sees it. TFLOP/s dense; GB/s = 1e9 bytes per second, per direction."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gbps: float
    memory_gib: float
    intra_node_gbps: float  # to the other devices of its node, all links together, one direction
    scale_out_gbps: float  # its share of the node's network to other nodes, one direction
    devices_per_node: int
    launch_us: float  # the shortest a kernel takes (launch and tail), whatever its size
    source: str
    note: str = ""

    def gemm_tflops(self, fp8: bool) -> float:
        return self.fp8_tflops if fp8 else self.bf16_tflops


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gbps=3350.0, memory_gib=80.0,
           intra_node_gbps=450.0, scale_out_gbps=50.0, devices_per_node=8, launch_us=2.0,
           source="NVIDIA H100 Tensor Core GPU datasheet (SXM: 1,979 BF16 / 3,958 FP8 TFLOP/s with sparsity, half "
                  "dense; 3.35 TB/s HBM3; NVLink 4, 900 GB/s bidirectional); DGX H100: 8x ConnectX-7 400 Gb/s, "
                  "one per GPU (DGX BasePOD reference architecture)"),
    Device("h200", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gbps=4800.0, memory_gib=141.0,
           intra_node_gbps=450.0, scale_out_gbps=50.0, devices_per_node=8, launch_us=2.0,
           source="NVIDIA H200 Tensor Core GPU datasheet (SXM: H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink "
                  "900 GB/s bidirectional); HGX H200 nodes with one 400 Gb/s NIC per GPU"),
    Device("b200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gbps=8000.0, memory_gib=180.0,
           intra_node_gbps=900.0, scale_out_gbps=50.0, devices_per_node=8, launch_us=2.0,
           source="NVIDIA Blackwell architecture technical brief (per GPU, dense: 2.25 PFLOP/s BF16, 4.5 PFLOP/s "
                  "FP8; 8 TB/s HBM3e, 180 GB usable; NVLink 5, 1.8 TB/s bidirectional); DGX B200: 8x ConnectX-7 "
                  "400 Gb/s, one per GPU (DGX BasePOD reference architecture)"),
    Device("gaudi2", bf16_tflops=432.0, fp8_tflops=865.0, hbm_gbps=2460.0, memory_gib=96.0,
           intra_node_gbps=262.5, scale_out_gbps=37.5, devices_per_node=8, launch_us=5.0,
           source="Intel Gaudi 3 Hot Chips 2024 slides, Gaudi2 column (432 BF16 TFLOP/s, 96 GB HBM2e at 2.46 TB/s); "
                  "FP8 865 TFLOP/s: stas00/ml-engineering's accelerator table; HLS-Gaudi2: 24x 100 GbE RoCE on "
                  "chip, 21 to the 7 peers of the node (3 each), 3 to scale-out",
           note="GEMMs run on the matrix engines (MME); pointwise work on the TPC vector cores, which the model "
                "charges at HBM bandwidth like a GPU kernel. Its graph compiler fuses on its own: inductor's "
                "fused kernels stand in for its fusion decisions (docs/performance.md, the model's rules). E4M3's "
                "maximum is 240 there (the speed is unaffected)."),
    Device("gaudi3", bf16_tflops=1835.0, fp8_tflops=1835.0, hbm_gbps=3670.0, memory_gib=128.0,
           intra_node_gbps=525.0, scale_out_gbps=75.0, devices_per_node=8, launch_us=5.0,
           source="Intel Gaudi 3 Hot Chips 2024 slides (MME 1,835 TFLOP/s for both BF16 and FP8, 128 GB HBM2e at "
                  "3.67 TB/s); Intel Gaudi docs, Network Configuration: 24x 200 GbE on chip, 21 scale-up ports "
                  "(525 GB/s one way), 3 scale-out (75 GB/s one way)",
           note="FP8 GEMMs run at the BF16 rate: FP8 saves memory traffic only."),
)}


def device(name: str) -> Device:
    """The device called `name` (case-insensitive); ValueError naming the known ones otherwise."""
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"--project-on: unknown device {name!r}; one of {', '.join(DEVICES)}")
    return DEVICES[key]
