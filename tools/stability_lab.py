"""Stability lab: FP8 SwiGLU outliers at laptop scale, BF16 vs FP8 vs Smooth-SwiGLU, as CLI runs.

Every run is an ordinary `pretrain_gpt.py` run (printed, and recorded in <output-dir>/summary.json and each
run's command.txt) with the divergence guard off. Presets (docs/stability.md: the protocol and the results):

    python tools/stability_lab.py --preset inject     # controlled injection w1 = +-c w2, BF16 control picks c*
    python tools/stability_lab.py --preset natural    # tiny model overtrained on a small corpus, WD sweep
    python tools/stability_lab.py --preset lr         # tiny model: final loss and divergence vs peak LR
    python tools/stability_lab.py --preset recipes    # demo model: loss gap to BF16 per --fp8-recipe
    python tools/stability_lab.py --preset ablation   # demo model: FP8 linears / Smooth-SwiGLU / Fp8AdamW
    python tools/stability_lab.py --quick             # the inject preset in miniature (< 60 s; the test)
    python tools/stability_lab.py --report runs/stability/inject/summary.json   # its markdown tables

Written to --output-dir (default runs/stability/<preset>): summary.json and PNG plots (activation maxima
over steps per layer, alignment histograms at start and end, losses).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.stability import analysis, presets, report  # noqa: E402
from megatron.stability.runs import (REPO, BASE_VARIANTS, LR_VARIANTS, VARIANTS, Fp8Settings,  # noqa: E402
                                     ensure_demo_data)

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _demo_module():
    """tools/demo.py's model and optimizer flags: the recipes/ablation presets use exactly the demo's run."""
    spec = importlib.util.spec_from_file_location("_demo", REPO / "tools" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["inject", "natural", "lr", "recipes", "ablation"], default="inject")
    p.add_argument("--quick", action="store_true", help="the inject preset in miniature: 1 seed, BF16 and FP8")
    p.add_argument("--output-dir", default=None, help="default runs/stability/<preset> (runs/ is git-ignored)")
    p.add_argument("--data-dir", default="data/demo", help="the demo corpus (prepared if missing)")
    p.add_argument("--seeds", type=_ints, default=[1, 2, 3], help="comma-separated; the same for every variant")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: inject/natural "
                        f"{','.join(BASE_VARIANTS)}; lr {','.join(LR_VARIANTS)})")
    p.add_argument("--inject-c", type=_floats, default=[1, 4, 16, 64], help="inject: the c values BF16 sweeps")
    p.add_argument("--inject-channels", type=int, default=2, help="inject: channels per layer set to +-c w2")
    p.add_argument("--base-iters", type=int, default=100, help="inject: iterations before the injection")
    p.add_argument("--resume-iters", type=int, default=60, help="inject: iterations after it")
    p.add_argument("--fp8-every-c", action="store_true",
                   help="inject: run the FP8 variants at every --inject-c, not only at c* (where BF16 recovers)")
    p.add_argument("--fp8-controls", action=argparse.BooleanOptionalAction, default=True,
                   help="inject: also resume each FP8 variant without the injection (its own control)")
    p.add_argument("--iters", type=int, default=None,
                   help="natural/lr/recipes/ablation: iterations per run (default 200)")
    p.add_argument("--lr", type=float, default=None, help="tiny-model presets (inject 3e-3, natural 1e-2)")
    p.add_argument("--lrs", type=_floats, default=[3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
                   help="lr: the peak learning rates swept (constant after a 5%% warm-up)")
    p.add_argument("--weight-decay", type=_floats, default=None,
                   help="inject and lr: one value (0.1); natural: the sweep (0,0.1,1.0)")
    p.add_argument("--amax-history-len", type=int, default=16)
    p.add_argument("--fp8-margin", type=int, default=0)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--autoheal-patience", type=int, default=1,
                   help="--fp8-autoheal-patience of the variants with the FP8 controller (stated in their commands)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="recipes: comma-separated --fp8-recipe values")
    p.add_argument("--recipe-seeds", type=_ints, default=None, help="recipes: seeds of the FP8 runs (default --seeds)")
    p.add_argument("--no-bf16", action="store_true",
                   help="recipes/ablation: skip the BF16 runs (they ran into another --output-dir, e.g. in parallel)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="runs at a time (default: 2, or 1 on a 1-core machine); each run is its own process with "
                        "--threads threads, so --jobs changes wall time only, never a result")
    p.add_argument("--torch-compile", choices=["auto", "on", "off"], default="auto",
                   help="passed to every run (pretrain_gpt.py's flag; auto = off on CPU). Compiling changes "
                        "fp32 summation orders, not the recipe: compare runs made with the same setting")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--reanalyze", action="store_true",
                   help="inject: recompute the figures of <output-dir>/summary.json from its run folders, run nothing")
    p.add_argument("--report", nargs="+", default=None, metavar="SUMMARY_JSON",
                   help="print the markdown tables of an earlier run's summary.json and exit; several summaries "
                        "of one recipes/ablation preset (split invocations) are merged into one table")
    return p


def _fp8_settings(args: argparse.Namespace) -> Fp8Settings:
    return Fp8Settings(amax_history_len=args.amax_history_len, margin=args.fp8_margin,
                       autoheal_patience=args.autoheal_patience)


def _check(args: argparse.Namespace) -> list[str]:
    default = LR_VARIANTS if args.preset == "lr" else BASE_VARIANTS
    variants = [v for v in (args.variants if args.variants is not None else ",".join(default)).split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"--variants: unknown {bad or 'empty list'}; pick from {','.join(VARIANTS)}")
    if not args.seeds:
        raise ValueError("--seeds: give at least one seed, e.g. --seeds 1,2,3")
    for flag, value in (("--base-iters", args.base_iters), ("--resume-iters", args.resume_iters),
                        ("--log-interval", args.log_interval), ("--threads", args.threads), ("--jobs", args.jobs)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if not args.lrs or any(lr <= 0 for lr in args.lrs):
        raise ValueError(f"--lrs: give positive learning rates, e.g. --lrs 3e-3,1e-2,3e-2; got {args.lrs}")
    if any(c <= 0 for c in args.inject_c) or not args.inject_c:
        raise ValueError(f"--inject-c: values must be > 0, got {args.inject_c}")
    return variants


def _inject(args, out: Path, data: Path, variants: list[str]) -> dict:
    if args.quick:
        setup = presets.TinySetup(lr=3e-3, log_interval=2, eval_iters=2, threads=args.threads,
                                  torch_compile=args.torch_compile,
                                  fp8=_fp8_settings(args))
        result = presets.run_inject(out, data, setup, ["bf16", "fp8"], [args.seeds[0]], [args.inject_c[-1]],
                                    args.inject_channels, base_iters=8, resume_iters=8, controls=False,
                                    dry_run=args.dry_run, jobs=args.jobs)
    else:
        wd = (args.weight_decay or [0.1])
        if len(wd) != 1:
            raise ValueError("--weight-decay: the inject preset takes one value (the natural preset sweeps)")
        setup = presets.TinySetup(lr=args.lr or 3e-3, weight_decay=wd[0], log_interval=args.log_interval,
                                  threads=args.threads, torch_compile=args.torch_compile,
                                  fp8=_fp8_settings(args))
        result = presets.run_inject(out, data, setup, variants, args.seeds, args.inject_c, args.inject_channels,
                                    args.base_iters, args.resume_iters, fp8_controls=args.fp8_controls,
                                    dry_run=args.dry_run, jobs=args.jobs, fp8_every_c=args.fp8_every_c)
    if args.dry_run:
        return result
    result.update(_plots_inject(result, out))
    return result


def _plots_inject(result: dict, out: Path) -> dict:
    """Seed-one runs at c* beside the BF16 control: activation maxima, losses, alignment histograms."""
    c_star = result["c_star"]
    tag = "control" if c_star is None else f"c{c_star:g}"
    seed = result["seeds"][0]
    shown = {f"{v} {tag}": result["runs"][f"{v}_{tag}_s{seed}"] for v in result["variants"]
             if f"{v}_{tag}_s{seed}" in result["runs"]}
    ctl = result["runs"].get(f"bf16_control_s{seed}")
    if ctl is not None:
        shown = {"bf16 control": ctl, **shown}
    start = result["base_iters"]
    plots = [analysis.plot_activation_maxima({k: e["per_layer"] for k, e in shown.items()},
                                             out / "stability_inject_act_max.png", mark_step=start),
             analysis.plot_losses({k: e["loss"] for k, e in shown.items()}, out / "stability_inject_loss.png",
                                  mark_step=start)]
    for name, e in shown.items():
        if e.get("end_alignment"):
            safe = name.replace(" ", "_")
            plots.append(analysis.plot_alignment_histograms(e["start_alignment"], e["end_alignment"],
                                                            out / f"stability_inject_align_{safe}.png", name))
    return {"plots": [str(p) for p in plots]}


def _natural(args, out: Path, data: Path, variants: list[str]) -> dict:
    iters = args.iters or 200  # ~8 epochs of the 24k-token corpus: alignment saturates within 50 (docs)
    setups = {wd: presets.TinySetup(lr=args.lr or 1e-2, weight_decay=wd, log_interval=args.log_interval,
                                    train_split="valid", threads=args.threads, torch_compile=args.torch_compile,
                                    fp8=_fp8_settings(args))
              for wd in (args.weight_decay or [0.0, 0.1, 1.0])}
    result: dict = {"preset": "natural", "iters": iters, "by_weight_decay": {}, "plots": []}
    for wd, setup in setups.items():
        sub = out / f"wd{wd:g}"
        configs = {v: presets.variant_flags(v, setup.fp8) + ["--save-interval", str(max(1, iters // 10))]
                   for v in variants}
        res = presets.run_simple(sub, configs, {v: args.seeds for v in variants},
                                 lambda seed, s=setup: s.flags(data, seed, iters), args.threads, args.dry_run,
                                 jobs=args.jobs)
        result["by_weight_decay"][f"{wd:g}"] = res
        if args.dry_run:
            continue
        first = {v: res["runs"][f"{v}_s{args.seeds[0]}"] for v in variants}
        result["plots"].append(str(analysis.plot_activation_maxima(
            {v: e.get("per_layer", {}) for v, e in first.items()}, out / f"stability_natural_wd{wd:g}_act_max.png")))
        result["plots"].append(str(analysis.plot_activation_maxima(
            {v: e.get("per_layer", {}) for v, e in first.items()}, out / f"stability_natural_wd{wd:g}_align_max.png",
            key="align_max")))
        e = first[variants[0]]
        if e.get("end_alignment"):
            result["plots"].append(str(analysis.plot_alignment_histograms(
                e["start_alignment"], e["end_alignment"], out / f"stability_natural_wd{wd:g}_align_hist.png",
                f"{variants[0]} wd {wd:g}")))
    return result


def _lr_sweep(args, out: Path, data: Path, variants: list[str]) -> dict:
    """The natural preset's tiny model and small corpus at one weight decay, per peak LR, variant and seed."""
    iters = args.iters or 200
    wd = args.weight_decay or [0.1]
    if len(wd) != 1:
        raise ValueError("--weight-decay: the lr preset takes one value (the natural preset sweeps)")
    result: dict = {"preset": "lr", "iters": iters, "weight_decay": wd[0], "variants": variants,
                    "seeds": args.seeds, "by_lr": {}}
    for lr in args.lrs:
        setup = presets.TinySetup(lr=lr, weight_decay=wd[0], log_interval=args.log_interval, train_split="valid",
                                  threads=args.threads, torch_compile=args.torch_compile,
                                  fp8=_fp8_settings(args))
        configs = {v: presets.variant_flags(v, setup.fp8) + ["--save-interval", str(iters)] for v in variants}
        result["by_lr"][f"{lr:g}"] = presets.run_simple(
            out / f"lr{lr:g}", configs, {v: args.seeds for v in variants},
            lambda seed, s=setup: s.flags(data, seed, iters), args.threads, args.dry_run, jobs=args.jobs)
    if not args.dry_run:
        result["table"] = presets.lr_table(result["by_lr"], variants, args.seeds)
        result["plots"] = [str(analysis.plot_loss_vs_lr(result["table"], out / "stability_lr_sweep.png"))]
    return result


def _demo(args, out: Path, data: Path) -> dict:
    demo = _demo_module()
    iters = args.iters or 200  # the ablation: 15 runs x ~430 CPU-s, ~55 min on 2 cores (docs/stability.md)
    batch = ["--micro-batch-size", "16", "--global-batch-size", "32", "--train-iters", str(iters),
             "--lr-warmup-iters", str(max(1, iters // 20)), "--log-interval", str(max(1, iters // 10)),
             "--eval-interval", str(max(1, iters // 5)), "--eval-iters", "8", "--no-divergence-guard",
             "--torch-compile", args.torch_compile]
    linears = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"]
    if args.preset == "recipes":
        recipes = [r for r in args.recipes.split(",") if r]
        bad = [r for r in recipes if r not in RECIPES]
        if bad:
            raise ValueError(f"--recipes: unknown {bad}; pick from {','.join(RECIPES)}")
        configs = {"bf16": [], **{r: linears + ["--fp8-recipe", r] for r in recipes}}
        seeds = {"bf16": args.seeds, **{r: args.recipe_seeds or args.seeds for r in recipes}}
    else:
        linears = linears + ["--fp8-recipe", "delayed"]
        configs = {"bf16": [], "fp8_linears": linears, "fp8_linears_smooth": linears + ["--smooth-swiglu"],
                   "fp8adam": ["--optimizer", "fp8adam"],
                   "all_three": linears + ["--smooth-swiglu", "--optimizer", "fp8adam"]}
        seeds = {k: args.seeds for k in configs}
    if args.no_bf16:
        del configs["bf16"]
    result = presets.run_simple(out, configs, seeds, lambda seed: [
        *demo.MODEL, *demo.OPTIM, *batch, *demo._data_flags(data), "--seed", str(seed)], args.threads, args.dry_run,
        jobs=args.jobs)
    bf16 = result["table"].get("bf16", {}).get("final_valid_loss", {"mean": None, "std": None})
    for name, row in result["table"].items():  # gap to BF16's mean, and BF16's own spread as the yardstick
        m = row["final_valid_loss"]["mean"]
        row["valid_gap_to_bf16"] = None if m is None or bf16["mean"] is None else m - bf16["mean"]
    result.update(preset=args.preset, iters=iters, bf16_valid_spread=bf16["std"])
    return result


def _report(paths: list[str]) -> int:
    summaries = []
    for path in map(Path, paths):
        if not path.is_file():
            print(f"stability_lab: error: --report {path}: no such file (pass a lab summary.json)", file=sys.stderr)
            return 2
        summaries.append(json.loads(path.read_text()))
    try:
        summary = summaries[0] if len(summaries) == 1 else report.merge(summaries, paths)
    except ValueError as exc:
        print(f"stability_lab: error: {exc}", file=sys.stderr)
        return 2
    print(report.markdown(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report:
        return _report(args.report)
    try:
        variants = _check(args)
        preset = "quick" if args.quick else args.preset
        if args.no_bf16 and args.preset not in ("recipes", "ablation"):
            raise ValueError("--no-bf16 applies to the recipes and ablation presets only")
        if args.quick and args.preset != "inject":
            raise ValueError("--quick runs the inject preset in miniature: drop --preset or use --preset inject")
        out = Path(args.output_dir or REPO / "runs" / "stability" / preset).resolve()
        data = Path(args.data_dir)
        data = (data if data.is_absolute() else REPO / data).resolve()
        ensure_demo_data(data)
        start = time.time()
        if args.reanalyze:
            if args.preset != "inject" or not (out / "summary.json").is_file():
                raise ValueError(f"--reanalyze needs --preset inject and an earlier {out / 'summary.json'}")
            old = json.loads((out / "summary.json").read_text())
            result = presets.reanalyze_inject(old, out)
            result.update(_plots_inject(result, out))
        elif args.preset == "inject":
            result = _inject(args, out, data, variants)
        elif args.preset == "natural":
            result = _natural(args, out, data, variants)
        elif args.preset == "lr":
            result = _lr_sweep(args, out, data, variants)
        else:
            result = _demo(args, out, data)
    except ValueError as exc:
        print(f"stability_lab: error: {exc}", file=sys.stderr)
        return 2
    argv_used = sys.argv[1:] if argv is None else list(argv)
    if args.reanalyze:  # keep the wall time and argv of the runs themselves
        result["reanalyzed"] = {"argv": argv_used, "wall_s": time.time() - start}
    else:
        result["wall_s"] = time.time() - start
        result["argv"] = argv_used
    if not args.reanalyze:
        # Each run's own CPU seconds (wait4): CPU-s / jobs is the preset's wall time on an idle machine with
        # --jobs free cores, whatever else ran beside it.
        subs = list(result.get("by_weight_decay", {}).values()) + list(result.get("by_lr", {}).values())
        commands = result.get("commands", []) + [c for sub in subs for c in sub.get("commands", [])]
        cpu = [c["cpu_s"] for c in commands if c.get("cpu_s") == c.get("cpu_s")]  # NaN: a reused base run
        result["cpu_s"] = sum(cpu)
    presets.write_json(out / "summary.json", result)
    print(f"[lab] {preset} done in {time.time() - start:.0f} s ({result.get('cpu_s', 0.0):.0f} CPU-s in its runs): "
          f"{out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
