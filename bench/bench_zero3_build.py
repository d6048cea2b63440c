"""Parameter storage and peak RSS per rank right after the model is built under DeepSpeed ZeRO-3 (DP=2).

Usage: OMP_NUM_THREADS=1 python bench/bench_zero3_build.py [--tree DIR] [pretrain_gpt.py model flags ...]

Runs `pretrain_gpt.py` of checkout `--tree` (default: this one) on 2 gloo ranks under `--deepspeed --zero-stage 3`
with synthetic data and stops each rank where the DeepSpeed engine starts (`DeepSpeedBase._initialize`: the model
built, the FP8 swap and the optimizer's construction done, nothing of DeepSpeed's own yet). Each rank prints the
bytes of parameter storage it holds (a ZeRO-3 partitioned parameter's `ds_tensor`, else the whole tensor), its
resident memory then (freed heap returned to the OS first, malloc_trim) and its peak RSS so far. Hooking the engine's start rather than reading a log line measures older checkouts too (before
partitioned construction: `git archive <commit> | tar -x -C DIR`). Default model: 217M parameters.
"""
from __future__ import annotations

import ctypes
import os
import resource
import runpy
import subprocess
import sys
from pathlib import Path

MODEL = ["--mock-data", "--swiglu", "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--normalization", "RMSNorm", "--num-layers", "12", "--hidden-size", "1024",
         "--num-attention-heads", "16", "--seq-length", "128", "--vocab-size", "32000"]
RUN = ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-4", "--eval-iters",
       "0", "--deepspeed", "--zero-stage", "3"]


def worker(tree: str, argv: list[str]) -> None:
    sys.path.insert(0, tree)
    import torch.distributed as dist

    import megatron.training.deepspeed_engine as engine

    def measure(self, config, model, *args, **kwargs) -> None:
        params = list(model.parameters())
        held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
                   else p.numel() * p.element_size() for p in params)
        full = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap (the whole parts) back to the OS before reading RSS
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        print(f"rank {dist.get_rank()}: parameter storage {held / 2**20:.1f} MiB of {full / 2**20:.1f} MiB "
              f"({held / full:.3f}); RSS {rss:.0f} MiB (heap trimmed), peak RSS {peak:.0f} MiB", flush=True)
        raise SystemExit(0)

    engine.DeepSpeedBase._initialize = measure
    sys.argv = [os.path.join(tree, "pretrain_gpt.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def main() -> None:
    args = sys.argv[1:]
    tree = str(Path(__file__).resolve().parents[1])
    if args[:1] == ["--tree"]:
        tree, args = str(Path(args[1]).resolve()), args[2:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, "--worker", tree,
           *MODEL, *args, *RUN]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("rank ")]
    print("\n".join(sorted(lines)) if lines else out.stderr[-3000:])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
