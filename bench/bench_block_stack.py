"""FP8 vs BF16 where it decides: a stack of Llama blocks at Llama2-7B shapes, forward + backward + optimizer step.

Each variant is a `Trainer` (megatron/training/loop.py) built from pretrain_gpt.py flags, so the timed step is the
CLI's: the model builder, the FP8 swap, `--torch-compile` (compiled blocks, FP8 layers traced into them), the
engine's micro-batch loop, clipping and optimizer step, the FP8 scaling update. The vocabulary is 128 tokens, so
the embedding and the output head are noise next to the blocks. Variants:

  bf16              BF16 autocast, compiled blocks, AdamW (the baseline every ratio is taken against)
  fp8-delayed       ours, the paper's recipe: hybrid FP8, delayed scaling (amax history 16, max), Smooth-SwiGLU
  torchao           the bf16 variant with torchao's Float8Linear (tensorwise) in the blocks, when torchao imports
  fp8-tensorwise    ours: hybrid FP8, current (tensorwise) scaling

Variants run one after another and each prints its row as it finishes (median step, ratio to BF16, tokens/s);
`--json` is rewritten after every row, so a run cut short keeps the finished rows. `--profile` adds, per variant,
one profiled step split by kernel class: GEMM, quantization, attention, other, idle (device time, or CPU op time on
CPU). Steps are timed with CUDA events on a GPU, the wall clock on CPU.

    python bench/bench_block_stack.py --device cuda                       # 7B shapes, 2 blocks, seq 4096
    python bench/bench_block_stack.py --device cuda --layers 4 --profile --json out.json
    python bench/bench_block_stack.py --shape tiny --compile off --iters 1 --warmup 1   # CPU smoke run (tests)
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.arguments import parse_config  # noqa: E402
from megatron.training.loop import Trainer  # noqa: E402

SHAPES = {
    # Llama2-7B's block: hidden 4096, FFN 11008, 32 heads (MHA), sequence 4096.
    "7b": "--hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --num-key-value-heads 32 "
          "--seq-length 4096",
    "tiny": "--hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --num-key-value-heads 2 --seq-length 32",
}
COMMON = ("--swiglu --normalization RMSNorm --use-rotary-position-embeddings --untie-embeddings-and-output-weights "
          "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --lr 1e-4 --train-iters 1000 --mock-data "
          "--vocab-size 128 --make-vocab-size-divisible-by 128 --bf16 --eval-iters 0 --log-interval 1000000")
FP8 = "--fp8-format hybrid"
# In the order they run: the peer right after ours, so that a run cut short keeps the comparison that decides.
VARIANTS = {
    "bf16": "",
    "fp8-delayed": f"{FP8} --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max --smooth-swiglu",
    "torchao": "",  # the bf16 flags; the blocks' linears become torchao Float8Linear after the build
    "fp8-tensorwise": f"{FP8} --fp8-recipe tensorwise",
}
KERNEL_CLASSES = ("GEMM", "quantization", "attention", "other")


def kernel_class(name: str) -> str:
    """The class of a profiled kernel or op, from its name (cuBLAS/CUTLASS/nvjet GEMMs, flash/cuDNN attention,
    inductor's fused casts and amax reductions)."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "softmax")):
        return "attention"
    if any(k in n for k in ("gemm", "scaled_mm", "matmul", "nvjet", "cutlass", "xmma", "aten::mm", "aten::bmm",
                            "aten::addmm", "aten::linear", "sm90_", "sm80_")):
        return "GEMM"
    if any(k in n for k in ("amax", "fp8", "float8", "e4m3", "e5m2", "quant", "clamp", "scale")):
        return "quantization"
    return "other"


def _torchao_blocks(trainer: Trainer, device: torch.device) -> Optional[str]:
    """Swap the blocks' linears for torchao's Float8Linear (tensorwise; emulated off the GPU); None when done,
    else why not. The parameters stay the same objects, so the trainer's optimizer keeps stepping them."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as exc:  # noqa: BLE001  not installed, or its kernels failed to load
        return f"torchao unavailable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    config = Float8LinearConfig(emulate=device.type != "cuda")
    convert_to_float8_training(trainer.model.decoder, config=config)
    return None


class Timer:
    """CUDA events on a GPU (device time of the step, no host sync inside it), the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def build(name: str, args: argparse.Namespace, device: torch.device) -> tuple[Optional[Trainer], str]:
    """The variant's trainer (None and why, when it cannot be built here)."""
    argv = (f"{COMMON} {SHAPES[args.shape]} --num-layers {args.layers} --micro-batch-size {args.micro_batch_size} "
            f"--global-batch-size {args.micro_batch_size} {VARIANTS[name]} --device {device.type}").split()
    compiled = args.compile == "on"
    # torchao's linears go in after the build, so its trainer compiles the blocks itself, after the swap.
    argv += ["--torch-compile", "on" if compiled and name != "torchao" else "off"]
    trainer = Trainer(parse_config(argv))
    if name == "torchao":
        why = _torchao_blocks(trainer, device)
        if why:
            return None, why
        if compiled:
            from megatron.model.compile import transformer_blocks

            for block in transformer_blocks(trainer.model):
                block.compile(dynamic=False)
    return trainer, ""


def profile_step(step: Callable[[], None], device: torch.device, seconds: float,
                 top: int = 0) -> tuple[dict[str, float], list[tuple[str, str, int, float]]]:
    """Milliseconds per kernel class over one step, and `idle`: the step's time not covered by them; with the
    `top` kernels (or CPU ops) by time: (class, name, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    out = {k: 0.0 for k in KERNEL_CLASSES}
    kernels = []
    for e in prof.key_averages():
        t = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        if device.type == "cuda" and (e.device_type != torch.autograd.DeviceType.CUDA
                                      or getattr(e, "is_user_annotation", False) or "#" in e.key):
            continue  # a user annotation's range on the GPU (Optimizer.step#AdamW.step) spans kernels counted
        if device.type == "cpu" and not e.key.startswith("aten::"):
            continue  # Python and framework frames: their self time is not an op's
        out[kernel_class(e.key)] += t / 1e3
        kernels.append((kernel_class(e.key), e.key, e.count, t / 1e3))
    out["idle"] = max(0.0, seconds * 1e3 - sum(out.values()))
    return out, sorted(kernels, key=lambda k: -k[3])[:top]


def graph_counts() -> dict:
    """Dynamo's counters since the last `reset_graph_counts`: graphs compiled and graph breaks (with the first
    reasons). A graph break inside a block means part of it (an FP8 layer, say) runs eagerly."""
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    return {"graphs": int(counters.get("stats", {}).get("unique_graphs", 0)), "graph_breaks": sum(breaks.values()),
            "break_reasons": [str(r).splitlines()[0][:160] for r in list(breaks)[:3]]}


def reset_graph_counts() -> None:
    from torch._dynamo.utils import counters

    counters.clear()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks in the stack")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--iters", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (after the compile warm-up)")
    p.add_argument("--compile", choices=["on", "off"], default="on", help="compiled blocks (the point) or eager")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--profile", action="store_true", help="one profiled step per variant, by kernel class")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N",
                   help="with --profile: also print each variant's N longest kernels (CPU: ops)")
    p.add_argument("--json", default=None, help="rewrite this JSON file after every variant")
    return p


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = build_parser()
    args = p.parse_args(argv)
    names = args.variants.split(",")
    if "bf16" not in names or any(n not in VARIANTS for n in names):
        p.error(f"--variants must include bf16 and name only {', '.join(VARIANTS)}; got {args.variants!r}")
    names = ["bf16"] + [n for n in names if n != "bf16"]  # the baseline first: every ratio needs it
    quiet = logging.getLogger("megatron")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the trainers' build logs; restored at the end (tests call main in-process)
    try:
        return _run(names, args)
    finally:
        quiet.setLevel(level)


def _run(names: list[str], args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    timer = Timer(device)
    seq = int(SHAPES[args.shape].split("--seq-length ")[1].split()[0])
    tokens = args.micro_batch_size * seq
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 128, (args.micro_batch_size, seq + 1), generator=gen)]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"block stack: {args.layers} x {args.shape} blocks, {tokens} tokens/step, compile {args.compile}, "
          f"{gpu}, torch {torch.__version__}", flush=True)
    print(f"{'variant':<16} {'median step':>12} {'vs bf16':>8} {'tokens/s':>10} {'build+compile':>14}", flush=True)
    results: list[dict] = []
    base: Optional[float] = None
    for name in names:
        start = time.perf_counter()
        reset_graph_counts()
        trainer, why = build(name, args, device)
        if trainer is None:
            print(f"{name:<16} skipped: {why}", flush=True)
            results.append({"variant": name, "skipped": why})
            continue

        def step(t: Trainer = trainer) -> None:
            loss, _, _ = t.train_step(iter(rows))
            float(loss)
            t.state.iteration += 1

        for _ in range(args.warmup):
            step()  # the first one compiles (the torchao variant, and every variant's backward)
        build_s = time.perf_counter() - start
        times = [timer(step) for _ in range(args.iters)]
        median = statistics.median(times)
        base = median if name == "bf16" else base
        row = {"variant": name, "median_step_s": median, "vs_bf16": median / base, "tokens_per_s": tokens / median,
               "build_and_warmup_s": build_s, "steps_s": times, **graph_counts()}
        if args.profile:
            row["profile_ms"], row["top_kernels"] = profile_step(step, device, median, args.top_kernels)
        results.append(row)
        print(f"{name:<16} {median * 1e3:>10.1f}ms {median / base:>7.2f}x {tokens / median:>10.0f} "
              f"{build_s:>13.1f}s", flush=True)
        if args.compile == "on":
            print(f"    dynamo: {row['graphs']} graphs, {row['graph_breaks']} graph breaks "
                  f"{'; '.join(row['break_reasons'])}", flush=True)
        if args.profile:
            print("    " + "  ".join(f"{k} {v:.1f}ms" for k, v in row["profile_ms"].items()), flush=True)
            for cls, kname, calls, ms in row["top_kernels"]:
                print(f"      {ms:7.2f}ms {calls:4d}x {cls:<12} {kname[:110]}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"device": gpu, "torch": torch.__version__, "shape": args.shape,
                                                   "layers": args.layers, "tokens_per_step": tokens,
                                                   "compile": args.compile, "rows": results}, indent=1))
        del trainer, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
