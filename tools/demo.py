"""The README's main job: FP8 vs BF16 on real English text, side by side, on this machine.

Steps: prepare the bundled demo corpus (World English Bible, held-out books for validation and
test), train the same Llama-style model twice on the same tokens (BF16, then FP8: hybrid delayed
scaling, Smooth-SwiGLU and FP8 Adam moments), compare the runs (table + PNG plots from their TensorBoard logs).

    python tools/demo.py            # the full demo (time stated in the README)
    python tools/demo.py --quick    # a smoke run: a 2-layer model, 30 iterations
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--num-key-value-heads", "4",
         "--ffn-hidden-size", "704", "--seq-length", "128", "--swiglu", "--normalization", "RMSNorm",
         "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.02"]
QUICK_MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--num-key-value-heads", "2",
               "--ffn-hidden-size", "352", "--seq-length", "128", "--swiglu", "--normalization", "RMSNorm",
               "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--hidden-dropout", "0", "--attention-dropout", "0"]
OPTIM = ["--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--adam-beta1", "0.9",
         "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
       "--fp8-amax-compute-algo", "max", "--smooth-swiglu", "--optimizer", "fp8adam", "--log-fp8-stats"]


def _data_flags(data_dir: Path) -> list[str]:
    return ["--train-data-path", str(data_dir / "train_text_document"),
            "--valid-data-path", str(data_dir / "valid_text_document"),
            "--test-data-path", str(data_dir / "test_text_document"),
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(data_dir / "tokenizer.model"),
            "--data-cache-path", str(data_dir / "index-cache")]


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def _print_eval_table(out: Path, runs: dict, train_minutes: dict, task: Path) -> None:
    """Held-out evaluation of every run side by side, with the gap to the first (BF16) run."""
    rows = {name: json.loads((out / name / "eval.json").read_text()) for name in runs}
    print("\nheld-out books (test split): perplexity and zero-shot next-verse accuracy")
    print(f"{'run':<6} {'test loss':>10} {'test ppl':>10} {'gap':>8} {'acc':>7} {'acc_norm':>9} {'train min':>10}"
          f"   ({next(iter(rows.values()))['tasks'][str(task)]['num_items']} next-verse items, chance 0.25)")
    ref = None
    for name, r in rows.items():
        loss, acc = r["data_path"]["loss"], r["tasks"][str(task)]
        ref = loss if ref is None else ref
        print(f"{name:<6} {loss:>10.4f} {math.exp(loss):>10.2f} {100 * (loss - ref) / ref:>7.2f}% "
              f"{acc['acc']:>7.3f} {acc['acc_norm']:>9.3f} {train_minutes[name]:>10.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: a 2-layer model, 30 iterations")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--data-dir", default="data/demo")
    p.add_argument("--train-iters", type=int, default=None, help="override the number of iterations")
    args = p.parse_args(argv)
    out, data_dir = REPO / args.output_dir, REPO / args.data_dir
    py = sys.executable
    start = time.time()
    train_minutes: dict[str, float] = {}
    _run([py, "tools/prepare_demo_data.py", "--output-dir", str(data_dir)])
    model = QUICK_MODEL if args.quick else MODEL
    iters = args.train_iters or (30 if args.quick else 400)
    batch = ["--micro-batch-size", "16", "--global-batch-size", "32" if not args.quick else "16",
             "--train-iters", str(iters), "--lr-warmup-iters", str(max(1, iters // 20)),
             "--log-interval", str(max(1, iters // 10)), "--eval-interval", str(max(1, iters // 5)),
             "--eval-iters", "4" if not args.quick else "2", "--seed", "1234"]
    if not args.quick:  # 400 iterations repay the few seconds of compiling (docs/performance.md), both runs alike
        batch += ["--torch-compile", "on"]
    runs = {"bf16": [], "fp8": FP8}
    task = data_dir / "tasks" / "next_verse_test.jsonl"
    _run([py, "tools/make_demo_tasks.py", "--input", str(data_dir / "test.jsonl"), "--output", str(task)])
    for name, extra in runs.items():
        run_dir = out / name
        # A fresh folder: stale event files or checkpoints of an earlier demo would mix into the comparison.
        shutil.rmtree(run_dir, ignore_errors=True)
        t0 = time.time()
        _run([py, "pretrain_gpt.py", *model, *OPTIM, *batch, *_data_flags(data_dir), *extra,
              "--tensorboard-dir", str(run_dir / "tb"), "--save", str(run_dir / "checkpoints")])
        train_minutes[name] = (time.time() - t0) / 60
        # Held-out books: perplexity on the test split and zero-shot "which verse comes next".
        _run([py, "tools/evaluate.py", "--load", str(run_dir / "checkpoints"), "--bf16",
              "--data-path", str(data_dir / "test_text_document"), "--data-cache-path", str(data_dir / "index-cache"),
              "--task", str(task), "--json", str(run_dir / "eval.json")])
    _run([py, "tools/compare_runs.py", *(str(out / name / "tb") for name in runs),
          "--labels", *runs, "--output-dir", str(out / "plots"), "--json", str(out / "compare.json")])
    _print_eval_table(out, runs, train_minutes, task)
    print(f"\ndemo finished in {(time.time() - start) / 60:.1f} min; plots in {out / 'plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
