"""Whole training step of the demo model: BF16 vs FP8 variants, interleaved, ratios from one run.

Each variant is the same Llama-style model (the README demo's shape by default) with its own optimizer;
iterations alternate between variants so machine noise hits all of them alike. A step is forward +
backward over `--micro-batches` micro-batches, gradient clipping, the optimizer step and, for FP8, the
scaling update. Prints the median step time per variant, its ratio to BF16, tokens/s, and optimizer-state
bytes; `--json FILE` writes the same figures.

On an accelerator (`--device cuda`) `--compile-bf16` adds a torch.compile'd BF16 variant, and the ratios are
then taken against the faster of the two BF16 baselines (an honest FP8 speed-up beats the best BF16 one).

    python bench/bench_train_step.py                  # demo shape, CPU
    python bench/bench_train_step.py --iters 10 --threads 2
    python bench/bench_train_step.py --device cuda --compile-bf16 --iters 30 --extra "<a 1B shape>"
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.arguments import parse_config  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.optimizer import build_optimizer  # noqa: E402
from megatron.training.fp8_hooks import Fp8Hooks  # noqa: E402

DEMO = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-key-value-heads 4 --ffn-hidden-size 704 "
        "--seq-length 128 --swiglu --normalization RMSNorm --use-rotary-position-embeddings "
        "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
        "--lr 1e-3 --train-iters 10 --mock-data --vocab-size 4096 --bf16").split()
FP8 = "--fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max".split()
VARIANTS = {
    "bf16": [],
    "fp8 linears": FP8,
    "fp8 linears + Fp8AdamW": FP8 + ["--optimizer", "fp8adam"],
    "bf16 + Fp8AdamW": ["--optimizer", "fp8adam"],
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Variant:
    def __init__(self, name: str, argv: list[str], device: torch.device, compiled: bool = False) -> None:
        self.name = name
        self.device = device
        self.config = parse_config(argv)
        torch.manual_seed(0)
        self.model = GPTModel(self.config.model).to(device)
        self.fp8 = Fp8Hooks(self.model, self.config.fp8, None, stats=False)
        self.optimizer = build_optimizer(self.model, self.config.optimizer)
        self.forward = torch.compile(self.model) if compiled else self.model
        self.times: list[float] = []

    def step(self, batches: list[torch.Tensor]) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        for tokens in batches:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.forward(tokens, labels=tokens).mean() / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.fp8.after_optimizer_step()
        _sync(self.device)
        self.times.append(time.perf_counter() - t0)

    def state_bytes(self) -> int:
        total = 0
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.ndim > 0)
        return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=6, help="timed steps per variant (after --warmup steps)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant (first FP8 step, compilation)")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--compile-bf16", action="store_true", help="also time a torch.compile'd BF16 baseline")
    p.add_argument("--extra", default="", help="extra pretrain_gpt.py flags for every variant, e.g. a model shape")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    base = DEMO + args.extra.split() + ["--micro-batch-size", str(args.micro_batch_size),
                                        "--global-batch-size", str(args.micro_batch_size * args.micro_batches)]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "bf16" not in names:
        p.error(f"--variants must include bf16 and name only {', '.join(VARIANTS)}; got {args.variants!r}")
    variants = [Variant(name, base + VARIANTS[name], device) for name in names]
    if args.compile_bf16:
        variants.insert(1, Variant("bf16 compiled", base, device, compiled=True))
    m = variants[0].config.model
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, variants[0].config.data.vocab_size or 4096, (args.micro_batch_size, m.seq_length), generator=gen).to(device)
               for _ in range(args.micro_batches)]
    params = sum(p.numel() for p in variants[0].model.parameters())
    tokens_per_step = args.micro_batch_size * args.micro_batches * m.seq_length
    print(f"torch {torch.__version__} device={device} threads={torch.get_num_threads()} params={params:,} "
          f"tokens/step={tokens_per_step}")
    for v in variants:  # warm-up (first FP8 step, allocator, compilation)
        for _ in range(args.warmup):
            v.step(batches)
        v.times.clear()
    for _ in range(args.iters):
        for v in variants:
            v.step(batches)
    medians = {v.name: statistics.median(v.times) for v in variants}
    ref = min(t for name, t in medians.items() if name.startswith("bf16") and "Fp8AdamW" not in name)
    print(f"{'variant':<26} {'median step':>12} {'vs bf16':>8} {'tokens/s':>12} {'optimizer state':>16}")
    rows = []
    for v in variants:
        med = medians[v.name]
        rows.append({"variant": v.name, "median_step_s": med, "vs_best_bf16": med / ref,
                     "tokens_per_s": tokens_per_step / med, "optimizer_state_MiB": v.state_bytes() / 2**20})
        print(f"{v.name:<26} {med * 1000:>10.1f}ms {med / ref:>7.2f}x {tokens_per_step / med:>12.0f} "
              f"{v.state_bytes() / 2**20:>12.2f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"params": params, "tokens_per_step": tokens_per_step,
                                               "device": str(device), "torch": torch.__version__,
                                               "iters": args.iters, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
