"""Markdown tables from a lab summary.json (`tools/stability_lab.py --report FILE`), for docs/stability.md.

Values are mean +- sample std over seeds (n given); a gap is to the BF16 row of the same summary.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron.stability.analysis import seed_stats
from megatron.stability.presets import simple_table


def _pm(stat: Optional[dict], digits: int = 4) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    std = stat.get("std")
    text = f"{stat['mean']:.{digits}f}" + (f" +- {std:.{digits}f}" if std is not None else "")
    return f"{text} (n={stat['n']})"


def _peak(entry: dict, key: str, after: int) -> Optional[float]:
    vals = [v for d in entry.get("per_layer", {}).values()
            for s, v in zip(d.get("steps", []), d.get(key, [])) if s > after]
    return max(vals) if vals else None


def inject_tables(summary: dict) -> str:
    lines = ["BF16 control per c (final validation loss, paired by seed: injected - control):", "",
             "| c | mean excess | 2 x BF16 seed std | holds |", "|---|---|---|---|"]
    for c, v in summary["bf16_verdicts"].items():
        exc, thr = v.get("mean_excess"), v.get("threshold")
        lines.append(f"| {c} | {'-' if exc is None else f'{exc:+.4f}'} | {'-' if thr is None else f'{thr:.4f}'} "
                     f"| {v.get('holds')} |")
    base = summary["base_iters"]
    ref = summary["table"].get("bf16/control", {}).get("final_valid_loss", {}).get("mean")
    lines += ["", f"c* = {summary['c_star']}" + (" (not judged: one seed)" if summary.get("c_star_unjudged") else ""),
              "", "| run | final valid loss | gap to BF16 control | max train loss after injection | "
              "peak fc2-input max | peak outlier ratio | max FP8 clipped frac (any tensor) | max fc2-input clipped "
              "frac | non-finite loss points | first diagnostics warning |", "|---" * 10 + "|"]
    for name, row in summary["table"].items():
        m = row["final_valid_loss"].get("mean")
        gap = "-" if m is None or ref is None else f"{m - ref:+.4f}"
        variant, tag = name.split("/")
        keys = [f"{variant}_{tag}_s{s}" for s in summary["seeds"]]
        entries = [summary["runs"][k] for k in keys if k in summary["runs"]]
        if not entries:  # e.g. FP8 controls skipped (--no-fp8-controls)
            continue
        fc2 = [v.get("max_clipped_frac", 0.0) for e in entries
               for t, v in e.get("summary", {}).get("fp8_tensors", {}).items() if "linear_fc2/input" in t]
        peaks = [_peak(e, "act_max", base) for e in entries]
        ratios = [_peak(e, "outlier_ratio", base) for e in entries]
        peak = max((p for p in peaks if p is not None), default=None)
        ratio = max((p for p in ratios if p is not None), default=None)
        lines.append(f"| {name} | {_pm(row['final_valid_loss'])} | {gap} | {_pm(row['max_loss_after_start'])} | "
                     f"{'-' if peak is None else f'{peak:.3g}'} | {'-' if ratio is None else f'{ratio:.3g}'} | "
                     f"{_pm(row['max_fp8_clipped_frac'], 5)} | {f'{max(fc2):.5f}' if fc2 else '-'} | "
                     f"{row['nonfinite_loss_points']} | "
                     f"{row['first_warning']} |")
    return "\n".join(lines)


def _paired(summary: dict, name: str, key: str) -> Optional[dict]:
    """Seed statistics of (config - BF16) over the seeds both ran: same initialisation and tokens per pair."""
    runs = summary["runs"]
    diffs = []
    for entry in runs.values():
        if entry["config"] != name:
            continue
        ref = runs.get(f"bf16_s{entry['seed']}", {}).get("summary", {}).get(key)
        val = entry.get("summary", {}).get(key)
        if ref is not None and val is not None:
            diffs.append(val - ref)
    return seed_stats(diffs) if diffs else None


def simple_tables(summary: dict) -> str:
    ref = summary["table"].get("bf16", {}).get("final_valid_loss", {}).get("mean")
    paired = "runs" in summary and any(e.get("config") == "bf16" for e in summary["runs"].values())
    head = "| run | final valid loss | gap to BF16 mean | test loss | max FP8 clipped frac |"
    if paired:
        head += " valid gap paired by seed | test gap paired by seed |"
    lines = [head, "|---" * (7 if paired else 5) + "|"]
    for name, row in summary["table"].items():
        m = row["final_valid_loss"].get("mean")
        gap = "-" if m is None or ref is None or name == "bf16" else f"{m - ref:+.4f}"
        line = (f"| {name} | {_pm(row['final_valid_loss'])} | {gap} | {_pm(row['test_loss'])} | "
                f"{_pm(row['max_fp8_clipped_frac'], 5)} |")
        if paired:
            cells = ["-" if name == "bf16" else _pm(_paired(summary, name, k)) for k in ("final_valid_loss",
                                                                                       "test_loss")]
            line += f" {cells[0]} | {cells[1]} |"
        lines.append(line)
    return "\n".join(lines)


def merge(summaries: list[dict], names: list[str]) -> dict:
    """One summary from split invocations of the recipes/ablation presets (e.g. seeds run in parallel).

    They must be the same preset at the same length; a run (config, seed) may appear in one of them only."""
    presets = {s.get("preset") for s in summaries}
    iters = {s.get("iters") for s in summaries}
    if len(presets) != 1 or len(iters) != 1 or "runs" not in summaries[0] or "by_weight_decay" in summaries[0]:
        raise ValueError(f"--report {' '.join(names)}: only summaries of one recipes/ablation preset at one --iters "
                         f"merge (got presets {sorted(map(str, presets))}, iters {sorted(map(str, iters))})")
    runs: dict = {}
    for summary, name in zip(summaries, names):
        for key, entry in summary["runs"].items():
            if key in runs:
                raise ValueError(f"--report: run {key} appears in more than one summary (again in {name})")
            runs[key] = entry
    return {"preset": presets.pop(), "iters": iters.pop(), "runs": runs, "table": simple_table(runs),
            "merged_from": names}


def lr_tables(summary: dict) -> str:
    """The lr preset: final training loss per variant and peak LR (D: a seed diverged), the largest stable LR."""
    table = summary["table"]
    lrs = sorted({lr for row in table.values() for lr in row["by_lr"]}, key=float)
    lines = ["| variant | " + " | ".join(f"LR {lr}" for lr in lrs) + " | largest LR without divergence |",
             "|---" * (len(lrs) + 2) + "|"]
    for variant, row in table.items():
        cells = []
        for lr in lrs:
            cell = row["by_lr"].get(lr)
            if cell is None:
                cells.append("-")
                continue
            vals = ", ".join("-" if v is None else f"{v:.2f}" for v in cell["final_train_loss"]["values"])
            marks = "".join(" D" if d else "" for d in cell["diverged"])
            cells.append(f"{_pm(cell['final_train_loss'], 2)} ({vals}){marks}")
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {row['max_stable_lr'] or 'none'} |")
    return "\n".join(lines) + "\n\n" + autoheal_lines(summary)


def autoheal_lines(summary: dict) -> str:
    """The FP8 controller's actions per run (`--fp8-autoheal` runs), one line each."""
    subs = [summary] + list(summary.get("by_weight_decay", {}).values()) + list(summary.get("by_lr", {}).values())
    lines = []
    for sub, key in [(s, k) for s in subs for k in s.get("runs", {})]:
        entry = sub["runs"][key]
        actions = entry.get("summary", {}).get("autoheal", [])
        if actions or "autoheal" in key:
            where = sorted({f"{a['layer'].replace('decoder.layers.', 'L')} {a['tensor']}" for a in actions})
            its = [a["iteration"] for a in actions]
            run = Path(entry.get("run_dir", key))
            lines.append(f"- {run.parent.parent.name}/{run.name}: {len(actions)} action(s)"
                         + (f", iterations {its[0]}-{its[-1]}, on {', '.join(where)}" if actions else ""))
    return "FP8 controller actions:\n" + "\n".join(lines) if lines else ""


def markdown(summary: dict) -> str:
    if summary.get("preset") == "lr" and "table" in summary:
        return lr_tables(summary)
    if summary.get("preset") in ("inject", None) and "bf16_verdicts" in summary:
        return inject_tables(summary) + "\n\n" + autoheal_lines(summary)
    if "by_weight_decay" in summary:
        return "\n\n".join(f"weight decay {wd}:\n\n" + simple_tables(s) for wd, s in summary["by_weight_decay"].items()
                           ) + "\n\n" + autoheal_lines(summary)
    return simple_tables(summary)
