"""Why Smooth-SwiGLU: one aligned SwiGLU channel collapses FP8 accuracy; smoothing restores it.

The experiment (CPU, a few seconds):
1. A SwiGLU MLP (`megatron.model.transformer.MLP`, FP32 weights) and unit-RMS inputs (as after RMSNorm).
2. "Outlier" model: one channel's up row (w1) is set equal to its gate row (w2), the alignment the paper
   observes late in training, and both are scaled by c, found by bisection so that on the measured batch
   that channel's SwiGLU product peaks at `--ratio` (default 1000) times the largest other channel.
   The "no outlier" row uses the untouched weights.
3. Two batches, as in training with delayed scaling: a *calibration* batch of ordinary tokens (one training
   step; then `fp8_optimizer_step` sets the delayed scales), and a *measured* batch: ordinary tokens plus a
   few rare tokens pointing along the aligned row (unit RMS too, so fc1's input amax does not jump).
   Only on those rare tokens does the quadratic channel explode, which a scale chosen from the previous
   step cannot anticipate.
4. SQNR (dB) of each FP8 MLP's output on the measured batch against the FP32 MLP (under bf16 autocast, as
   in training). Columns: plain FP8, Smooth-SwiGLU channel, Smooth-SwiGLU token, fc2 kept in BF16.

A second table uses current (tensorwise) scaling: there the per-tensor scale follows the outlier, E4M3's
~15 binades of normal range absorb a 1000x channel, and plain FP8 barely suffers; the collapse is the
delayed-scaling lag (the paper's recipe) meeting a sudden quadratic outlier.

    python tools/fp8_outlier_demo.py [--ratio 1000] [--hidden 256] [--ffn 512] [--tokens 2048]
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.config import ModelConfig, SmoothSwiGLUGranularity  # noqa: E402
from megatron.fp8 import Fp8Linear, Fp8Recipe, Fp8Scaling, fp8_optimizer_step  # noqa: E402
from megatron.model.transformer import MLP  # noqa: E402

COLUMNS = ("plain FP8", "smooth channel", "smooth token", "fc2 BF16")
ROWS = ("no outlier", "outlier")
OUTLIER_CHANNEL = 0


def sqnr_db(approx: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    noise = (approx.double() - reference.double()).norm()
    return float("inf") if noise == 0 else 20 * math.log10(float(reference.double().norm() / noise))


def model_config(hidden: int, ffn: int, smooth: Optional[SmoothSwiGLUGranularity] = None) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=4,
                       ffn_hidden_size=ffn, seq_length=32, max_position_embeddings=32, padded_vocab_size=128,
                       kv_channels=hidden // 4, smooth_swiglu=smooth)


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True))


def make_batches(mlp: MLP, tokens: int, rare: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration batch, measured batch): ordinary unit-RMS tokens; the measured batch ends with `rare`
    tokens pointing along the gate row of the outlier channel."""
    g = torch.Generator().manual_seed(seed + 12345)  # not the weight-init stream (it would align tokens)
    hidden = mlp.linear_fc1.in_features
    calibration = _unit_rms(torch.randn(tokens, hidden, generator=g))
    ordinary = _unit_rms(torch.randn(tokens - rare, hidden, generator=g))
    direction = mlp.linear_fc1.weight[OUTLIER_CHANNEL].detach()
    aligned = _unit_rms(direction + 0.3 * direction.abs().mean() * torch.randn(rare, hidden, generator=g))
    return calibration, torch.cat([ordinary, aligned])


@torch.no_grad()
def swiglu_product(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.linear_fc1(x).chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.no_grad()
def inject_outlier(mlp: MLP, x: torch.Tensor, ratio: float) -> MLP:
    """A copy of `mlp` whose channel 0 has up row = gate row, scaled until max|h_0| = ratio * max others."""
    ffn = mlp.linear_fc2.in_features
    out = copy.deepcopy(mlp)
    weight = out.linear_fc1.weight
    weight[ffn + OUTLIER_CHANNEL] = weight[OUTLIER_CHANNEL]
    aligned = weight.clone()
    others = swiglu_product(mlp, x)[:, 1:].abs().max()
    lo, hi = 1e-3, 1e4
    for _ in range(80):  # bisection on log(c): h_0 grows ~ c^2
        c = math.sqrt(lo * hi)
        weight.copy_(aligned)
        weight[OUTLIER_CHANNEL] *= c
        weight[ffn + OUTLIER_CHANNEL] *= c
        if swiglu_product(out, x)[:, OUTLIER_CHANNEL].abs().max() / others < ratio:
            lo = c
        else:
            hi = c
    return out


def fp8_variant(mlp: MLP, column: str, recipe: Fp8Recipe) -> MLP:
    """A copy of `mlp` with the FP8 treatment of `column`."""
    smooth = {"smooth channel": SmoothSwiGLUGranularity.CHANNEL,
              "smooth token": SmoothSwiGLUGranularity.TOKEN}.get(column)
    hidden, ffn = mlp.linear_fc1.in_features, mlp.linear_fc2.in_features
    out = MLP(model_config(hidden, ffn, smooth))
    out.load_state_dict(mlp.state_dict())
    out.linear_fc1 = Fp8Linear.from_linear(out.linear_fc1, recipe)
    if column != "fc2 BF16":
        out.linear_fc2 = Fp8Linear.from_linear(out.linear_fc2, recipe)
    return out


def _fp8_output(mlp: MLP, calibration: torch.Tensor, measured: torch.Tensor) -> torch.Tensor:
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
    """{row: {column: SQNR dB}} for the rows `ROWS` and columns `COLUMNS` (see the module docstring)."""
    torch.manual_seed(seed)
    base = MLP(model_config(hidden, ffn))
    calibration, measured = make_batches(base, tokens, rare, seed)
    models = {"no outlier": base, "outlier": inject_outlier(base, measured, ratio)}
    recipe = Fp8Recipe(scaling=scaling)
    table: dict[str, dict[str, float]] = {}
    for row, mlp in models.items():
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


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=1000.0, help="outlier channel max / largest other channel max")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rare", type=int, default=8, help="tokens of the measured batch along the aligned row")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    common = dict(ratio=a.ratio, hidden=a.hidden, ffn=a.ffn, tokens=a.tokens, rare=a.rare, seed=a.seed)
    print(f"SQNR (dB) of the FP8 MLP output vs FP32; hidden {a.hidden}, ffn {a.ffn}, {a.tokens} tokens, "
          f"outlier ratio {a.ratio:g}, E4M3 forward")
    for scaling, title in ((Fp8Scaling.DELAYED, "delayed scaling (the paper's recipe; scales from the previous step)"),
                           (Fp8Scaling.TENSORWISE, "current (tensorwise) scaling")):
        print()
        print(format_table(sqnr_table(scaling, **common), title))


if __name__ == "__main__":
    main()
