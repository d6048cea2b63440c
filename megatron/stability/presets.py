"""The lab's presets: what each one runs, in which order, and the JSON summary it writes.

- `inject`: per variant and seed a base run to `base_iters`, then from a copy of its checkpoint
  (a) an unedited resume (the control) and (b) resumes with the injection at each c. BF16 goes first over
  every c; the largest c whose BF16 runs stay within BF16's seed spread (`bf16_holds`) is `c_star`, and the
  FP8 variants run at c_star only: the FP8 outcome at the c BF16 survives, not at a c chosen to break FP8
  (`fp8_every_c`: at every c, to find where FP8 and BF16 part ways beyond c_star).
- `natural`: a tiny model overtrained on a small corpus (the 24k-token validation books) at a
  high learning rate, per weight decay, variant and seed; alignment and outliers over time.
- `lr` (tools/stability_lab.py `_lr_sweep`, with `lr_table` here): the natural preset's model and corpus per peak
  learning rate, variant and seed; the final loss, which runs diverged, the largest stable LR per variant.
- `demo` runs (presets `recipes` and `ablation`): the demo model on the demo corpus, one
  ordinary run per configuration and seed, validation and held-out test loss.
"""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron.stability import analysis
from megatron.stability.inject import checkpoint_alignment, copy_checkpoint, inject_aligned_channels
from megatron.stability.runs import (TINY_MODEL, Fp8Settings, RunRecord, command_text, data_flags, run_pretrain,
                                     variant_flags)
from megatron.checkpoint.store import read_tracker


@dataclass(frozen=True)
class TinySetup:
    """Training settings shared by the tiny-model presets."""
    lr: float = 3e-3
    weight_decay: float = 0.1
    micro_batch: int = 16
    log_interval: int = 5
    eval_iters: int = 4
    train_split: str = "train"
    threads: int = 1
    torch_compile: str = "auto"
    fp8: Fp8Settings = field(default_factory=Fp8Settings)

    def flags(self, data_dir: Path, seed: int, total_iters: int) -> list[str]:
        # Constant LR after a short warm-up: a base run that stops at --exit-interval and its resume see one
        # schedule, and the injection meets the same LR in every variant.
        return [*TINY_MODEL, "--lr", str(self.lr), "--lr-decay-style", "constant",
                "--lr-warmup-iters", str(max(1, total_iters // 20)), "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--weight-decay", str(self.weight_decay), "--clip-grad", "1.0", "--bf16",
                "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.micro_batch),
                "--train-iters", str(total_iters), "--log-interval", str(self.log_interval),
                "--eval-interval", str(total_iters), "--eval-iters", str(self.eval_iters), "--seed", str(seed),
                "--no-divergence-guard", "--torch-compile", self.torch_compile,
                *data_flags(data_dir, train=self.train_split, valid="valid" if self.train_split != "valid" else "test",
                            test=None)]


def run_chains(chains: Sequence[Callable[[], None]], jobs: int) -> None:
    """Run independent chains of runs, `jobs` at a time (each chain's runs stay in order).

    Every run is its own `pretrain_gpt.py` process with a fixed OMP_NUM_THREADS, so running two at once changes
    wall time only, never a result: the lab's figures are the same for any `jobs`."""
    if jobs <= 1 or len(chains) <= 1:
        for chain in chains:
            chain()
        return
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(chain) for chain in chains]:
            future.result()  # re-raises a chain's exception here


def _alignment_lists(ckpt: Path, iteration: int) -> list[list[float]]:
    return [a.tolist() for a in checkpoint_alignment(ckpt, iteration)]


def _saved_iterations(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("iter_*") if p.is_dir())


def bf16_holds(control: Sequence[Optional[float]], injected: Sequence[Optional[float]], k: float = 2.0) -> dict:
    """Did the injected BF16 runs end within BF16's seed spread? Paired by seed on final validation loss.

    Holds when the mean paired excess (injected - control) is <= k x the control's sample std over seeds.
    With fewer than 2 seeds there is no spread: `holds` is None (not judged)."""
    ctl = analysis.seed_stats(control)
    pairs = [i - c for c, i in zip(control, injected) if c is not None and i is not None]
    excess = sum(pairs) / len(pairs) if pairs else None
    ok = None
    if ctl["std"] is not None and excess is not None and len(pairs) == len(control):
        ok = excess <= k * ctl["std"]
    elif excess is None:
        ok = False  # an injected run with no final loss (it died) does not hold
    return {"control": ctl, "mean_excess": excess, "threshold": None if ctl["std"] is None else k * ctl["std"],
            "holds": ok}


def analyze_inject_run(entry: dict, base: Path, run: Path, base_iters: int, topk: int) -> None:
    """Fill one inject run's summary (post-injection figures count from `base_iters` on), series and alignment."""
    scalars = analysis.merged_scalars([base / "tb", run / "tb"])
    entry["summary"] = analysis.run_summary(scalars, run / "train.log", start_step=base_iters)
    entry["per_layer"] = analysis.per_layer(scalars)
    entry["loss"] = analysis.loss_series(scalars)
    saved = _saved_iterations(run / "ckpt")
    align = {it: _alignment_lists(run / "ckpt", it) for it in saved}
    entry["topk_alignment"] = analysis.topk_series(align, topk)
    entry["end_alignment"] = align[saved[-1]] if saved else None


def fp8_injections(cs: Sequence[float], c_star: Optional[float], fp8_every_c: bool) -> list[float]:
    """The c values the FP8 variants are injected at: c* (none when no c held), or every c with `fp8_every_c`."""
    return list(cs) if fp8_every_c else [c_star] if c_star is not None else []


def inject_table(runs: dict, variants: Sequence[str], seeds: Sequence[int], cs: Sequence[float],
                 c_star: Optional[float], fp8_every_c: bool = False) -> dict:
    """Seed statistics per (variant, c) row; FP8 variants have rows for their control and c* only (every c with
    `fp8_every_c`)."""
    table = {}
    for variant in variants:
        for c in [None] + (list(cs) if variant == "bf16" else fp8_injections(cs, c_star, fp8_every_c)):
            tag = "control" if c is None else f"c{c:g}"
            sums = [runs.get(f"{variant}_{tag}_s{s}", {}).get("summary", {}) for s in seeds]
            table[f"{variant}/{tag}"] = {
                "final_valid_loss": analysis.seed_stats([s.get("final_valid_loss") for s in sums]),
                "final_train_loss": analysis.seed_stats([s.get("final_train_loss") for s in sums]),
                "max_loss_after_start": analysis.seed_stats([s.get("max_loss_after_start") for s in sums]),
                "max_fp8_clipped_frac": analysis.seed_stats([s.get("max_fp8_clipped_frac") for s in sums]),
                "nonfinite_loss_points": [s.get("nonfinite_loss_points") for s in sums],
                "first_warning": [min((w["iteration"] for w in s.get("warnings", [])), default=None) for s in sums],
            }
    return table


def reanalyze_inject(summary: dict, out: Path, topk: int = 4) -> dict:
    """Recompute every run's figures and the table of an inject summary from its run folders (no run starts)."""
    for name, entry in summary["runs"].items():
        base = out / "base" / f"{entry['variant']}_s{entry['seed']}"
        analyze_inject_run(entry, base, Path(entry["run_dir"]), summary["base_iters"], topk)
    summary["table"] = inject_table(summary["runs"], summary["variants"], summary["seeds"], summary["c_values"],
                                    summary["c_star"], summary.get("fp8_every_c", False))
    return summary


@dataclass
class _InjectRuns:
    """The runs of the inject preset: each (variant, seed, c) resumes its shared base run's checkpoint, injected
    with c (none for a control); `records` and `runs` collect what ran and what it showed."""

    out: Path
    data_dir: Path
    setup: TinySetup
    base_iters: int
    resume_iters: int
    topk: int
    dry_run: bool
    channels: int
    records: list = field(default_factory=list)
    runs: dict = field(default_factory=dict)

    def one(self, variant: str, seed: int, c: Optional[float]) -> None:
        flags = (self.setup.flags(self.data_dir, seed, self.base_iters + self.resume_iters)
                 + variant_flags(variant, self.setup.fp8))
        base = self.out / "base" / f"{variant}_s{seed}"
        base_flags = flags + ["--exit-interval", str(self.base_iters), "--save-interval", str(self.base_iters),
                              "--save", str(base / "ckpt"), "--tensorboard-dir", str(base / "tb")]
        # A base run is shared by every c of its (variant, seed) and reused by a rerun of the preset into the
        # same folder, but only if it ran the same command and stopped where this preset injects.
        if not any(r.run_dir == str(base) for r in self.records):  # not run (or found) earlier in this call
            self.records.append(run_or_reuse(f"base {variant} seed {seed}", base_flags, base, self.setup.threads,
                                             self.dry_run, iteration=self.base_iters))
        tag = "control" if c is None else f"c{c:g}"
        run = self.out / "runs" / f"{variant}_{tag}_s{seed}"
        entry: dict = {"variant": variant, "seed": seed, "c": c, "run_dir": str(run)}
        if not self.dry_run:
            shutil.rmtree(run, ignore_errors=True)  # stale event files of an earlier attempt would mix in
            start = copy_checkpoint(base / "ckpt", run / "ckpt")
            entry["start_alignment"] = _alignment_lists(run / "ckpt", start)
            if c is not None:
                entry["injection"] = inject_aligned_channels(run / "ckpt", c, self.channels)
                write_json(run / "injection.json", entry["injection"])
                entry["start_alignment"] = _alignment_lists(run / "ckpt", start)
        rec = run_pretrain(f"{variant} {tag} seed {seed}", flags + [
            "--load", str(run / "ckpt"), "--save", str(run / "ckpt"),
            "--save-interval", str(max(1, self.resume_iters // 4)), "--tensorboard-dir", str(run / "tb")],
            run, self.setup.threads, self.dry_run)
        self.records.append(rec)
        entry["returncode"] = rec.returncode
        if not self.dry_run:
            analyze_inject_run(entry, base, run, self.base_iters, self.topk)
        self.runs[f"{variant}_{tag}_s{seed}"] = entry


def run_inject(out: Path, data_dir: Path, setup: TinySetup, variants: Sequence[str], seeds: Sequence[int],
               cs: Sequence[float], channels: int, base_iters: int, resume_iters: int, topk: int = 4,
               controls: bool = True, fp8_controls: bool = True, dry_run: bool = False,
               log: Callable[[str], None] = print, jobs: int = 1, fp8_every_c: bool = False) -> dict:
    """The inject preset (module docstring); `fp8_every_c`: the FP8 variants run at every c, not at c* only
    (where FP8 and BF16 part ways beyond c*)."""
    plan = _InjectRuns(out, data_dir, setup, base_iters, resume_iters, topk, dry_run, channels)
    one, records, runs = plan.one, plan.records, plan.runs

    def finals(variant: str, c: Optional[float]) -> list[Optional[float]]:
        tag = "control" if c is None else f"c{c:g}"
        return [runs.get(f"{variant}_{tag}_s{s}", {}).get("summary", {}).get("final_valid_loss") for s in seeds]

    def chain(variant: str, seed: int, tags: Sequence[Optional[float]]) -> Callable[[], None]:
        return lambda: [one(variant, seed, c) for c in tags]

    def fp8_chains(c_star: Optional[float]) -> list[Callable[[], None]]:
        tags = ([None] if controls and fp8_controls else []) + fp8_injections(cs, c_star, fp8_every_c)
        return [chain(v, s, tags) for v in variants if v != "bf16" for s in seeds]

    bf16 = [chain("bf16", s, ([None] if controls else []) + list(cs)) for s in seeds] if "bf16" in variants else []
    if not controls:
        # Nothing to judge (the quick preset): c* is simply the largest c, known now, so every chain runs at once.
        run_chains(bf16 + fp8_chains(max(cs)), jobs)
        verdicts = {f"{c:g}": {"holds": None} for c in cs}
        c_star, unjudged = max(cs), True
    else:
        run_chains(bf16, jobs)
        verdicts = {f"{c:g}": bf16_holds(finals("bf16", None), finals("bf16", c)) for c in cs}
        held = [c for c in cs if verdicts[f"{c:g}"]["holds"]]
        unjudged = all(v["holds"] is None for v in verdicts.values())  # one seed: no spread to judge by
        c_star = max(held) if held else (max(cs) if unjudged else None)
        if dry_run:  # nothing ran, nothing judged: show the FP8 commands at the largest c
            c_star, unjudged = max(cs), True
        run_chains(fp8_chains(c_star), jobs)
    log(f"[lab] BF16 verdicts per c: { {c: v['holds'] for c, v in verdicts.items()} }; c* = {c_star}")
    return _inject_result(runs, records, variants, seeds, cs, c_star, unjudged, verdicts, base_iters, resume_iters,
                          channels, setup, fp8_every_c)


def _inject_result(runs: dict, records: list[RunRecord], variants: Sequence[str], seeds: Sequence[int],
                   cs: Sequence[float], c_star: Optional[float], unjudged: bool, verdicts: dict, base_iters: int,
                   resume_iters: int, channels: int, setup: TinySetup, fp8_every_c: bool) -> dict:
    table = inject_table(runs, variants, seeds, cs, c_star, fp8_every_c)
    records = sorted(records, key=lambda r: r.name)  # chains finish in any order when they run in parallel
    return {"preset": "inject", "base_iters": base_iters, "resume_iters": resume_iters, "channels": channels,
            "c_values": list(cs), "c_star": c_star, "c_star_unjudged": unjudged, "bf16_verdicts": verdicts,
            "seeds": list(seeds), "variants": list(variants), "fp8_every_c": fp8_every_c, "table": table, "runs": runs,
            "commands": [r.to_dict() for r in records], "setup": repr(setup)}


def run_simple(out: Path, configs: dict[str, list[str]], seeds_of: dict[str, Sequence[int]],
               base_flags: Callable[[int], list[str]], threads: int, dry_run: bool = False,
               start_step: int = 0, jobs: int = 1) -> dict:
    """One ordinary run per (config, seed): the `natural`, `recipes` and `ablation` presets."""
    records: list[RunRecord] = []
    runs: dict = {}

    def one(name: str, seed: int) -> None:
        run = out / "runs" / f"{name}_s{seed}"
        flags = base_flags(seed) + configs[name] + ["--tensorboard-dir", str(run / "tb"), "--save", str(run / "ckpt")]
        rec = run_or_reuse(f"{name} seed {seed}", flags, run, threads, dry_run)  # reuse: an interrupted re-run
        records.append(rec)
        entry: dict = {"config": name, "seed": seed, "returncode": rec.returncode, "wall_s": rec.wall_s,
                       "run_dir": str(run)}
        if not dry_run and (run / "tb").is_dir():
            scalars = analysis.merged_scalars([run / "tb"])
            entry["summary"] = analysis.run_summary(scalars, run / "train.log", start_step=start_step)
            entry["per_layer"] = analysis.per_layer(scalars)
            entry["loss"] = analysis.loss_series(scalars)
            saved = _saved_iterations(run / "ckpt")
            if saved:  # first and last checkpoint: the alignment histograms "start" and "end"
                entry["start_alignment"] = _alignment_lists(run / "ckpt", saved[0])
                entry["end_alignment"] = _alignment_lists(run / "ckpt", saved[-1])
                entry["alignment_iterations"] = [saved[0], saved[-1]]
        runs[f"{name}_s{seed}"] = entry

    run_chains([lambda n=name, s=seed: one(n, s) for name in configs for seed in seeds_of[name]], jobs)
    order = [f"{name}_s{seed}" for name in configs for seed in seeds_of[name]]
    runs = {key: runs[key] for key in order}  # the configs' order, whichever run finished first
    records.sort(key=lambda r: order.index(Path(r.run_dir).name))
    return {"table": simple_table(runs), "runs": runs, "commands": [r.to_dict() for r in records]}


def completed_run(run: Path, flags: Sequence[str], threads: int, iteration: Optional[int] = None) -> bool:
    """Whether `run` holds a finished run of exactly this command: same recorded command line, its checkpoint
    at `iteration` (default --train-iters; a base run stops earlier, at --exit-interval), and (when the command
    has a test split) the test evaluation that follows the last save."""
    recorded = run / "command.txt"
    if not recorded.exists() or recorded.read_text().strip() != command_text(flags, threads):
        return False
    iters = iteration if iteration is not None else int(flags[list(flags).index("--train-iters") + 1])
    if read_tracker(run / "ckpt") != iters:
        return False
    log = run / "train.log"
    return "--test-data-path" not in flags or (log.exists() and f"test loss at iteration {iters} " in log.read_text())


def run_or_reuse(name: str, flags: Sequence[str], run: Path, threads: int, dry_run: bool,
                 iteration: Optional[int] = None) -> RunRecord:
    """`run_pretrain` into a fresh `run` folder, or the record of the finished identical run already there."""
    if not dry_run and completed_run(run, flags, threads, iteration):
        return RunRecord(f"{name} (reused)", command_text(flags, threads), 0, float("nan"), str(run))
    if not dry_run:
        shutil.rmtree(run, ignore_errors=True)  # stale event files of an earlier attempt would mix in
    return run_pretrain(name, flags, run, threads, dry_run)


def simple_table(runs: dict) -> dict:
    """Seed statistics per config of `run_simple`'s runs (also used to merge summaries of split invocations)."""
    by_config: dict[str, list[dict]] = {}
    for entry in runs.values():
        by_config.setdefault(entry["config"], []).append(entry.get("summary", {}))
    return {name: {k: analysis.seed_stats([s.get(k) for s in sums])
                   for k in ("final_valid_loss", "test_loss", "final_train_loss", "max_fp8_clipped_frac")}
            for name, sums in by_config.items()}


def lr_table(by_lr: dict[str, dict], variants: Sequence[str], seeds: Sequence[int]) -> dict:
    """Per variant: per LR the final training and validation loss over seeds and which seeds diverged
    (`analysis.diverged`), and the largest LR up to which no seed diverged (None: it diverged at the smallest)."""
    table: dict = {}
    for variant in variants:
        rows, stable, broken = {}, None, False
        for lr in sorted(by_lr, key=float):
            sums = [by_lr[lr]["runs"].get(f"{variant}_s{s}", {}).get("summary", {}) for s in seeds]
            div = [analysis.diverged(s) if s else None for s in sums]
            rows[lr] = {"final_train_loss": analysis.seed_stats([s.get("final_train_loss") for s in sums]),
                        "final_valid_loss": analysis.seed_stats([s.get("final_valid_loss") for s in sums]),
                        "diverged": div, "autoheal_actions": [len(s.get("autoheal", [])) for s in sums]}
            broken = broken or not div or any(d is not False for d in div)
            if not broken:
                stable = lr
        table[variant] = {"by_lr": rows, "max_stable_lr": stable}
    return table


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
