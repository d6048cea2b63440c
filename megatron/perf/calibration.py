"""Every published or measured figure the step model can be held against, and the model's prediction for each.

Nothing here is fitted: the hardware figures and achievable fractions are those of hardware.py, set once; each
row runs the same procedure as a user's projection (extract.py at the row's shapes, step.py for whole steps) and
shows the residual. `bench/project.py --calibrate` prints the table that docs/performance.md holds, and the
summary printed with every projection (`CALIBRATION_SUMMARY`) is checked against it by a test.

The configurations of the published runs, as their sources give them (unknowns are said in `setup`):
- the paper (Fishman et al., ICLR 2025), 8 Gaudi2, Llama2-7B: sequence 4096, micro-batch 1, ZeRO-1 over 8, BF16
  weights, selective recompute (HabanaAI/Megatron-DeepSpeed's README recipe for this model; the paper's table does
  not state its global batch: 1024, the 7B run's, is assumed);
- torchao + torchtitan, 8 H100, Llama3-8B: sequence 8192, local batch 1, FSDP2 (ZeRO-3 over 8, BF16 all-gathers,
  FP8 all-gathers for tensorwise), torch.compile, per-op selective activation checkpointing (not modelled: no
  recompute);
- Megatron-Bridge 25.11, 8 H100, Llama3-8B, FP8 current scaling: global batch 128, micro-batch 1, sequence 8192,
  data parallel 8, 5 layers fully recomputed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.config import ModelConfig
from megatron.perf.comm import ShardedPeer
from megatron.perf.extract import BlockKernels, extract_block, extract_linear
from megatron.perf.hardware import device
from megatron.perf.kernels import Kernel
from megatron.perf.step import project

# Filled from `bench/project.py --calibrate` (docs/performance.md, "Calibration"); a test recomputes the table.
CALIBRATION_SUMMARY = "calibration: ratios within 19%, absolutes within 67% (docs/performance.md#calibration)"

LLAMA2_7B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 "
             "--num-key-value-heads 32 --seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000")
LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
             "--num-key-value-heads 8 --seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256")
COMMON = ("--swiglu --normalization RMSNorm --use-rotary-position-embeddings --untie-embeddings-and-output-weights "
          "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --lr 1e-4 --train-iters 1000 --mock-data "
          "--make-vocab-size-divisible-by 128 --bf16 --micro-batch-size 1")
DELAYED_SMOOTH = ("--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max "
                  "--fp8-power-of-two-scales --smooth-swiglu")
TENSORWISE = "--fp8-format hybrid --fp8-recipe tensorwise"
ROWWISE = "--fp8-format e4m3 --fp8-recipe rowwise"  # ours: its FP8 layers are graph breaks in a compiled block
# The four linears of a Llama2-7B block (in, out), and the H200 BF16 nn.Linear forward + backward at 8192 tokens
# (docs/performance.md, "The H200 check": bench/bench_fp8_linear.py, torch 2.11, 2026-11-30), milliseconds.
LINEARS = {"qkv": (4096, 12288), "proj": (4096, 4096), "fc1": (4096, 22016), "fc2": (11008, 4096)}
H200_BF16_LINEAR_MS = {"qkv": 3.2, "proj": 1.2, "fc1": 5.6, "fc2": 2.9}
LINEAR_TOKENS = 8192


@dataclass(frozen=True)
class Row:
    figure: str
    observed: float
    predicted: float
    ratio: bool  # a ratio (FP8 / BF16 speed) rather than an absolute
    source: str

    @property
    def residual(self) -> float:
        """predicted / observed - 1."""
        return self.predicted / self.observed - 1.0


# How a row's flags become a configuration: `megatron.arguments.parse_config`, handed in by the caller (the
# arguments floor sits above this package).
Parse = Callable[..., Any]


def _config(parse: Parse, flags: str, world: int):
    return parse(flags.split(), world_size=world)


@functools.cache
def _bf16_linear(in_features: int, out_features: int) -> tuple[Kernel, ...]:
    """A BF16 linear's kernels at LINEAR_TOKENS tokens: read once for the H200 rows and the H100 roofline rows."""
    return extract_linear(in_features, out_features, LINEAR_TOKENS, None).kernels


@functools.cache
def _bf16_block(model: ModelConfig, micro_batch_size: int) -> BlockKernels:
    """A BF16 block's kernels: read once for every run row of the same model."""
    return extract_block(model, None, micro_batch_size)


def linear_rows() -> list[Row]:
    h200 = device("h200")
    rows = []
    for name, (k, n) in LINEARS.items():
        kernels = _bf16_linear(k, n)
        predicted = sum(x.seconds(h200) for x in kernels) * 1e3
        rows.append(Row(f"H200 BF16 nn.Linear fwd+bwd, 7b.{name} {k}x{n}, {LINEAR_TOKENS} tokens (ms)",
                        H200_BF16_LINEAR_MS[name], predicted, False,
                        "docs/performance.md, the H200 check (bench_fp8_linear.py)"))
    return rows


def torchao_roofline_rows() -> list[Row]:
    """torchao's roofline (its own functions, H100, fused casts) against ours through the extractor: the FP8 /
    BF16 speed-up of one linear with torchao's Float8Linear (tensorwise), per 7B linear shape."""
    from torchao.testing.training import roofline_utils as ao

    h100 = device("h100")
    rows = []
    for name, (k, n) in LINEARS.items():
        m = LINEAR_TOKENS
        bf16 = float(ao.get_gemm_time_sympy(m, k, n, torch.bfloat16, None, None, "NVIDIA H100"))
        fp8 = float(ao.get_gemm_time_sympy(m, k, n, torch.float8_e4m3fn, "tensorwise", None, "NVIDIA H100")
                    + ao.get_float8_mem_sympy(m, k, n, "tensorwise", None, True, "NVIDIA H100"))
        ours_bf16 = sum(x.seconds(h100) for x in _bf16_linear(k, n))
        ours_fp8 = sum(x.seconds(h100) for x in extract_linear(k, n, m, None, torchao="tensorwise").kernels)
        rows.append(Row(f"torchao Float8Linear tensorwise speed-up, 7b.{name}, H100, torchao's roofline",
                        bf16 / fp8, ours_bf16 / ours_fp8, True, "torchao/testing/training/roofline_utils.py"))
    return rows


def _throughput(parse: Parse, flags: str, world: int, dev: str, fp8_flags: Optional[str] = None,
                torchao: Optional[str] = None, peer: Optional[ShardedPeer] = None) -> float:
    """Projected tokens/s per device of the run `flags` (+ `fp8_flags`, or torchao's recipe in the blocks)."""

    base = _config(parse, flags, world)
    mb = base.training.micro_batch_size
    if fp8_flags:
        cfg = _config(parse, f"{flags} {fp8_flags}", world)
        block = extract_block(cfg.model, cfg.fp8, mb)
        return project(cfg, device(dev), block, _bf16_block(base.model, mb),
                       peer=peer).tokens_per_second_per_device
    # torchao's blocks are BF16 blocks with other linears: projected as the BF16 run with those kernels
    block = extract_block(base.model, None, mb, torchao=torchao) if torchao else _bf16_block(base.model, mb)
    return project(base, device(dev), None, block, peer=peer).tokens_per_second_per_device


def run_rows(parse: Parse) -> list[Row]:
    paper = (f"{COMMON} {LLAMA2_7B} --global-batch-size 1024 --params-dtype bf16 --recompute-activations "
             "--deepspeed --zero-stage 1")
    g_bf16 = _throughput(parse, paper, 8, "gaudi2") * 8 / 4096
    g_fp8 = _throughput(parse, paper, 8, "gaudi2", DELAYED_SMOOTH) * 8 / 4096
    titan = f"{COMMON} {LLAMA3_8B} --global-batch-size 8 --params-dtype bf16 --deepspeed --zero-stage 3"
    # FSDP2 as torchtitan runs it: BF16 weights gathered (FP8 with torchao's float8 all-gather), FP32 gradients
    # reduce-scattered, every block but the last resharded after forward (regathered for backward)
    reshard = 31 / 32
    t_bf16 = _throughput(parse, titan, 8, "h100", peer=ShardedPeer(2.0, 4.0, reshard))
    t_tw = _throughput(parse, titan, 8, "h100", torchao="tensorwise", peer=ShardedPeer(1.0, 4.0, reshard))
    t_rw = _throughput(parse, titan, 8, "h100", torchao="rowwise", peer=ShardedPeer(2.0, 4.0, reshard))
    bridge = (f"{COMMON} {LLAMA3_8B} --global-batch-size 128 --params-dtype bf16 --recompute-granularity full "
              "--recompute-method block --recompute-num-layers 5 --deepspeed --zero-stage 1")
    b_fp8 = _throughput(parse, bridge, 8, "h100", TENSORWISE)
    paper_src = "Fishman et al. 2025 (8 Gaudi2)"
    ao_src = "torchao float8 README (torchtitan, 8 H100)"
    return [Row("Llama2-7B BF16, 8 Gaudi2 (samples/s)", 12.65, g_bf16, False, paper_src),
            Row("Llama2-7B FP8 + Smooth-SwiGLU, 8 Gaudi2 (samples/s)", 16.89, g_fp8, False, paper_src),
            Row("Llama2-7B FP8 / BF16, 8 Gaudi2", 16.89 / 12.65, g_fp8 / g_bf16, True, paper_src),
            Row("Llama3-8B BF16, 8 H100, FSDP2 (tokens/s/device)", 6150.0, t_bf16, False, ao_src),
            Row("Llama3-8B torchao tensorwise + FP8 all-gather / BF16, 8 H100", 7689.5 / 6150.0, t_tw / t_bf16,
                True, ao_src),
            Row("Llama3-8B torchao rowwise / BF16, 8 H100", 6768.0 / 6150.0, t_rw / t_bf16, True, ao_src),
            Row("Llama3-8B FP8 current scaling, 8 H100, Megatron-Bridge (tokens/s/device)", 14451.0, b_fp8, False,
                "Megatron-Bridge performance summary, 25.11")]


def calibration_rows(parse: Parse) -> list[Row]:
    """Every row; `parse` is `megatron.arguments.parse_config`."""
    return linear_rows() + torchao_roofline_rows() + run_rows(parse)


def summary(rows: list[Row]) -> str:
    """The worst residual of the ratios and of the absolutes, in the words every projection prints."""
    worst = {kind: max((abs(r.residual) for r in rows if r.ratio is kind), default=0.0) for kind in (True, False)}
    return (f"calibration: ratios within {100 * worst[True]:.0f}%, absolutes within {100 * worst[False]:.0f}% "
            "(docs/performance.md#calibration)")
