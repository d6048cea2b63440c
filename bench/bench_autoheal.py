"""What `--fp8-autoheal` costs when nothing is wrong: FP8 with and without the controller, side by side, and the
same pair with `--log-fp8-stats` on (whose statistics the controller reads: there its own cost is the decision).

Every variant is a `Trainer` (megatron/training/loop.py) of the demo model built from pretrain_gpt.py flags, and each
timed iteration is what the training loop does per iteration for FP8: `Trainer.train_step` (forward, backward,
optimizer step, FP8 scaling update) and `Fp8Hooks.log_values` (at a log iteration: the FP8 statistics read back, the
controller's decision and its log lines; before one: statistics switched on for it). The controller's cost is all in
log iterations (the statistics' extra pass over each quantized tensor, recorded in that iteration), so the figure is
the mean over whole log intervals, never a median that would skip them. Iterations alternate between the variants
so machine noise hits all of them alike.

    python bench/bench_autoheal.py                          # demo shape, CPU, log interval 10
    python bench/bench_autoheal.py --log-interval 100 --iters 100 --warmup 3
    python bench/bench_autoheal.py --device cuda --extra "<a 1B shape>"
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.arguments import parse_config  # noqa: E402
from megatron.training.loop import Trainer  # noqa: E402

# 500 iterations: under `--torch-compile auto` a CPU run of this length compiles the FP8 quantization and keeps the
# blocks eager (1000 or more would compile them: megatron/model/compile.py), as docs/stability.md measured it.
DEMO = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-key-value-heads 4 --ffn-hidden-size 704 "
        "--seq-length 128 --swiglu --normalization RMSNorm --use-rotary-position-embeddings "
        "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
        "--lr 1e-3 --train-iters 500 --mock-data --vocab-size 4096 --bf16 --eval-iters 0 "
        "--fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max").split()
VARIANTS = {"fp8": [], "fp8 + --fp8-autoheal": ["--fp8-autoheal"], "fp8 + --log-fp8-stats": ["--log-fp8-stats"],
            "fp8 + both": ["--log-fp8-stats", "--fp8-autoheal"]}


class Variant:
    def __init__(self, name: str, argv: list[str], log_interval: int) -> None:
        self.name = name
        self.trainer = Trainer(parse_config(argv + ["--log-interval", str(log_interval)]))
        self.log_interval = log_interval
        self.times: list[float] = []

    def step(self, rows: list[torch.Tensor], device: torch.device) -> None:
        t0 = time.perf_counter()
        loss, _, _ = self.trainer.train_step(iter(rows))
        float(loss)
        self.trainer.state.iteration += 1  # the loop's order: the step, its count, then its log work
        self.trainer.fp8.log_values(self.trainer.state.iteration, self.log_interval)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.times.append(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=40, help="timed iterations per variant (whole log intervals)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default: one log interval)")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-compile", default="auto", choices=["auto", "on", "off"],
                   help="pretrain_gpt.py's flag for every variant (auto, the CLI's default, on CPU: FP8 quantization "
                        "and statistics compiled, blocks eager; off: all eager)")
    p.add_argument("--extra", default="", help="extra pretrain_gpt.py flags for both variants, e.g. a model shape")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.iters < args.log_interval or args.iters % args.log_interval:
        p.error(f"--iters must be a multiple of --log-interval ({args.log_interval}): the controller's cost sits in "
                f"log iterations; got {args.iters}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    base = DEMO + args.extra.split() + [
        "--torch-compile", args.torch_compile, "--device", device.type,
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size * args.micro_batches)]
    quiet = logging.getLogger("megatron")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the trainers' build logs; restored at the end (tests call main in-process)
    try:
        variants = [Variant(name, base + flags, args.log_interval) for name, flags in VARIANTS.items()]
        m = variants[0].trainer.config.model
        gen = torch.Generator().manual_seed(0)
        rows = [torch.randint(0, 4096, (args.micro_batch_size, m.seq_length + 1), generator=gen)
                for _ in range(args.micro_batches)]
        warmup = args.log_interval if args.warmup is None else args.warmup
        for v in variants:
            for _ in range(warmup):
                v.step(rows, device)
            v.times.clear()
        for _ in range(args.iters):
            for v in variants:
                v.step(rows, device)
        plain, healed, logged, both = (statistics.fmean(v.times) for v in variants)
        controller = variants[1].trainer.fp8.controller
        result = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads(),
                  "torch_compile": args.torch_compile,
                  "log_interval": args.log_interval, "iters": args.iters,
                  "mean_step_s": {v.name: statistics.fmean(v.times) for v in variants},
                  "overhead": healed / plain - 1, "overhead_over_log_fp8_stats": both / logged - 1,
                  "controller_actions": controller.actions}
        print(f"torch {torch.__version__} device={device} threads={torch.get_num_threads()} "
              f"--torch-compile {args.torch_compile}, log interval {args.log_interval}, "
              f"{args.iters} timed iterations per variant (alternating)")
        for v in variants:
            print(f"{v.name:<24} mean iteration {statistics.fmean(v.times) * 1e3:9.1f} ms")
        print(f"overhead of --fp8-autoheal: {result['overhead'] * 100:+.2f}% of the iteration "
              f"({controller.actions} action(s) taken); over a run with --log-fp8-stats already on: "
              f"{result['overhead_over_log_fp8_stats'] * 100:+.2f}%")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result
    finally:
        quiet.setLevel(level)


if __name__ == "__main__":
    main()
