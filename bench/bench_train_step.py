"""Whole training step of the demo model through the real training code: BF16 vs FP8 variants, interleaved.

Each variant is a `Trainer` (megatron/training/loop.py) built from pretrain_gpt.py flags: the same model
builder, FP8 swap, optimizer, LR schedule and engine (`TorchEngine`) the CLI uses, and the timed call is
`Trainer.train_step`: micro-batches made by the data pipeline's `make_batch` (labels and loss masks), the
engine's `train_batch` (masked per-token loss, gradient accumulation, clipping, the non-finite check, the
optimizer step) and the FP8 scaling update. Iterations alternate between variants so machine noise hits
all of them alike. Prints the median step time per variant, its ratio to the BF16 baseline, tokens/s and
optimizer-state bytes; `--json FILE` writes the same figures.

`--torch-compile` sets every variant's `--torch-compile`: `off`, `on`, `auto`, a comma list of them, or `both`
(= off,on, the default); `on-break` is `on` with the FP8 layers run as graph breaks in the compiled blocks
(what `on` did before they were traced into the blocks' graphs, megatron/fp8/traced.py; BF16 skips it); each
variant runs once per listed mode and the ratios are taken against the fastest BF16 baseline (compiling cannot
win by slowing BF16 down). `auto` is the CLI default; the variants are configured for 500 iterations, where on CPU
it compiles the FP8 quantization and leaves the blocks eager (a run of 1000 or more compiles the blocks too: `on`),
so BF16 skips it (it would equal `off`); in the BF16 GEMM mode (`--cpu-fp8-gemm bf16`, the default on CPUs with fast
BF16 GEMMs) FP8's `auto` leaves the FP8 layers eager too, as the CLI does there (megatron/model/compile.py).
Compilation happens while the variant is built (a logged warm-up), outside the timing.

    python bench/bench_train_step.py                        # demo shape, CPU, eager and compiled
    python bench/bench_train_step.py --iters 10 --threads 2 --torch-compile off
    python bench/bench_train_step.py --device cuda --iters 30 --extra "<a 1B shape>"
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron import cpu_bf16, host_malloc  # noqa: E402
from megatron.arguments import parse_config  # noqa: E402
from megatron.fp8 import cpu_gemm, set_fp8_tracing  # noqa: E402
from megatron.training.loop import Trainer  # noqa: E402

DEMO = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-key-value-heads 4 --ffn-hidden-size 704 "
        "--seq-length 128 --swiglu --normalization RMSNorm --use-rotary-position-embeddings "
        "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
        "--lr 1e-3 --train-iters 500 --mock-data --vocab-size 4096 --bf16 --eval-iters 0").split()
FP8 = "--fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max".split()
VARIANTS = {
    "bf16": [],
    "fp8 linears": FP8,
    "fp8 linears + Fp8AdamW": FP8 + ["--optimizer", "fp8adam"],
    "fp8 linears + smooth-swiglu": FP8 + ["--smooth-swiglu"],
    "fp8 + smooth-swiglu + Fp8AdamW": FP8 + ["--smooth-swiglu", "--optimizer", "fp8adam"],
    "bf16 + Fp8AdamW": ["--optimizer", "fp8adam"],
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _gemm_modes(bf16_gemm: Optional[str], fp8_gemm: Optional[str]):
    with contextlib.ExitStack() as stack:
        if bf16_gemm:
            stack.enter_context(cpu_bf16.use_mode(bf16_gemm))
        if fp8_gemm:
            stack.enter_context(cpu_gemm.use_mode(fp8_gemm))
        yield


MODE_LABELS = {"off": "eager", "on": "compiled", "auto": "auto", "on-break": "compiled, FP8 graph breaks"}


class Variant:
    def __init__(self, name: str, argv: list[str], device: torch.device, mode: str,
                 bf16_gemm: Optional[str] = None, fp8_gemm: Optional[str] = None) -> None:
        self.name = f"{name} ({MODE_LABELS[mode]})" + (f" [CPU BF16 GEMM {bf16_gemm}]" if bf16_gemm else "") + (
            f" [FP8 GEMM {fp8_gemm}]" if fp8_gemm else "")
        self.device = device
        # megatron/cpu_bf16.py: how the BF16 autocast GEMMs run on CPU (torch's kernels or FP32 on rounded operands);
        # megatron/fp8/cpu_gemm.py: how the emulated FP8 GEMMs run (FP32, or BF16 GEMMs)
        self.bf16_gemm_mode = bf16_gemm
        self.bf16_gemm = lambda: _gemm_modes(bf16_gemm, fp8_gemm)
        config = parse_config(argv + ["--torch-compile", mode.replace("-break", ""), "--device", device.type])
        start = time.perf_counter()
        with self.bf16_gemm():
            self.trainer = Trainer(config)
        self.build_s = time.perf_counter() - start  # includes the compile warm-up when compiled
        if mode == "on-break":  # the FP8 layers as graph breaks in the compiled blocks (before traced.py): the
            set_fp8_tracing(self.trainer.model, False)  # blocks retrace in the untimed --warmup steps
        self.times: list[float] = []

    def step(self, rows: list[torch.Tensor]) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        with self.bf16_gemm():
            loss, _, _ = self.trainer.train_step(iter(rows))
            float(loss)  # the loop reads the loss once per log interval; here once per step
        self.times.append(time.perf_counter() - t0)
        self.trainer.state.iteration += 1

    def state_bytes(self) -> int:
        total = 0
        for state in self.trainer.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.ndim > 0)
        return total


def _self_times(v: Variant, rows: list[torch.Tensor]) -> dict[str, float]:
    """Self CPU/device time per op (ms) over one training step of `v`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if v.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        v.step(rows)
    v.times.pop()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = e.self_device_time_total if v.device.type == "cuda" else e.self_cpu_time_total
        # Inductor's graphs have per-variant hash names: one row for all compiled code, comparable across variants.
        key = "compiled code (inductor graphs)" if "CompiledFxGraph" in e.key else e.key
        out[key] = out.get(key, 0.0) + t / 1e3
    return out


def profile_table(variants: list[Variant], rows: list[torch.Tensor], top: int) -> None:
    """Per op: self time in each variant and the difference to the first (the BF16 baseline), largest first."""
    times = [_self_times(v, rows) for v in variants]
    ops = set().union(*times)
    base = times[0]
    order = sorted(ops, key=lambda k: -max(abs(t.get(k, 0.0) - base.get(k, 0.0)) for t in times[1:]))
    print(f"\nprofile: self time per op (ms, one step), ops ordered by their largest difference to {variants[0].name}")
    print(f"{'op':<44}" + "".join(f"{v.name[:24]:>26}" for v in variants))
    for op in order[:top]:
        print(f"{op[:44]:<44}" + "".join(f"{t.get(op, 0.0):>26.1f}" for t in times))
    print(f"{'total (all ops)':<44}" + "".join(f"{sum(t.values()):>26.1f}" for t in times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=6, help="timed steps per variant (after --warmup steps)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (first FP8 step, allocator)")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--variants", default="bf16,fp8 linears,fp8 + smooth-swiglu + Fp8AdamW",
                   help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--torch-compile", default="both",
                   help="off, on, auto, on-break, a comma list of them, or both (= off,on)")
    p.add_argument("--compile-bf16", action="store_true",
                   help="the earlier spelling of --torch-compile both (scripts/gpu_check.py passes it)")
    p.add_argument("--cpu-bf16-gemm", default="default",
                   help="CPU only: how BF16 autocast GEMMs run (megatron/cpu_bf16.py): default (this CPU's choice), "
                        "native (torch's BF16 kernels), fp32 (FP32 GEMMs on BF16-rounded operands), or both "
                        "(every variant once with each, side by side)")
    p.add_argument("--cpu-fp8-gemm", default="default",
                   help="CPU only: how the emulated FP8 GEMMs run (megatron/fp8/cpu_gemm.py): default (this CPU's "
                        "choice), exact (FP32 GEMMs, one rounding), bf16 (BF16 GEMMs), or both (every FP8 variant "
                        "once with each, side by side)")
    p.add_argument("--extra", default="", help="extra pretrain_gpt.py flags for every variant, e.g. a model shape")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one step per variant (torch.profiler) and print the N ops whose "
                        "self time differs most from the first variant's: where the extra time goes")
    args = p.parse_args()
    logging.getLogger("megatron").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    base = DEMO + args.extra.split() + ["--micro-batch-size", str(args.micro_batch_size),
                                        "--global-batch-size", str(args.micro_batch_size * args.micro_batches)]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "bf16" not in names:
        p.error(f"--variants must include bf16 and name only {', '.join(VARIANTS)}; got {args.variants!r}")
    modes = ["off", "on"] if args.compile_bf16 or args.torch_compile == "both" else args.torch_compile.split(",")
    if not modes or any(m not in MODE_LABELS for m in modes):
        p.error(f"--torch-compile takes off, on, auto, on-break, a comma list of them, or both; got "
                f"{args.torch_compile!r}")
    gemm_modes = {"default": [None], "native": ["native"], "fp32": ["fp32"], "both": ["native", "fp32"]}
    if args.cpu_bf16_gemm not in gemm_modes or (args.cpu_bf16_gemm != "default" and device.type != "cpu"):
        p.error(f"--cpu-bf16-gemm takes default, native, fp32 or both, and only with --device cpu; got "
                f"{args.cpu_bf16_gemm!r}")
    fp8_modes = {"default": [None], "exact": ["exact"], "bf16": ["bf16"], "both": ["exact", "bf16"]}
    if args.cpu_fp8_gemm not in fp8_modes or (args.cpu_fp8_gemm != "default" and device.type != "cpu"):
        p.error(f"--cpu-fp8-gemm takes default, exact, bf16 or both, and only with --device cpu; got "
                f"{args.cpu_fp8_gemm!r}")
    variants = [Variant(name, base + VARIANTS[name], device, m, g, f) for g in gemm_modes[args.cpu_bf16_gemm]
                for name in names for m in modes for f in (fp8_modes[args.cpu_fp8_gemm] if name != "bf16" else [None])
                if not (name == "bf16" and m == "auto" and device.type == "cpu" and "off" in modes)
                and not (name == "bf16" and m == "on-break")]
    logging.getLogger("megatron").setLevel(logging.INFO)
    m = variants[0].trainer.config.model
    gen = torch.Generator().manual_seed(0)
    vocab = variants[0].trainer.config.data.vocab_size or 4096
    rows = [torch.randint(0, vocab, (args.micro_batch_size, m.seq_length + 1), generator=gen)
            for _ in range(args.micro_batches)]
    params = sum(p.numel() for p in variants[0].trainer.model.parameters())
    tokens_per_step = args.micro_batch_size * args.micro_batches * m.seq_length
    print(f"torch {torch.__version__} device={device} threads={torch.get_num_threads()} params={params:,} "
          f"tokens/step={tokens_per_step} cpu_capability={torch.backends.cpu.get_cpu_capability()} "
          f"cpu_bf16_gemm_default={cpu_bf16.cpu_bf16_gemm_mode() if device.type == 'cpu' else '-'} "
          f"cpu_fp8_gemm_default={cpu_gemm.mode() if device.type == 'cpu' else '-'}")
    for v in variants:
        for _ in range(args.warmup):
            v.step(rows)
        v.times.clear()
    for _ in range(args.iters):
        for v in variants:
            v.step(rows)
    medians = {v.name: statistics.median(v.times) for v in variants}
    ref = min(t for name, t in medians.items() if name.startswith("bf16 ("))
    print(f"{'variant':<42} {'median step':>12} {'vs best bf16':>12} {'tokens/s':>10} {'opt. state':>11} "
          f"{'build+compile':>13}")
    rows_out = []
    for v in variants:
        med = medians[v.name]
        rows_out.append({"variant": v.name, "median_step_s": med, "vs_best_bf16": med / ref,
                         "tokens_per_s": tokens_per_step / med, "optimizer_state_MiB": v.state_bytes() / 2**20,
                         "build_s": v.build_s, "steps_s": v.times})
        print(f"{v.name:<42} {med * 1000:>10.1f}ms {med / ref:>11.2f}x {tokens_per_step / med:>10.0f} "
              f"{v.state_bytes() / 2**20:>7.2f} MiB {v.build_s:>12.1f}s")
    if device.type == "cpu":  # the process's peak resident set: every variant's, and the host allocator's holding
        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
              f"(CPU malloc: {host_malloc.configure()})")
    if args.cpu_bf16_gemm == "both":
        for v in variants:
            if v.bf16_gemm_mode == "fp32":
                twin = next(w for w in variants if w.name == v.name.replace("GEMM fp32]", "GEMM native]"))
                print(f"{v.name.split(' [')[0]}: step with FP32 GEMMs on BF16-rounded operands / torch's BF16 "
                      f"kernels = {medians[v.name] / medians[twin.name]:.3f}x")
    if args.profile:
        profile_table(variants, rows, args.profile)
    if args.json:
        Path(args.json).write_text(json.dumps({"params": params, "tokens_per_step": tokens_per_step,
                                               "device": str(device), "torch": torch.__version__,
                                               "iters": args.iters, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
