"""Compare training runs: a summary table and plots aligned by consumed tokens, from TensorBoard logs.

    python tools/compare_runs.py runs/bf16/tb runs/fp8/tb [--labels bf16 fp8] [--output-dir runs/compare]
        [--json runs/compare/summary.json]

Each argument is a run's `--tensorboard-dir`. The first run is the reference for the relative gaps.
Printed: final and best validation loss, gap to the first run, test loss, tokens/s (median), peak
memory, skipped/NaN iterations, and the worst FP8 clipped fraction when FP8 statistics were logged
(`--log-fp8-stats`). Written to `--output-dir`: loss_vs_tokens.png, relative_gap_vs_tokens.png, and
fp8_clipping.png / fp8_amax.png when FP8 statistics are present.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron.evaluation.run_compare import (  # noqa: E402
    TRAIN_LOSS, VALID_LOSS, RunSummary, compare, format_table, fp8_tags, relative_gap,
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _max_over(runs_scalars: dict, tags: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Element-wise max over several tags of one run, on the union of their steps."""
    steps = np.unique(np.concatenate([runs_scalars[t][0] for t in tags]))
    values = np.full(len(steps), -np.inf)
    for t in tags:
        s, v = runs_scalars[t]
        idx = np.searchsorted(steps, s)
        values[idx] = np.maximum(values[idx], v)
    return steps, values


def plot_losses(runs: Sequence[RunSummary], out_dir: str) -> list[str]:
    plt = _pyplot()
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        for ax, tag in zip(axes, (TRAIN_LOSS, VALID_LOSS)):
            if tag in run.scalars:
                x, y = run.scalars[tag]
                ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=run.name)
    for ax, title in zip(axes, ("training loss", "validation loss")):
        ax.set(title=title, xlabel="consumed tokens", ylabel="lm loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out_dir, "loss_vs_tokens.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ref = runs[0]
    for run in runs[1:]:
        for ax, tag in zip(axes, (TRAIN_LOSS, VALID_LOSS)):
            if tag in run.scalars and tag in ref.scalars:
                x, gap = relative_gap(run.scalars[tag], ref.scalars[tag])
                ax.plot(x, gap * 100, label=f"{run.name} vs {ref.name}")
    for ax, title in zip(axes, ("training loss gap", "validation loss gap")):
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set(title=title, xlabel="consumed tokens", ylabel="relative gap (%)")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out_dir, "relative_gap_vs_tokens.png"))
    return written


def _fp8_tags(run: RunSummary, stat: str) -> tuple[list[str], str]:
    """The run's tags for `stat` keyed by tokens (aligned across runs) if logged so, else by iteration."""
    by_tokens = fp8_tags(run.scalars, stat, vs_tokens=True)
    return (by_tokens, "consumed tokens") if by_tokens else (fp8_tags(run.scalars, stat), "iteration")


def _role(tag: str) -> str:
    return tag.split("/")[-2]  # fp8/<layer>/<role>/<stat>[ vs tokens]


def plot_fp8(runs: Sequence[RunSummary], out_dir: str) -> list[str]:
    """Worst clipped fraction and largest amax per tensor role, per run."""
    with_fp8 = [r for r in runs if fp8_tags(r.scalars, "clipped_frac")]
    if not with_fp8:
        return []
    plt = _pyplot()
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xlabel = "iteration"
    for run in with_fp8:
        tags, xlabel = _fp8_tags(run, "clipped_frac")
        x, y = _max_over(run.scalars, tags)
        ax.plot(x, y, label=run.name)
    ax.set(title="FP8 worst clipped fraction (max over layers and roles)", xlabel=xlabel,
           ylabel="clipped fraction")
    ax.set_yscale("symlog", linthresh=1e-6)  # zero clipping is common and must stay visible
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out_dir, "fp8_clipping.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in with_fp8:
        tags, xlabel = _fp8_tags(run, "amax")
        for role in sorted({_role(t) for t in tags}):
            x, y = _max_over(run.scalars, [t for t in tags if _role(t) == role])
            ax.plot(x, y, label=f"{run.name} {role}")
    ax.set(title="FP8 amax (max over layers)", xlabel=xlabel, ylabel="amax", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out_dir, "fp8_amax.png"))
    return written


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> list[RunSummary]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="TensorBoard folders of the runs (the first is the reference)")
    p.add_argument("--labels", nargs="+", default=None, help="a name per run (default: folder names)")
    p.add_argument("--output-dir", default=os.path.join("runs", "compare"), help="where the PNGs go")
    p.add_argument("--json", default=None, help="also write the table as JSON to this file")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    runs = compare(args.runs, args.labels)
    print(format_table(runs))
    if not args.no_plots:
        os.makedirs(args.output_dir, exist_ok=True)
        for path in plot_losses(runs, args.output_dir) + plot_fp8(runs, args.output_dir):
            print(f"wrote {path}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in runs], f, indent=2)
        print(f"wrote {args.json}")
    return runs


if __name__ == "__main__":
    from megatron.errors import run_cli

    sys.exit(run_cli(main))
