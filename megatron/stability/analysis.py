"""Reading the lab's runs back: per-layer series, per-run summaries, seed statistics and the PNG plots.

Sources, all written by ordinary runs: TensorBoard scalars (training, validation and test loss, grad norm,
`swiglu/layer{i}/{act_max,outlier_ratio,align_max,align_p99}` from the SwiGLU diagnostics, and
`fp8/<layer>/<role>/{amax,clipped_frac,nan_count,inf_count}` from `--log-fp8-stats`), the runs' logs (the
diagnostics' "jumped" warnings) and checkpoints (the full |cos(w1_i, w2_i)| distribution, for the top-k
series and the alignment histograms).
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megatron.evaluation.run_compare import read_scalars

TRAIN = "lm-loss-training/lm loss"
VALID = "lm-loss-validation/lm loss validation"
TEST = "lm-loss-validation/lm loss test"
GRAD_NORM = "grad-norm/grad-norm"
# Per-iteration tags of older runs, before they took Megatron-DeepSpeed's names (a base run written before the rename
# and its resume written after it must merge into one series).
_LEGACY = {"lm-loss": TRAIN, "lm-loss-validation/lm loss": VALID, "lm-loss-test/lm loss": TEST,
           "grad-norm": GRAD_NORM}
_WARNING = re.compile(r"iteration (\d+): SwiGLU (\w+) of layer (\d+) jumped")
_AUTOHEAL = re.compile(r"fp8 autoheal: iteration (\d+): (\S+) (input|weight|grad_output) (.*)$", re.MULTILINE)
# A run diverged when its training loss became non-finite, or ended more than this many nats above the lowest
# logged value (it lost what it had learned; at a too-high LR the loss climbs back towards log(vocab)).
DIVERGENCE_RISE = 1.0
_FP8_TAG = re.compile(r"fp8/decoder\.layers\.(\d+)\.(.+)/(input|weight|grad_output)/(\w+)$")


def merged_scalars(tb_dirs: Sequence[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Scalars of several event folders of one run (base, then resumed); a later folder wins on a shared step."""
    out: dict[str, dict[int, float]] = {}
    for d in tb_dirs:
        if not Path(d).is_dir():
            continue
        for tag, (steps, values) in read_scalars(str(d)).items():
            out.setdefault(_LEGACY.get(tag, tag), {}).update({int(s): float(v) for s, v in zip(steps, values)})
    return {t: (np.array(sorted(m)), np.array([m[s] for s in sorted(m)])) for t, m in out.items()}


def layer_count(scalars: dict) -> int:
    return len({t.split("/")[1] for t in scalars if t.startswith("swiglu/layer")})


def per_layer(scalars: dict) -> dict[int, dict[str, list]]:
    """Per layer: steps and the diagnostics (act_max = fc2-input amax of plain SwiGLU, outlier ratio,
    alignment max/p99) and, with FP8 statistics, the largest clipped fraction over that layer's tensors and
    fc2's input amax/clipped fraction."""
    out: dict[int, dict[str, list]] = {}
    for i in range(layer_count(scalars)):
        d: dict[str, list] = {}
        for key in ("act_max", "outlier_ratio", "align_max", "align_p99"):
            tag = f"swiglu/layer{i}/{key}"
            if tag in scalars:
                d["steps"] = scalars[tag][0].tolist()
                d[key] = scalars[tag][1].tolist()
        fc2 = f"fp8/decoder.layers.{i}.mlp.linear_fc2/input"
        for key in ("amax", "clipped_frac"):
            if f"{fc2}/{key}" in scalars:
                d[f"fc2_input_fp8_{key}"] = scalars[f"{fc2}/{key}"][1].tolist()
        out[i] = d
    return out


def fp8_tensor_maxima(scalars: dict, start_step: int = 0) -> dict[str, dict[str, float]]:
    """Per FP8 tensor (`<layer>/<role>`): the largest clipped fraction and NaN/Inf counts after `start_step`."""
    out: dict[str, dict[str, float]] = {}
    for tag, (steps, values) in scalars.items():
        m = _FP8_TAG.match(tag)
        if not m or m.group(4) not in ("clipped_frac", "nan_count", "inf_count"):
            continue
        values = values[steps > start_step]
        if not len(values):
            continue
        name = f"layer{m.group(1)}.{m.group(2)}/{m.group(3)}"
        out.setdefault(name, {})[f"max_{m.group(4)}"] = float(np.max(values))
    return out


def diagnostic_warnings(log_text: str) -> list[dict]:
    """The SwiGLU diagnostics' jump warnings of a run log's text, in order."""
    return [{"iteration": int(m.group(1)), "stat": m.group(2), "layer": int(m.group(3))}
            for m in _WARNING.finditer(log_text)]


def autoheal_actions(log_text: str) -> list[dict]:
    """The FP8 controller's actions in a run log's text (`--fp8-autoheal`), in order: iteration, layer, tensor, and
    the rest of the line (the signal and the action)."""
    return [{"iteration": int(m.group(1)), "layer": m.group(2), "tensor": m.group(3), "what": m.group(4).strip()}
            for m in _AUTOHEAL.finditer(log_text)]


def diverged(summary: dict, rise: float = DIVERGENCE_RISE) -> bool:
    """Whether a run diverged (`DIVERGENCE_RISE`); a run without a logged loss counts as diverged."""
    final, low = summary.get("final_train_loss"), summary.get("min_train_loss")
    if summary.get("nonfinite_loss_points") or final is None or low is None or not math.isfinite(final):
        return True
    return final > low + rise


def loss_series(scalars: dict) -> list[list]:
    """[iterations, training losses] as plain lists (empty when the run logged none)."""
    steps, loss = scalars.get(TRAIN, (np.array([]), np.array([])))
    return [steps.tolist(), loss.tolist()]


def _last(scalars: dict, tag: str) -> Optional[float]:
    return float(scalars[tag][1][-1]) if tag in scalars and len(scalars[tag][1]) else None


def run_summary(scalars: dict, log: Optional[Path], start_step: int = 0, tail: int = 3) -> dict:
    """Loss (final = mean of the last `tail` logged training losses), jump after `start_step`, FP8 and
    diagnostics outcomes of one run."""
    steps, loss = scalars.get(TRAIN, (np.array([]), np.array([])))
    after = loss[steps > start_step]
    before = loss[steps <= start_step]
    finite = after[np.isfinite(after)]
    log_text = log.read_text(errors="replace") if log is not None and log.exists() else ""  # read once
    s: dict = {
        "final_train_loss": float(np.mean(loss[-tail:])) if len(loss) else None,
        "min_train_loss": float(np.min(loss[np.isfinite(loss)])) if np.isfinite(loss).any() else None,
        "final_valid_loss": _last(scalars, VALID),
        "test_loss": _last(scalars, TEST),
        "loss_before_start": float(before[-1]) if len(before) else None,
        "max_loss_after_start": float(np.max(finite)) if len(finite) else None,
        "nonfinite_loss_points": int(np.sum(~np.isfinite(after))),
        "skipped_iterations": _last(scalars, "skipped-iterations"),
        "nan_iterations": _last(scalars, "nan-iterations"),
        "max_grad_norm_after_start": None,
        "fp8_tensors": fp8_tensor_maxima(scalars, start_step),
        "warnings": diagnostic_warnings(log_text),
        "autoheal": autoheal_actions(log_text),
    }
    if GRAD_NORM in scalars:
        g_steps, g = scalars[GRAD_NORM]
        g = g[(g_steps > start_step) & np.isfinite(g)]
        s["max_grad_norm_after_start"] = float(np.max(g)) if len(g) else None
    clips = [v.get("max_clipped_frac", 0.0) for v in s["fp8_tensors"].values()]
    s["max_fp8_clipped_frac"] = max(clips) if clips else None
    return s


def seed_stats(values: Sequence[Optional[float]]) -> dict:
    """mean +- sample std (ddof 1; None with fewer than 2 finite values) over seeds."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    return {"mean": statistics.fmean(vals) if vals else None,
            "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "n": len(vals), "values": [None if v is None else float(v) for v in values]}


def topk_series(alignments: dict[int, list], k: int) -> dict[int, list[list[float]]]:
    """{iteration: per layer the top-k |cos| (descending)} from checkpoint alignments."""
    return {it: [sorted((float(x) for x in layer), reverse=True)[:k] for layer in layers]
            for it, layers in alignments.items()}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    return plt


def plot_activation_maxima(series: dict[str, dict[int, dict]], path: Path, key: str = "act_max",
                           mark_step: Optional[int] = None) -> Path:
    """One panel per layer: `key` (fc2-input max |h|) over steps, one line per run (log scale)."""
    plt = _pyplot()
    layers = sorted({i for per in series.values() for i in per})
    fig, axes = plt.subplots(1, max(1, len(layers)), figsize=(5 * max(1, len(layers)), 3.8), squeeze=False)
    for ax, i in zip(axes[0], layers):
        for name, per in series.items():
            d = per.get(i, {})
            if key in d:
                ax.plot(d["steps"], d[key], label=name)
        if mark_step is not None:
            ax.axvline(mark_step, color="gray", ls="--", lw=0.8)
        ax.set(title=f"layer {i}: {key}", xlabel="iteration", yscale="log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_alignment_histograms(start: list, end: list, path: Path, title: str) -> Path:
    """Per layer, the |cos(w1_i, w2_i)| distribution at the start and at the end of a run."""
    plt = _pyplot()
    n = len(start)
    fig, axes = plt.subplots(1, max(1, n), figsize=(5 * max(1, n), 3.5), squeeze=False)
    bins = np.linspace(0, 1, 41)
    for i, ax in enumerate(axes[0]):
        # An injected channel's |cos| can round to 1 + 1 ulp: clip into the last bin instead of losing it.
        ax.hist(np.clip(start[i], 0, 1), bins=bins, alpha=0.6, label="start", log=True)
        ax.hist(np.clip(end[i], 0, 1), bins=bins, alpha=0.6, label="end", log=True)
        ax.set(title=f"{title}: layer {i}", xlabel="|cos(w1_i, w2_i)|", ylabel="channels")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_losses(series: dict[str, tuple[Sequence, Sequence]], path: Path, mark_step: Optional[int] = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (x, y) in series.items():
        ax.plot(x, y, label=name)
    if mark_step is not None:
        ax.axvline(mark_step, color="gray", ls="--", lw=0.8)
    ax.set(title="training loss", xlabel="iteration", ylabel="lm loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_loss_vs_lr(table: dict, path: Path) -> Path:
    """Final training loss (mean over seeds, bars: min..max) against the peak LR, one line per variant; a
    diverged point (any seed) is drawn as an x."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, row in table.items():
        lrs = sorted(row["by_lr"], key=float)
        xs, ys, lo, hi, bad = [], [], [], [], []
        for lr in lrs:
            vals = [v for v in row["by_lr"][lr]["final_train_loss"]["values"] if v is not None and math.isfinite(v)]
            if not vals:
                continue
            mean = statistics.fmean(vals)
            xs.append(float(lr))
            ys.append(mean)
            lo.append(mean - min(vals))
            hi.append(max(vals) - mean)
            bad.append(any(d is not False for d in row["by_lr"][lr]["diverged"]))
        line = ax.errorbar(xs, ys, yerr=[lo, hi], label=variant, marker="o", capsize=3, alpha=0.85)
        ax.scatter([x for x, b in zip(xs, bad) if b], [y for y, b in zip(ys, bad) if b], marker="x", s=80,
                   color=line[0].get_color(), zorder=3)
    ax.set(title="final training loss vs peak LR (x: a seed diverged)", xlabel="peak learning rate",
           ylabel="training loss (log scale)", xscale="log", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
