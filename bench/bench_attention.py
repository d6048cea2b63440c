"""Benchmark: causal attention under CPU BF16 autocast, torch's BF16 kernel vs FP32 on BF16-rounded operands.

What `megatron/cpu_bf16.py` chooses for attention that trains (`MEGATRON_CPU_BF16_ATTENTION`): both variants run
through the autocast kernel the training step uses (`cpu_bf16.use_mode("native")` / `"fp32"`), forward alone (no_grad,
as evaluation runs it) and forward + backward, interleaved call by call, on the demo model's attention shape by
default (batch 16, 8 query / 4 key-value heads, sequence 128, head dim 32). Prints the median times and the ratio.

    python bench/bench_attention.py --threads 2
    python bench/bench_attention.py --batch 4 --heads 32 --kv-heads 8 --seq 2048 --head-dim 128 --iters 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron import cpu_bf16  # noqa: E402

MODES = ("native", "fp32")


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dy: torch.Tensor, backward: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(backward):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if backward:
        out.backward(dy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, args.heads, args.seq, args.head_dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(args.batch, args.kv_heads, args.seq, args.head_dim, generator=gen, requires_grad=True)
            for _ in range(2))
    dy = torch.randn(args.batch, args.heads, args.seq, args.head_dim, generator=gen).bfloat16()
    print(f"torch {torch.__version__} threads={torch.get_num_threads()} cpu_capability="
          f"{torch.backends.cpu.get_cpu_capability()} q {tuple(q.shape)} k/v {tuple(k.shape)}")
    for backward in (False, True):
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.iters + 2):  # two untimed calls each
            for mode in MODES:
                with cpu_bf16.use_mode(mode):
                    start = time.perf_counter()
                    _call(q, k, v, dy, backward)
                    if i >= 2:
                        times[mode].append(time.perf_counter() - start)
        med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
        what = "forward + backward" if backward else "forward (no_grad)"
        print(f"{what:<20} torch's BF16 kernel {med['native']:8.2f} ms   FP32 on BF16-rounded operands "
              f"{med['fp32']:8.2f} ms   FP32 / BF16 {med['fp32'] / med['native']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
