"""Host (Python and dispatch) overhead of the FP8 recipe, side by side: what a GPU waits for between kernels.

On a GPU the FP8 step is fast only if the host issues kernels faster than the device runs them. These
measurements use shapes so small that the arithmetic is negligible, so the time is the host's, on whatever
device is given (the CPU here: the same Python and dispatch a GPU run pays, without the launches):

  linear     one layer's forward + backward: nn.Linear; Fp8Linear eager (the reference quantization), fused
             (quantization compiled, the layer a graph break) and traced into a compiled module (megatron/fp8/
             traced.py); a compiled nn.Linear alongside. 64x64 weights, 16 tokens.
  fp8_step   `fp8_optimizer_step` for 128 delayed-scaling layers (Llama2-7B's count of FP8 linears): batched
             (the default) vs one module per batch (what it did before), same call otherwise.
  adam       Fp8AdamW (compiled) on one 256x1024 tensor in 256 chunks of 1,024 elements vs one chunk: the
             host cost of one chunk call (docs/fp8_adam.md: why GPU chunks are 2^26 elements).

Variants alternate round by round, medians are printed with their ratio to the first row of each section.

    python bench/bench_host_overhead.py                     # CPU, every section
    python bench/bench_host_overhead.py --device cuda --only linear
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step, set_fused_quantization  # noqa: E402
from megatron.model.compile import register_fp8_weight_refresh  # noqa: E402
from megatron.optimizer import fp8_adam  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _interleaved(variants: dict[str, Callable[[], None]], device: torch.device, rounds: int, calls: int
                 ) -> dict[str, float]:
    """Median seconds per call of each variant; variants take turns, `calls` calls per turn."""
    for fn in variants.values():  # warm-up: compilation, allocator
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def _print(title: str, medians: dict[str, float], unit: str = "us") -> None:
    first = next(iter(medians.values()))
    print(f"\n{title}")
    for name, t in medians.items():
        value = t * (1e6 if unit == "us" else 1e3)
        print(f"  {name:<52} {value:>10.1f} {unit} {t / first:>7.2f}x")


def bench_linear(device: torch.device, rounds: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=device, requires_grad=True)

    def fp8(fused: bool) -> nn.Module:
        layer = Fp8Linear(64, 64, bias=False, recipe=Fp8Recipe(), device=device)
        set_fused_quantization(layer, fused)
        return layer

    traced = nn.Sequential(fp8(True))
    register_fp8_weight_refresh(traced)  # as compiled blocks get it: W cast once per step
    traced.compile(dynamic=False)
    plain_compiled = nn.Sequential(nn.Linear(64, 64, bias=False, device=device))
    plain_compiled.compile(dynamic=False)
    modules = {"nn.Linear (eager)": nn.Linear(64, 64, bias=False, device=device),
               "Fp8Linear eager (reference quantization)": fp8(False),
               "Fp8Linear fused (compiled quantization, graph break)": fp8(True),
               "Fp8Linear traced into a compiled module": traced,
               "nn.Linear in a compiled module": plain_compiled}

    def run(m: nn.Module) -> Callable[[], None]:
        def call() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = m(x)
            y.float().sum().backward()
        return call

    _print("linear: forward + backward per call (64x64, 16 tokens, bf16 autocast)",
           _interleaved({k: run(m) for k, m in modules.items()}, device, rounds, 50))


def bench_fp8_step(device: torch.device, rounds: int) -> None:
    recipe = Fp8Recipe(amax_history_len=16, amax_compute_algo="max")
    model = nn.Sequential(*[Fp8Linear(8, 8, bias=False, recipe=recipe, device=device) for _ in range(128)])
    def step(batched: bool) -> Callable[[], None]:
        def call() -> None:
            for m in model:
                m.fp8_step_amax.fill_(1.5)
            fp8_optimizer_step(model, batched=batched)
        return call

    _print("fp8_step: fp8_optimizer_step, 128 delayed-scaling layers (16-long max history)",
           _interleaved({"batched (default)": step(True), "one module per batch": step(False)}, device, rounds, 5),
           unit="ms")


def bench_adam(device: torch.device, rounds: int) -> None:
    p = nn.Parameter(torch.randn(256, 1024, device=device))
    p.grad = torch.randn_like(p)
    chunk, chunk_accelerator = fp8_adam._CHUNK, fp8_adam._CHUNK_ACCELERATOR
    variants = {}
    for label, length in (("one chunk of 262,144 elements", 1 << 20), ("256 chunks of 1,024 elements", 1024)):
        opt = fp8_adam.Fp8AdamW([p], lr=1e-6, compile=True)

        def call(opt=opt, length=length) -> None:
            fp8_adam._CHUNK, fp8_adam._CHUNK_ACCELERATOR = length, length
            try:
                opt.step()
            finally:
                fp8_adam._CHUNK, fp8_adam._CHUNK_ACCELERATOR = chunk, chunk_accelerator
        variants[label] = call
    medians = _interleaved(variants, device, rounds, 2)
    _print("adam: Fp8AdamW step (compiled), 256x1024 tensor", medians, unit="ms")
    per_call = (medians["256 chunks of 1,024 elements"] - medians["one chunk of 262,144 elements"]) / 255
    print(f"  host cost per extra chunk call: {per_call * 1e6:.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", nargs="*", choices=("linear", "fp8_step", "adam"), default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__} device={device} threads={torch.get_num_threads()} rounds={args.rounds}")
    sections = {"linear": bench_linear, "fp8_step": bench_fp8_step, "adam": bench_adam}
    for name in args.only or sections:
        sections[name](device, args.rounds)


if __name__ == "__main__":
    main()
