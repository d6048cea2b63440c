"""SwiGLU weight alignment over a run: per-layer |cos(w1_i, w2_i)| from checkpoints (the paper's figure, small).

Reads one checkpoint folder (`iter_0000100`) or every `iter_*` folder of a run directory (`--save`), of any
layout the trainer writes (single process, TP shards, DeepSpeed ZeRO 0-3, pipeline stages), with
`torch.load(weights_only=True)` (tensors and plain data only, no code is run). For each checkpoint and layer it prints the max and 99th percentile of the alignment
|cos| between each FFN channel's up row (w1, linear branch) and gate row (w2, Swish branch) of
`linear_fc1` and the number of channels above 0.5; then the top-k most aligned channels of the last
checkpoint with their signed cosine; and, with `--png`, plots max and p99 per layer against the iteration.

    python tools/analyze_swiglu.py RUN_DIR [--top-k 10] [--png alignment.png]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.checkpoint.layouts import detect_layout, read_checkpoint  # noqa: E402
from megatron.model.swiglu_diagnostics import alignment_summary, up_gate_alignment  # noqa: E402

_FC1 = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.linear_fc1\.weight$")


def checkpoint_dirs(path: Path) -> list[Path]:
    """`path` itself if it is one checkpoint folder, else its `iter_*` folders in iteration order."""
    if detect_layout(path) is not None:
        return [path]
    found = sorted(p for p in path.glob("iter_*") if detect_layout(p) is not None)
    if not found:
        raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a run with iter_* checkpoints")
    return found


def load_fc1_weights(ckpt: Path) -> tuple[int, dict[int, torch.Tensor]]:
    """(iteration, {layer: linear_fc1.weight}) of one checkpoint folder, of any layout (TP shards merged)."""
    payload, _, train_state = read_checkpoint(ckpt)
    layers = {}
    for key, tensor in payload["model"].items():
        match = _FC1.match(key)
        if match:
            layers[int(match.group(1))] = tensor
    iteration = int(payload.get("iteration", train_state.get("iteration", int(ckpt.name.split("_")[-1]))))
    return iteration, dict(sorted(layers.items()))


def analyze(path: Path) -> list[tuple[int, dict[int, dict[str, float]]]]:
    """[(iteration, {layer: alignment summary})] over the checkpoints under `path`."""
    rows = []
    for ckpt in checkpoint_dirs(path):
        iteration, layers = load_fc1_weights(ckpt)
        rows.append((iteration, {i: alignment_summary(up_gate_alignment(w)) for i, w in layers.items()}))
    return rows


def top_aligned(fc1_weights: dict[int, torch.Tensor], k: int) -> list[tuple[int, int, float]]:
    """The k most aligned (layer, channel, signed cosine) over all layers."""
    entries = []
    for layer, w in fc1_weights.items():
        gate, up = w.float().chunk(2, dim=0)
        cos = torch.nn.functional.cosine_similarity(up, gate, dim=-1, eps=1e-12)
        entries += [(layer, c, float(cos[c])) for c in range(cos.numel())]
    return sorted(entries, key=lambda e: -abs(e[2]))[:k]


def plot(rows: list[tuple[int, dict[int, dict[str, float]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iterations = [it for it, _ in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for layer in rows[-1][1]:
        color = ax.plot(iterations, [r[layer]["align_max"] for _, r in rows], marker="o",
                        label=f"layer {layer} max")[0].get_color()
        ax.plot(iterations, [r[layer]["align_p99"] for _, r in rows], linestyle="--", color=color,
                label=f"layer {layer} p99")
    ax.set_xlabel("iteration")
    ax.set_ylabel("|cos(w1_i, w2_i)|")
    ax.set_title("SwiGLU up/gate weight alignment")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path, help="a checkpoint folder (iter_*) or a run's --save folder")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--png", type=Path, default=None, help="write the alignment-vs-iteration plot here")
    a = p.parse_args(argv)
    rows = analyze(a.path)
    print(f"{'iteration':>10} {'layer':>5} {'max|cos|':>9} {'p99|cos|':>9} {'#>0.5':>6}")
    for iteration, layers in rows:
        for layer, s in layers.items():
            print(f"{iteration:>10} {layer:>5} {s['align_max']:>9.4f} {s['align_p99']:>9.4f} "
                  f"{int(s['align_count_gt_0.5']):>6}")
    last_iteration, last_weights = load_fc1_weights(checkpoint_dirs(a.path)[-1])
    print(f"\ntop {a.top_k} aligned channels at iteration {last_iteration} (signed cosine):")
    for layer, channel, cos in top_aligned(last_weights, a.top_k):
        print(f"  layer {layer:>3} channel {channel:>6} cos {cos:+.4f}")
    if a.png is not None:
        plot(rows, a.png)
        print(f"\nwrote {a.png}")


if __name__ == "__main__":
    from megatron.errors import run_cli

    sys.exit(run_cli(main))
