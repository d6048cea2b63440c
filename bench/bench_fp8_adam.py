"""Side-by-side CPU benchmark of optimizer state memory and step time: Fp8AdamW vs AdamW vs torchao.

Usage: python bench/bench_fp8_adam.py [--steps 5] [--only NAME ...]

A ~50M-parameter set (four 2048x5632 matrices, one 2048x2048, and 1-D norm/bias vectors) with fixed
random gradients. Each optimizer runs in its own subprocess so that process RSS growth after the first
step is not polluted by another optimizer's allocations. Reported per optimizer:
- state B/param: the sum of nbytes of the state tensors (moments and scales; step counters excluded;
  tensor subclasses such as torchao's are measured through their inner tensors),
- RSS growth: psutil RSS after the first step minus before it (state plus whatever the allocator keeps),
- first step (includes torch.compile where compiled) and the median of the following steps;
then the targets for "Fp8AdamW compiled" (the training default): step <= 1.3x torch AdamW (foreach)
and <= torchao's AdamWFp8 (compiled), state <= 2.02 bytes/param. The step ratios of the targets come from
one more process that takes the three optimizers' steps in turn (`_interleaved`), so that a shared machine's
changing load cannot favour one of them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.optimizer.fp8_adam import Fp8AdamW  # noqa: E402

MATRICES = [(2048, 5632)] * 4 + [(2048, 2048)]
VECTORS = [(2048,)] * 16 + [(5632,)] * 4


def _optimizers() -> Dict[str, Callable]:
    opts: Dict[str, Callable] = {
        "torch AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
        "Fp8AdamW eager": lambda p: Fp8AdamW(p, lr=1e-4),
        "Fp8AdamW eager, v RTN": lambda p: Fp8AdamW(p, lr=1e-4, stochastic_rounding=False),
        "Fp8AdamW eager block128": lambda p: Fp8AdamW(p, lr=1e-4, block_size=128),
        "Fp8AdamW compiled": lambda p: Fp8AdamW(p, lr=1e-4, compile=True),
        "Fp8AdamW compiled, v RTN": lambda p: Fp8AdamW(p, lr=1e-4, stochastic_rounding=False, compile=True),
        "Fp8AdamW compiled block128": lambda p: Fp8AdamW(p, lr=1e-4, block_size=128, compile=True),
    }
    try:
        from torchao.optim import AdamWFp8  # E4M3 moments, blocks of 256, compiled step

        opts["torchao AdamWFp8"] = lambda p: AdamWFp8(p, lr=1e-4)
    except ImportError:
        pass
    return opts


def _tensor_nbytes(t: torch.Tensor) -> int:
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _state_nbytes(opt: torch.optim.Optimizer) -> int:
    return sum(_tensor_nbytes(v) for s in opt.state.values() for k, v in s.items()
               if k != "step" and isinstance(v, torch.Tensor))


def _worker(name: str, steps: int) -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in MATRICES + VECTORS]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    opt = _optimizers()[name](params)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    opt.step()
    first = time.perf_counter() - t0
    rss1 = proc.memory_info().rss
    times: List[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"name": name, "params": n, "state_bytes": _state_nbytes(opt), "rss_growth": rss1 - rss0,
            "first_s": first, "step_s": statistics.median(times)}


TARGETS = ("torch AdamW foreach", "Fp8AdamW compiled", "torchao AdamWFp8")


def _interleaved(names: List[str], steps: int) -> Dict[str, float]:
    """Median step time of each optimizer, their steps taken in turn (A, B, C, A, B, C, ...) in one process: a
    load that comes and goes on a shared machine then hits all of them alike, which separate runs cannot
    promise. Each has its own copy of the parameters and gradients; the first (compiling) step is untimed."""
    torch.manual_seed(0)
    base = [torch.randn(s) * 0.02 for s in MATRICES + VECTORS]
    opts = {}
    for name in names:
        params = [torch.nn.Parameter(t.clone()) for t in base]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opts[name] = _optimizers()[name](params)
        opts[name].step()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for _ in range(steps):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    ap.add_argument("--only", nargs="*", default=None, help="subset of optimizer names")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--interleaved-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker, args.steps)), flush=True)
        return
    if args.interleaved_worker:
        names = [n for n in TARGETS if n in _optimizers()]
        print("RESULT " + json.dumps(_interleaved(names, args.steps)), flush=True)
        return
    names = [n for n in _optimizers() if args.only is None or n in args.only]
    results = []
    for name in names:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name,
                              "--steps", str(args.steps)], capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
    base = next((r for r in results if r["name"].startswith("torch AdamW")), results[0])
    print(f"params: {base['params'] / 1e6:.2f}M, torch {torch.__version__}, threads {torch.get_num_threads()}")
    header = (f"{'optimizer':28s} {'state B/param':>13s} {'x AdamW':>8s} {'RSS growth MB':>14s} {'x AdamW':>8s} "
              f"{'first step s':>12s} {'step ms':>9s} {'x AdamW':>8s}")
    print(header)
    print("-" * len(header))
    for r in results:
        bpp = r["state_bytes"] / r["params"]
        print(f"{r['name']:28s} {bpp:13.3f} {bpp / (base['state_bytes'] / base['params']):8.3f} "
              f"{r['rss_growth'] / 2**20:14.1f} {r['rss_growth'] / max(base['rss_growth'], 1):8.3f} "
              f"{r['first_s']:12.2f} {r['step_s'] * 1e3:9.1f} {r['step_s'] / base['step_s']:8.2f}")
    if args.only is None or all(n in args.only for n in TARGETS[:2]):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--interleaved-worker",
                              "--steps", str(args.steps)], capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(f"interleaved timing: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return
        _print_targets({r["name"]: r for r in results}, json.loads(lines[-1][len("RESULT "):]))


def _print_targets(by_name: Dict[str, dict], interleaved: Dict[str, float]) -> None:
    """The targets for the training default (compiled, per-tensor scales, v stochastically rounded)."""
    print("interleaved step ms (one process, steps taken in turn): "
          + ", ".join(f"{n} {t * 1e3:.1f}" for n, t in interleaved.items()))
    ours = interleaved.get("Fp8AdamW compiled")
    if ours is None:
        return
    checks = []
    if "Fp8AdamW compiled" in by_name:
        r = by_name["Fp8AdamW compiled"]
        checks.append(("state B/param <= 2.02", r["state_bytes"] / r["params"], 2.02))
    if "torch AdamW foreach" in interleaved:
        checks.append(("step / AdamW foreach <= 1.3", ours / interleaved["torch AdamW foreach"], 1.3))
    if "torchao AdamWFp8" in interleaved:
        checks.append(("step / torchao AdamWFp8 <= 1.0", ours / interleaved["torchao AdamWFp8"], 1.0))
    for label, value, limit in checks:
        print(f"target {label}: {value:.3f} {'met' if value <= limit else 'NOT met'}")


if __name__ == "__main__":
    main()
