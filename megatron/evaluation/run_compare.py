"""Compare training runs from their TensorBoard scalars: a summary table and plots aligned by consumed tokens.

Runs are aligned by tokens, not iterations, because runs compared for FP8 stability often differ in
batch size or sequence length; the training loop writes every scalar a second time under
"<tag> vs tokens" for this. The first run is the reference: the *relative gap* of a run is
(loss - reference loss) / reference loss at equal tokens, the reference interpolated linearly
between its logged points and only inside the token range both runs cover.

Tags read (as written by `megatron.training.log.TrainingLogger`, Megatron-DeepSpeed's names, and the FP8
statistics): `lm-loss-training/lm loss vs tokens`, `lm-loss-validation/lm loss validation vs tokens`,
`lm-loss-validation/lm loss test` (the older tag names `lm-loss`, `lm-loss-validation/lm loss` and
`lm-loss-test/lm loss` are read under these),
`throughput/tokens-per-sec`, `memory/mem-max-allocated-MiB` or `memory/mem-max-rss-MiB`,
`skipped-iterations`, `nan-iterations`, and `fp8/<layer>/<role>/{amax,clipped_frac}` when present.
"""
from __future__ import annotations

import glob
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

TRAIN_LOSS = "lm-loss-training/lm loss vs tokens"
VALID_LOSS = "lm-loss-validation/lm loss validation vs tokens"
TEST_LOSS = "lm-loss-validation/lm loss test"
# Older tag names -> Megatron-DeepSpeed's, so runs written with them still compare.
LEGACY_TAGS = {"lm-loss vs tokens": TRAIN_LOSS, "lm-loss-validation/lm loss vs tokens": VALID_LOSS,
               "lm-loss-test/lm loss": TEST_LOSS}
THROUGHPUT = "throughput/tokens-per-sec"
MEMORY_TAGS = ("memory/mem-max-allocated-MiB", "memory/mem-max-rss-MiB")
SKIPPED, NANS = "skipped-iterations", "nan-iterations"

Series = tuple[np.ndarray, np.ndarray]  # (steps or tokens, values), sorted by step
logger = logging.getLogger(__name__)


def read_scalars(run_dir: str) -> dict[str, Series]:
    """Every scalar tag of the event files in `run_dir`; a step logged twice (a resumed run) keeps its last value."""
    from tensorboard.backend.event_processing import event_accumulator

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run folder {run_dir} not found: pass the runs' --tensorboard-dir folders")
    acc = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags().get(event_accumulator.SCALARS, [])
    if not tags:
        raise ValueError(f"{run_dir} holds no TensorBoard scalars: is it a --tensorboard-dir of a run "
                         "that reached its first --log-interval?")
    several = several_runs(run_dir)
    if several:
        logger.warning(several)
    out = {}
    for tag in tags:
        by_step = {int(e.step): float(e.value) for e in acc.Scalars(tag)}
        steps = np.array(sorted(by_step), dtype=np.int64)
        out[tag] = (steps, np.array([by_step[s] for s in steps], dtype=np.float64))
    for old, new in LEGACY_TAGS.items():
        if old in out and new not in out:
            out[new] = out.pop(old)
    return out


def several_runs(run_dir: str) -> Optional[str]:
    """A warning when more than one run wrote `run_dir`: several event files that each hold the folder's first
    training step (a resumed run's later files start after a checkpoint instead), else None."""
    from tensorboard.backend.event_processing import event_accumulator

    files = sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    if len(files) < 2:
        return None
    firsts = []
    for path in files:
        acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        steps = [e.step for tag in acc.Tags().get(event_accumulator.SCALARS, []) for e in acc.Scalars(tag)]
        if steps:
            firsts.append(min(steps))
    if not firsts:
        return None
    starts = sum(first == min(firsts) for first in firsts)
    if starts < 2:
        return None
    return (f"{run_dir}: {starts} event files each start at step {min(firsts)}, so more than one run wrote this "
            "folder and their scalars are merged (a later file's value wins at each step): give each run its own "
            "--tensorboard-dir")


@dataclass
class RunSummary:
    name: str
    tokens: Optional[int]
    final_valid: Optional[float]
    best_valid: Optional[float]
    test: Optional[float]
    tokens_per_sec: Optional[float]
    peak_memory_mib: Optional[float]
    skipped: Optional[int]
    nans: Optional[int]
    worst_fp8_clip: Optional[tuple[str, float]]
    valid_gap: Optional[float] = None  # final validation loss relative to the first run's
    scalars: dict[str, Series] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        clip = self.worst_fp8_clip
        return {"run": self.name, "tokens": self.tokens, "final_valid_loss": self.final_valid,
                "best_valid_loss": self.best_valid, "valid_gap_vs_first": self.valid_gap, "test_loss": self.test,
                "tokens_per_sec": self.tokens_per_sec, "peak_memory_mib": self.peak_memory_mib,
                "skipped_iterations": self.skipped, "nan_iterations": self.nans,
                "worst_fp8_clipped_frac": clip[1] if clip else None, "worst_fp8_tensor": clip[0] if clip else None}


def _last(scalars: dict[str, Series], tag: str) -> Optional[float]:
    return float(scalars[tag][1][-1]) if tag in scalars and len(scalars[tag][1]) else None


def fp8_tags(scalars: dict[str, Series], stat: str, vs_tokens: bool = False) -> list[str]:
    """FP8 statistic tags `fp8/<layer>/<role>/<stat>` (keyed by iteration, or by tokens)."""
    suffix = f"/{stat} vs tokens" if vs_tokens else f"/{stat}"
    return sorted(t for t in scalars if t.startswith("fp8/") and t.endswith(suffix))


def summarize(name: str, scalars: dict[str, Series]) -> RunSummary:
    valid = scalars.get(VALID_LOSS)
    tokens = [int(s[0][-1]) for t, s in scalars.items() if t.endswith(" vs tokens") and len(s[0])]
    throughput = scalars.get(THROUGHPUT)
    memory = next((scalars[t] for t in MEMORY_TAGS if t in scalars), None)
    clips = [(t[len("fp8/"):-len("/clipped_frac")], float(scalars[t][1].max()))
             for t in fp8_tags(scalars, "clipped_frac")]
    skipped, nans = _last(scalars, SKIPPED), _last(scalars, NANS)
    return RunSummary(
        name=name, tokens=max(tokens) if tokens else None,
        final_valid=float(valid[1][-1]) if valid is not None else None,
        best_valid=float(valid[1].min()) if valid is not None else None,
        test=_last(scalars, TEST_LOSS),
        # Median, not mean: the first interval includes start-up and compilation.
        tokens_per_sec=float(np.median(throughput[1])) if throughput is not None else None,
        peak_memory_mib=float(memory[1].max()) if memory is not None else None,
        skipped=int(skipped) if skipped is not None else None, nans=int(nans) if nans is not None else None,
        worst_fp8_clip=max(clips, key=lambda c: c[1]) if clips else None, scalars=scalars)


def relative_gap(run: Series, reference: Series) -> Series:
    """(tokens, (run - ref) / ref) at the run's points inside the reference's token range."""
    x, y = run
    rx, ry = reference
    if len(rx) == 0 or len(x) == 0:
        return np.array([]), np.array([])
    inside = (x >= rx[0]) & (x <= rx[-1])
    ref = np.interp(x[inside], rx, ry)
    return x[inside], (y[inside] - ref) / ref


def compare(run_dirs: Sequence[str], labels: Optional[Sequence[str]] = None) -> list[RunSummary]:
    if not run_dirs:
        raise ValueError("give at least one run folder (a --tensorboard-dir)")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"--labels has {len(labels)} names for {len(run_dirs)} runs")
    names = list(labels) if labels else _default_names(run_dirs)
    runs = [summarize(name, read_scalars(d)) for name, d in zip(names, run_dirs)]
    ref = runs[0].final_valid
    for run in runs:
        if ref and run.final_valid is not None:
            run.valid_gap = (run.final_valid - ref) / ref
    return runs


def _default_names(run_dirs: Sequence[str]) -> list[str]:
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in run_dirs]


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_table(runs: Sequence[RunSummary]) -> str:
    header = ["run", "tokens", "final valid", "best valid", "gap vs 1st", "test", "tokens/s", "peak MiB",
              "skipped", "NaN", "worst FP8 clip"]
    rows = [header]
    for r in runs:
        clip = f"{r.worst_fp8_clip[1]:.2e} {r.worst_fp8_clip[0]}" if r.worst_fp8_clip else "-"
        gap = f"{r.valid_gap * 100:+.2f}%" if r.valid_gap is not None else "-"
        rows.append([r.name, _fmt(r.tokens, ","), _fmt(r.final_valid, ".4f"), _fmt(r.best_valid, ".4f"), gap,
                     _fmt(r.test, ".4f"), _fmt(r.tokens_per_sec, ",.0f"), _fmt(r.peak_memory_mib, ",.0f"),
                     _fmt(r.skipped, "d"), _fmt(r.nans, "d"), clip])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
