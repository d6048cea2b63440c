"""Why Smooth-SwiGLU: one aligned SwiGLU channel collapses FP8 accuracy; smoothing restores it.

A thin CLI over `megatron/model/swiglu_outliers.py` (the experiment: an MLP whose channel 0 has its up row
aligned to its gate row and scaled until its product peaks at `--ratio` times the largest other channel;
a calibration batch of ordinary tokens, then a measured batch with a few rare tokens along the aligned row).

Default: the whole-output tables. SQNR (dB) of the FP8 MLP output on the measured batch vs the FP32 MLP
(bf16 autocast, as in training), after one calibration training step that sets the delayed scales, under
delayed and current (tensorwise) scaling. Columns: plain FP8, Smooth-SwiGLU channel, Smooth-SwiGLU token,
fc2 kept in BF16.

`--parts`: per-part SQNR against float64 (fp32 compute, tensorwise scaling) at outlier ratios 1e3, 1e4,
1e5 (`--ratios`), for plain FP8, the token form and the channel-form candidates (`ChannelSplit`: the full
fold alpha = 1 of the paper, SmoothQuant-style splits alpha, a fold clamped to C binades), plus the
output SQNR of a sudden outlier under delayed scaling with only fc2 in FP8 (`sudden`), and the forward
part of the "full fold with per-K-block (128) weight scales" candidate. This is the table in
docs/smooth_swiglu.md that chose the default split.

    python tools/fp8_outlier_demo.py [--ratio 1000] [--hidden 256] [--ffn 512] [--tokens 2048]
    python tools/fp8_outlier_demo.py --parts [--ratios 1e3 1e4 1e5] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.fp8 import Fp8Recipe, Fp8Scaling, fp8_optimizer_step  # noqa: E402
from megatron.fp8.stats import sqnr_db  # noqa: E402
from megatron.model.smooth_swiglu import ChannelSplit  # noqa: E402
from megatron.model.swiglu_outliers import (CHANNEL, FC2_BF16, PARTS, PLAIN, TOKEN, OutlierSetup,  # noqa: E402
                                            blockwise_fwd_others_sqnr, fp8_variant, outlier_mlp, part_sqnr,
                                            sudden_outlier_sqnr)

COLUMNS = (PLAIN, CHANNEL, TOKEN, FC2_BF16)
ROWS = ("no outlier", "outlier")
CANDIDATES = (PLAIN, TOKEN, ChannelSplit(1.0), ChannelSplit(0.75), ChannelSplit(0.5), ChannelSplit(0.25),
              ChannelSplit(1.0, max_weight_binades=8))


def _fp8_output(mlp, calibration: torch.Tensor, measured: torch.Tensor) -> torch.Tensor:
    """One calibration training step (fills the delayed-scaling state), then the measured forward."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mlp.train()
        mlp(calibration.clone().requires_grad_()).float().square().mean().backward()
        fp8_optimizer_step(mlp)
        mlp.eval()
        with torch.no_grad():
            return mlp(measured).float()


def sqnr_table(scaling: Fp8Scaling = Fp8Scaling.DELAYED, ratio: float = 1000.0, hidden: int = 256,
               ffn: int = 512, tokens: int = 2048, rare: int = 8, seed: int = 0) -> dict[str, dict[str, float]]:
    """{row: {column: SQNR dB}} of the whole output for the rows `ROWS` and columns `COLUMNS`."""
    setup = OutlierSetup(hidden=hidden, ffn=ffn, tokens=tokens, rare=rare, seed=seed)
    recipe = Fp8Recipe(scaling=scaling)
    table: dict[str, dict[str, float]] = {}
    for row, row_ratio in zip(ROWS, (None, ratio)):
        mlp, calibration, measured = outlier_mlp(setup, row_ratio)
        with torch.no_grad():
            reference = mlp(measured)
        table[row] = {col: sqnr_db(_fp8_output(fp8_variant(mlp, col, recipe), calibration, measured), reference)
                      for col in COLUMNS}
    return table


def format_table(table: dict[str, dict[str, float]], title: str) -> str:
    width = max(len(c) for c in COLUMNS) + 2
    lines = [title, f"{'':<12}" + "".join(f"{c:>{width}}" for c in COLUMNS)]
    for row, values in table.items():
        lines.append(f"{row:<12}" + "".join(f"{values[c]:>{width}.1f}" for c in COLUMNS))
    return "\n".join(lines)


def _name(variant) -> str:
    if not isinstance(variant, ChannelSplit):
        return variant
    if variant.max_weight_binades is not None:
        return f"channel clamp C={variant.max_weight_binades}"
    return f"channel alpha={variant.weight_share:g}" + (" (paper)" if variant.weight_share == 1 else "")


def parts_table(setup: OutlierSetup, ratios: tuple[float, ...]) -> str:
    """The per-part candidate table (see the module docstring)."""
    lines = [f"{'ratio':>6}  {'variant':<24}" + "".join(f"{p:>11}" for p in PARTS) + f"{'sudden':>9}"]
    for ratio in ratios:
        mlp, calibration, measured = outlier_mlp(setup, ratio)
        for variant in CANDIDATES:
            parts = part_sqnr(mlp, measured, variant)
            sudden = sudden_outlier_sqnr(mlp, calibration, measured, variant)
            lines.append(f"{ratio:>6.0e}  {_name(variant):<24}" + "".join(f"{parts[p]:>11.1f}" for p in PARTS)
                         + f"{sudden:>9.1f}")
        blockwise = blockwise_fwd_others_sqnr(mlp, measured)
        lines.append(f"{ratio:>6.0e}  {'full fold, K-block 128':<24}{'':>11}{blockwise:>11.1f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=1000.0, help="outlier channel max / largest other channel max")
    p.add_argument("--parts", action="store_true", help="per-part SQNR of the candidates (see the docstring)")
    p.add_argument("--ratios", type=float, nargs="+", default=[1e3, 1e4, 1e5], help="with --parts")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 2048; 1024 with --parts)")
    p.add_argument("--rare", type=int, default=8, help="tokens of the measured batch along the aligned row")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.parts:
        setup = OutlierSetup(hidden=a.hidden, ffn=a.ffn, tokens=a.tokens or 1024, rare=a.rare, seed=a.seed)
        print(f"SQNR (dB) vs float64 per part; hidden {setup.hidden}, ffn {setup.ffn}, {setup.tokens} tokens "
              f"({setup.rare} rare), hybrid E4M3/E5M2, tensorwise scaling; sudden: output, delayed scaling, "
              f"fc2 only in FP8")
        print(parts_table(setup, tuple(a.ratios)))
        return
    common = dict(ratio=a.ratio, hidden=a.hidden, ffn=a.ffn, tokens=a.tokens or 2048, rare=a.rare, seed=a.seed)
    print(f"SQNR (dB) of the FP8 MLP output vs FP32; hidden {a.hidden}, ffn {a.ffn}, {common['tokens']} tokens, "
          f"outlier ratio {a.ratio:g}, E4M3 forward")
    for scaling, title in ((Fp8Scaling.DELAYED, "delayed scaling (the paper's recipe; scales from the previous step)"),
                           (Fp8Scaling.TENSORWISE, "current (tensorwise) scaling")):
        print()
        print(format_table(sqnr_table(scaling, **common), title))


if __name__ == "__main__":
    main()
