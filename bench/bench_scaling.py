"""Data-parallel scaling: tokens/s of the same run on 1 process and on N processes, side by side.

Every configuration trains the same model on the same global batch (synthetic tokens) for a few
iterations; tokens/s is read from the Megatron log line of the last iteration (averaged over the last
`--log-interval` iterations, so the first, slower steps are excluded). Engines: torch (DDP when N > 1)
and DeepSpeed ZeRO-1. On a 2-core CPU expect no speed-up: both processes share the same cores.

    python bench/bench_scaling.py                    # 1 vs 2 processes, torch and DeepSpeed
    python bench/bench_scaling.py --nproc 1 2 4 --engines torch
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, free_port  # noqa: E402

MODEL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-key-value-heads 4 --ffn-hidden-size 704 "
         "--seq-length 128 --swiglu --normalization RMSNorm --use-rotary-position-embeddings "
         "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
         "--lr 1e-3 --mock-data --vocab-size 4096 --bf16 --eval-iters 0").split()


def run(nproc: int, engine: str, args: argparse.Namespace) -> float:
    """tokens/s of the last log line of one run."""
    flags = MODEL + ["--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
                     "--train-iters", str(args.iters), "--log-interval", str(args.iters - args.warmup)]
    if engine == "deepspeed":
        flags += ["--deepspeed", "--zero-stage", "1"]
    cmd = [sys.executable, "pretrain_gpt.py", *flags]
    if nproc > 1 or engine == "deepspeed":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), "pretrain_gpt.py", *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, args.cores // nproc)))
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    rates = re.findall(r"tokens/s: ([0-9.]+)", out.stderr)
    return float(rates[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--engines", nargs="+", default=["torch", "deepspeed"], choices=["torch", "deepspeed"])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first iterations left out of the rate")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--cores", type=int, default=2, help="cores shared by all ranks (OMP threads = cores / nproc)")
    args = p.parse_args()
    print(f"global batch {args.global_batch_size} x seq 128, {args.iters} iterations, {args.cores} cores")
    print(f"{'engine':<10} {'procs':>5} {'tokens/s':>10} {'vs 1 proc':>10}")
    for engine in args.engines:
        base = None
        for n in args.nproc:
            rate = run(n, engine, args)
            base = base or rate
            print(f"{engine:<10} {n:>5} {rate:>10.0f} {rate / base:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
