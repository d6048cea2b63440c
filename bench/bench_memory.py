"""Persistent memory per device, measured (process RSS on CPU) against `--dry-run`'s estimate, per weight layout.

Usage: python bench/bench_memory.py [--num-layers 8 --hidden-size 1536 --ffn-hidden-size 4096] [--only NAME ...]

Each configuration is a real training run through `Trainer` (the model built on the meta device by
`megatron/model/build.py`, the engine the loop uses, synthetic data), 2 iterations, in its own processes:
`torch.distributed.run` with 2 gloo ranks for the data-parallel ones. Each rank reports
- RSS growth: resident memory just before the optimizer step of iteration 2 (after the last backward, when
  weights, gradients, master copies and optimizer state are all alive and the activations are freed; freed
  heap returned to the OS with malloc_trim) minus before the Trainer was built, plus whatever the engine
  keeps (DeepSpeed's communication buckets, allocator slack);
- the dry-run estimate of the persistent state (weights + grads + master + optimizer of
  `flops.memory_estimate_bytes`; activations excluded), and both per parameter.
- peak growth: the process's high-water resident memory (ru_maxrss) at the end of training minus the RSS before
  the Trainer was built: persistent state plus the largest transient (gathered blocks, activations, buckets).
Configurations: today's layout and --params-dtype bf16 under DeepSpeed ZeRO-1 at DP=2 (the 7B recipe's
engine), AdamW vs Fp8AdamW at ZeRO 0 (torch engine, one process) for the moments' share, and the two engines that
shard the parameters themselves at DP=2, PyTorch FSDP2 and DeepSpeed ZeRO-3 (AdamW: `--only` them, e.g. at 1B:
`--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16`).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import REPO, free_port  # noqa: E402

# Eager Fp8AdamW: compiling costs minutes on a loaded 2-core CPU and changes no tensor that persists.
FP8ADAM = ["--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128", "--no-fp8-optimizer-compile"]
ZERO1 = ["--deepspeed", "--zero-stage", "1"]
CONFIGS = {  # name: (processes, flags)
    "ZeRO-1 DP=2 Fp8AdamW, fp32 weights (today)": (2, ZERO1 + FP8ADAM),
    "ZeRO-1 DP=2 Fp8AdamW, --params-dtype bf16": (2, ZERO1 + FP8ADAM + ["--params-dtype", "bf16"]),
    "ZeRO-2 DP=2 Fp8AdamW, --params-dtype bf16": (2, ["--deepspeed", "--zero-stage", "2"] + FP8ADAM
                                                  + ["--params-dtype", "bf16"]),
    "ZeRO 0 DP=1 AdamW, fp32 weights": (1, []),
    "ZeRO 0 DP=1 Fp8AdamW, fp32 weights": (1, FP8ADAM),
    "ZeRO 0 DP=1 AdamW, --params-dtype bf16": (1, ["--params-dtype", "bf16"]),
    "ZeRO 0 DP=1 Fp8AdamW, --params-dtype bf16": (1, FP8ADAM + ["--params-dtype", "bf16"]),
    "FSDP2 DP=2 AdamW": (2, ["--use-torch-fsdp2"]),
    "ZeRO-3 DP=2 AdamW": (2, ["--deepspeed", "--zero-stage", "3"]),
}


def _model_flags(a: argparse.Namespace) -> list[str]:
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--ffn-hidden-size",
            str(a.ffn_hidden_size), "--num-attention-heads", str(a.num_attention_heads), "--seq-length", "32",
            "--max-position-embeddings", "32", "--swiglu", "--normalization", "RMSNorm",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--mock-data", "--vocab-size", str(a.vocab_size), "--micro-batch-size", "1", "--train-iters", "2",
            "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1", "--bf16",
            "--device", "cpu"]


def _rss() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap (activations) to the OS before reading RSS
    return psutil.Process().memory_info().rss


def _worker(argv: list[str]) -> None:
    from megatron.arguments import parse_config
    from megatron.perf.flops import count_parameters, memory_estimate_bytes
    from megatron.training.loop import Trainer

    config = parse_config(argv)
    before = _rss()
    trainer = Trainer(config)
    real_step, seen = trainer.engine.step, []

    def step(iteration, loss_finite):  # after the last backward: weights, gradients, masters, moments all alive
        seen.append(_rss())
        return real_step(iteration, loss_finite)

    trainer.engine.step = step
    trainer.train()
    after = seen[-1]  # iteration 2: the optimizer state exists since step 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # Linux: KiB
    mem = memory_estimate_bytes(config)
    estimate = sum(mem[k] for k in ("weights_GiB", "grads_GiB", "master_GiB", "optimizer_GiB")) * 2.0**30
    rank = int(os.environ.get("RANK", "0"))
    print("RESULT " + json.dumps({"rank": rank, "params": count_parameters(config.model), "rss_growth": after - before,
                                  "peak_growth": peak, "estimate": estimate}), flush=True)
    from megatron.parallel_state import finish_distributed_run
    finish_distributed_run(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=1536)
    ap.add_argument("--ffn-hidden-size", type=int, default=4096)
    ap.add_argument("--num-attention-heads", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--only", nargs="*", default=None, help="subset of configuration names")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        _worker(a.worker)
        return
    print(f"{'configuration':44s} {'params':>8s} {'RSS growth GiB/rank':>20s} {'B/param':>8s} {'estimate B/param':>17s} "
          f"{'peak growth GiB/rank':>21s}")
    for name, (nproc, flags) in CONFIGS.items():
        if a.only is not None and name not in a.only:
            continue
        argv = _model_flags(a) + flags + ["--global-batch-size", str(nproc)]
        script = [os.path.abspath(__file__), "--worker", *argv]
        cmd = [sys.executable, *script] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), *script]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        rows = [json.loads(ln[len("RESULT "):]) for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode != 0 or len(rows) != nproc:
            print(f"{name}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        n = rows[0]["params"]
        rss = max(r["rss_growth"] for r in rows)
        peak = max(r["peak_growth"] for r in rows)
        print(f"{name:44s} {n / 1e6:7.0f}M {rss / 2**30:20.2f} {rss / n:8.2f} {rows[0]['estimate'] / n:17.2f} "
              f"{peak / 2**30:21.2f}", flush=True)


if __name__ == "__main__":
    main()
