"""Per-call time of the CPU's compiled FP8 graphs: through torch.compile vs called directly (megatron/fp8/direct.py),
measured alternately in one process, per shape.

    python bench/bench_direct_calls.py [--threads 2] [--rounds 8]

Prints the median microseconds per call both ways and their ratio for: the cast of an activation to its FP8 values
with its amax (`fused.known_values_and_amax`, the eager FP8 layer's), the per-step cast of a weight
(`fused.quantize_tensor`, the demo model's weight shapes: torch.compile's graph is one per shape), and a whole
Fp8AdamW step over the demo model's 18 FP8-state matrices (each updated in one call). The casts' two ways are checked
bitwise equal first; both ways run the same inductor kernels, so the difference is the per-call work.
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
from megatron.optimizer.fp8_adam import Fp8AdamW  # noqa: E402

SHAPES = [(128, 128), (2048, 128), (2048, 704)]
WEIGHTS = [(512, 256), (1408, 256), (256, 704)]  # the demo model's qkv, fc1 and fc2
# The demo model's matrices (4 layers of qkv, proj, fc1, fc2; embedding and output layer)
ADAM_SHAPES = [(512, 256), (256, 256), (1408, 256), (256, 704)] * 4 + [(4096, 256)] * 2


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
    _check_equal(through_compile, direct)
    return {"torch.compile": through_compile, "direct": direct}


def _check_equal(*ways) -> None:
    for a, b in zip(*(w() if isinstance(w(), tuple) else (w(),) for w in ways)):
        assert (a is None and b is None) or torch.equal(a, b), "the two ways differ"


def _weight_cast_ways(shape: tuple) -> dict:
    """The per-step cast of a weight (delayed scaling, E4M3, BF16 values): torch.compile's graph for its shape, and
    the direct graph every shape shares."""
    w = torch.randn(*shape) * 0.02
    args = (w, torch.tensor(4.0), torch.tensor(True), True, 448.0, 0, False, torch.float8_e4m3fn, torch.bfloat16,
            True, True)

    def through_compile():
        return fused._quantize_tensor_c(*args)

    def direct():
        return fused._DIRECT.call_or_build(fused._quantize_tensor, args)

    if direct() is None:
        raise SystemExit("no direct graph for the weight cast")
    _check_equal(through_compile, direct)
    return {"torch.compile": through_compile, "direct": direct}


def _adam_ways() -> dict:
    """A whole Fp8AdamW step (compiled update) with and without the direct graph."""
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in ADAM_SHAPES]
    opt = Fp8AdamW(params, lr=1e-4, compile=True)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3

    def step(direct: bool):
        opt.direct_calls = direct
        opt.step()

    step(True), step(False)
    return {"torch.compile": lambda: step(False), "direct": lambda: step(True)}


def _row(name: str, shape: str, ways: dict, rounds: int, calls: int) -> None:
    runs = {way: [] for way in ways}
    for _ in range(rounds):
        for way, fn in ways.items():
            runs[way].append(_median_us(fn, calls))
    slow, fast = (statistics.median(runs[w]) for w in ("torch.compile", "direct"))
    print(f"{name:<26} {shape:<12} {slow:>13.1f} {fast:>8.1f} {slow / fast:>6.2f}x")


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
        ways = _ways(fused._known_values_amax_any_shape, (x, scale, 448.0, torch.float8_e4m3fn, torch.bfloat16))
        _row("cast + amax (E4M3)", str(shape), ways, args.rounds, args.calls)
    for shape in WEIGHTS:
        _row("weight cast (per step)", str(shape), _weight_cast_ways(shape), args.rounds, args.calls)
    _row("Fp8AdamW step", f"{len(ADAM_SHAPES)} tensors", _adam_ways(), args.rounds, max(args.calls // 30, 5))


if __name__ == "__main__":
    main()
