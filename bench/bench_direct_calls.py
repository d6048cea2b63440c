"""Per-call time of the eager FP8 layer's start-up graphs: through torch.compile vs called directly (megatron/fp8/
direct.py), measured alternately in one process, per shape.

    python bench/bench_direct_calls.py [--threads 2] [--rounds 8]

Prints, for the cast of an activation to its FP8 values with its amax (`fused.known_values_and_amax`), the median
microseconds per call both ways and their ratio. Both ways run
the same inductor kernels (the results are checked bitwise equal first), so the difference is the per-call work.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from bench.common import wall_times  # noqa: E402
from megatron.fp8 import fused  # noqa: E402

SHAPES = [(128, 128), (2048, 128), (2048, 704)]


def _median_us(fn, calls: int) -> float:
    return statistics.median(wall_times(fn, calls)) * 1e6


def _ways(graph: fused.CompiledOrEager, args: tuple) -> dict:
    """Both ways of one call: torch.compile's graph for every shape, and the direct graph."""
    compiled = graph.compiled or torch.compile(graph.fn, dynamic=True, fullgraph=True,
                                               options={"cpp.dynamic_threads": True})

    def through_compile():
        with torch.no_grad():
            return compiled(*args)

    def direct():
        return fused._DIRECT.call(graph.fn, args)

    if direct() is None:
        raise SystemExit("no direct graph for this call (a torch without torch._inductor.standalone_compile, or "
                         "MEGATRON_FP8_DIRECT_CALLS=off)")
    for a, b in zip(*(w() if isinstance(w(), tuple) else (w(),) for w in (through_compile, direct))):
        assert torch.equal(a, b), "the two ways differ"
    return {"torch.compile": through_compile, "direct": direct}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="alternations of the two ways (median of their medians)")
    p.add_argument("--calls", type=int, default=300, help="calls per way and round")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fused.warm_up_upcasts(torch.device("cpu"), torch.bfloat16)
    scale = torch.tensor(2.0)
    print(f"torch {torch.__version__}, {args.threads} threads; microseconds per call (median)")
    print(f"{'call':<26} {'shape':<12} {'torch.compile':>13} {'direct':>8} {'ratio':>7}")
    for shape in SHAPES:
        x = torch.randn(*shape).to(torch.bfloat16)
        calls = {"cast + amax (E4M3)": _ways(fused._known_values_amax_any_shape,
                                             (x, scale, 448.0, torch.float8_e4m3fn, torch.bfloat16))}
        for name, ways in calls.items():
            runs = {way: [] for way in ways}
            for _ in range(args.rounds):
                for way, fn in ways.items():
                    runs[way].append(_median_us(fn, args.calls))
            slow, fast = (statistics.median(runs[w]) for w in ("torch.compile", "direct"))
            print(f"{name:<26} {str(shape):<12} {slow:>13.1f} {fast:>8.1f} {slow / fast:>6.2f}x")


if __name__ == "__main__":
    main()
