"""Does an FP8-state Adam track AdamW's second moment? Candidate storage methods for v, measured.

Usage: python bench/bench_fp8_adam_numerics.py [--only NAME ...] [--layouts tensor block128 zero]

Prints two tables (the ones in docs/fp8_adam.md), for each storage method and each scale layout
(`tensor`: one scale per 64x256 matrix; `block128`: one per 128 elements; `zero`: one scale for a 1-D
ZeRO partition holding three matrices of gradient scales 1, 0.1 and 0.01, as DeepSpeed hands it over):

1. Update ratio: mean |dp| of the method / mean |dp| of torch.optim.AdamW over steps 900-999, fed the
   *same* gradients (a fixed per-element mean plus noise of std 0.3 or 1.0; parameters never feed back),
   lr 1e-3, no weight decay, beta2 0.95 and 0.999; and the median over elements of stored v / exact v.
2. Burst: every 128th element of a 4096-element row holds a constant gradient 1 (it holds the amax of
   its block and of the tensor) and has done so long enough for its v to settle (5 / (1 - beta2) warm-up
   steps); the other elements of that row get one gradient of 0.1 and then zeros, so their exact v
   decays as beta2^t. Reported: the row mean of stored v / exact v after 60 steps (beta2 0.95) or 3000
   steps (0.999), and the largest |ratio - 1| along the way.

The candidates are simulated here with the optimizer's own quantizer (`fp8_state_quant.quantize`):
an Adam step in FP32 between a dequantize and a requantize, as in `Fp8AdamW`. The row
"Fp8AdamW default" runs the real optimizer (it must agree with its simulated method), and
"torchao AdamWFp8" runs torchao's optimizer (E4M3 moments, blocks of 256, round-to-nearest).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.optimizer.fp8_adam import Fp8AdamW  # noqa: E402
from megatron.optimizer.fp8_state_quant import (  # noqa: E402
    MomentFormat, dequantize, moment_format, quantize, storage_numel,
)

LR, BETA1, EPS = 1e-3, 0.9, 1e-8
STEPS, WINDOW = 1000, 100


# ----------------------------------------------------------------------------- candidate methods
@dataclass(frozen=True)
class Method:
    """How m and v are stored. `v_transform`: 'none', 'sqrt' (store sqrt(v)) or 'coat' (store v**k per
    block with k stretching the block's dynamic range onto the format's, COAT's expansion); `v_feedback`:
    keep v's rounding error in a second FP8 tensor (error feedback)."""

    m_dtype: str = "e4m3"
    v_dtype: str = "e5m2"
    m_sr: bool = False
    v_sr: bool = False
    v_transform: str = "none"
    v_feedback: bool = False

    def bytes_per_param(self, n: int, block: int) -> float:
        def one(dtype: str) -> float:
            fmt = moment_format(dtype, block)
            if not fmt.is_fp8:
                return n * torch.finfo(fmt.torch_dtype).bits / 8
            n_scales = -(-n // block) if block else 1
            extra = 4 * n_scales if self.v_transform == "coat" and dtype == self.v_dtype else 0
            return storage_numel(n, fmt) + 4 * n_scales + extra
        v = one(self.v_dtype) * (2 if self.v_feedback else 1)
        return (one(self.m_dtype) + v) / n


METHODS: Dict[str, Method] = {
    "RTN m, RTN v": Method(),
    "RTN m, SR v": Method(v_sr=True),
    "SR m, SR v": Method(m_sr=True, v_sr=True),
    "RTN m, sqrt(v) e5m2 RTN": Method(v_transform="sqrt"),
    "RTN m, sqrt(v) e5m2 SR": Method(v_sr=True, v_transform="sqrt"),
    "RTN m, sqrt(v) e4m3 RTN": Method(v_dtype="e4m3", v_transform="sqrt"),
    "SR m, sqrt(v) e4m3 SR": Method(v_dtype="e4m3", m_sr=True, v_sr=True, v_transform="sqrt"),
    "RTN m, COAT e4m3 v RTN": Method(v_dtype="e4m3", v_transform="coat"),
    "RTN m, v + error feedback": Method(v_feedback=True),
    "RTN m, v bf16 (reference)": Method(v_dtype="bf16"),
}


class SimulatedState:
    """m and v of one flat tensor stored as `method` says, with the scale layout `block` (0 = one)."""

    def __init__(self, method: Method, n: int, block: int, seed: int = 0) -> None:
        self.method, self.n, self.block = method, n, block
        self.m_fmt = moment_format(method.m_dtype, block)
        self.v_fmt = moment_format(method.v_dtype, block)
        self.gen = torch.Generator().manual_seed(seed)
        zeros = torch.zeros(n)
        self.m = self._q(zeros, self.m_fmt, False)
        self.v = self._q(zeros, self.v_fmt, False)
        self.v_err = self._q(zeros, self.v_fmt, False)
        self.k = torch.ones(1)

    def _q(self, x: torch.Tensor, fmt: MomentFormat, sr: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        noise = torch.rand(storage_numel(x.numel(), fmt), generator=self.gen) if sr else None
        return quantize(x, fmt, noise)

    def _dq(self, stored) -> torch.Tensor:
        return dequantize(stored[0], stored[1], self.n)

    def values(self) -> Tuple[torch.Tensor, torch.Tensor]:
        m, v = self._dq(self.m), self._dq(self.v)
        t = self.method.v_transform
        if t == "sqrt":
            v = v * v
        elif t == "coat":
            blocks = v.view(-1, self.block or self.n)
            v = (blocks.clamp_min(0) ** (1.0 / self.k)).view(-1)
        if self.method.v_feedback:
            v = v + self._dq(self.v_err)
        return m, v

    def store(self, m: torch.Tensor, v: torch.Tensor) -> None:
        meth = self.method
        self.m = self._q(m, self.m_fmt, meth.m_sr)
        if meth.v_transform == "sqrt":
            self.v = self._q(v.sqrt(), self.v_fmt, meth.v_sr)
        elif meth.v_transform == "coat":
            # y = (v / amax)**k with k per block chosen so that the block's max/min(nonzero) ratio fills
            # the format's max/min_subnormal ratio; amax**k is folded into the FP8 scale.
            blocks = v.view(-1, self.block or self.n)
            amax = blocks.amax(dim=1, keepdim=True)
            amin = torch.where(blocks > 0, blocks, torch.full_like(blocks, float("inf"))).amin(dim=1, keepdim=True)
            ratio = torch.where(torch.isfinite(amin) & (amax > amin), amax / amin, torch.full_like(amax, 2.0))
            k = math.log(self.v_fmt.max / self.v_fmt.min_subnormal) / ratio.log()
            self.k = k
            self.v = self._q((blocks ** k).view(-1), self.v_fmt, meth.v_sr)
        else:
            self.v = self._q(v, self.v_fmt, meth.v_sr)
        if meth.v_feedback:
            self.v_err = self._q(v - self._dq(self.v), self.v_fmt, False)


def simulated_stepper(method: Method, n: int, block: int) -> Callable:
    state, step = SimulatedState(method, n, block), [0]

    def run(g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        step[0] += 1
        t = step[0]
        m, v = state.values()
        m = torch.lerp(m, g, 1 - BETA1)
        v = v * BETA2[0] + g * g * (1 - BETA2[0])
        dp = -LR / (1 - BETA1**t) * m / (v.sqrt() / math.sqrt(1 - BETA2[0]**t) + EPS)
        state.store(m, v)
        return dp, state.values()[1]
    return run


BETA2 = [0.95]  # set per experiment (the simulated stepper reads it)


def optimizer_stepper(make: Callable, n: int, v_of: Callable) -> Callable:
    p = torch.nn.Parameter(torch.zeros(n))
    opt = make([p])

    def run(g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        return p.detach() - before, v_of(opt, p)
    return run


def _fp8adamw_v(opt, p) -> torch.Tensor:
    s = opt.state[p]
    return dequantize(s["exp_avg_sq"], s.get("exp_avg_sq_scale_inv"), p.numel())


def _torchao_v(opt, p) -> torch.Tensor:
    return opt.state[p]["exp_avg_sq"].dequantize().float().view(-1)


def steppers(n: int, block: int) -> Dict[str, Callable]:
    out = {name: (lambda meth=meth: simulated_stepper(meth, n, block)) for name, meth in METHODS.items()}
    out["Fp8AdamW default"] = lambda: optimizer_stepper(
        lambda ps: Fp8AdamW([{"params": ps, "fp8_states": True}], lr=LR, betas=(BETA1, BETA2[0]), eps=EPS,
                            weight_decay=0.0, block_size=block), n, _fp8adamw_v)
    try:
        from torchao.optim import AdamWFp8

        out["torchao AdamWFp8 (e4m3, block 256)"] = lambda: optimizer_stepper(
            lambda ps: AdamWFp8(ps, lr=LR, betas=(BETA1, BETA2[0]), eps=EPS, weight_decay=0.0), n, _torchao_v)
    except ImportError:
        pass
    return out


# ----------------------------------------------------------------------------- experiments
LAYOUTS = {"tensor": 0, "block128": 128, "zero": 0}


def gradient_scales(layout: str) -> torch.Tensor:
    """Per-element gradient scale of the flat tensor: one 64x256 matrix, or a ZeRO partition of three."""
    if layout == "zero":
        parts = [(64 * 256, 1.0), (128 * 128, 0.1), (64 * 128, 0.01)]
        return torch.cat([torch.full((k,), s) for k, s in parts])
    return torch.ones(64 * 256)


def update_ratio(make: Callable, layout: str, noise: float, seed: int = 0) -> Tuple[float, float]:
    scales = gradient_scales(layout)
    n = scales.numel()
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=g) * scales
    ours = make()
    ref_p = torch.nn.Parameter(torch.zeros(n))
    ref = torch.optim.AdamW([ref_p], lr=LR, betas=(BETA1, BETA2[0]), eps=EPS, weight_decay=0.0)
    num = den = 0.0
    for t in range(STEPS):
        grad = mean + noise * scales * torch.randn(n, generator=g)
        before = ref_p.detach().clone()
        ref_p.grad = grad.clone()
        ref.step()
        dp, v = ours(grad)
        if t >= STEPS - WINDOW:
            num += dp.abs().mean().item()
            den += (ref_p.detach() - before).abs().mean().item()
    exact_v = ref.state[ref_p]["exp_avg_sq"]
    v_ratio = (v / exact_v).median().item()
    return num / den, v_ratio


def burst(make: Callable, layout: str) -> Tuple[float, float]:
    """(stored/exact row-mean v of the burst row at the end, max |ratio - 1| along the way)."""
    beta2 = BETA2[0]
    scales = gradient_scales(layout)
    n = scales.numel()
    row = torch.arange(4096) + (n - 4096 if layout == "zero" else 0)  # zero: in the 0.01 matrix's row
    holders = row[::128]
    burst_idx = row[(torch.arange(4096) % 128) != 0]
    ours = make()
    warmup, steps = math.ceil(5 / (1 - beta2)), (60 if beta2 == 0.95 else 3000)
    g = torch.zeros(n)
    g[holders] = 1.0
    for _ in range(warmup):
        ours(g)
    gb = g.clone()
    gb[burst_idx] = 0.1
    exact = (1 - beta2) * 0.1**2
    worst, ratio = 0.0, float("nan")
    for t in range(steps):
        _, v = ours(gb if t == 0 else g)
        if t:
            exact *= beta2
        ratio = (v[burst_idx].double().mean() / exact).item()
        worst = max(worst, abs(ratio - 1))
    return ratio, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="subset of method names")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--skip-burst", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for layout in args.layouts:
        block = LAYOUTS[layout]
        n = gradient_scales(layout).numel()
        names = [k for k in steppers(n, block) if args.only is None or any(o in k for o in args.only)]
        cols = [(b, s) for b in (0.95, 0.999) for s in (0.3, 1.0)]
        print(f"\nlayout {layout}: update ratio mean|dp|/AdamW (steps 900-999) | median v/exact v (step 999)")
        head = " ".join(f"b2={b} n={s}".rjust(16) for b, s in cols)
        print(f"{'method':36s} {'B/param':>7s} {head} | burst v/exact end (max|r-1|) b2=0.95  b2=0.999")
        for name in names:
            t0 = time.perf_counter()
            meth = METHODS.get(name)
            bpp = meth.bytes_per_param(n, block) if meth else float("nan")
            cells = []
            for b, s in cols:
                BETA2[0] = b
                r, vr = update_ratio(steppers(n, block)[name], layout, s)
                cells.append(f"{r:6.3f} | {vr:6.2f}".rjust(16))
            bursts = []
            if not args.skip_burst:
                for b in (0.95, 0.999):
                    BETA2[0] = b
                    end, worst = burst(steppers(n, block)[name], layout)
                    bursts.append(f"{end:6.2f} ({worst:5.2f})")
            print(f"{name:36s} {bpp:7.3f} {' '.join(cells)} | {'  '.join(bursts)}"
                  f"   [{time.perf_counter() - t0:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
