"""What the stability lab runs: variants, preset flags, and the recorded `pretrain_gpt.py` subprocesses.

Every result of the lab is an ordinary CLI run: `run_pretrain` starts `pretrain_gpt.py` with the flags built
here, writes the exact command line to `<run>/command.txt` (and returns it for the JSON summary), and keeps
the run's stdout/stderr in `<run>/train.log`. A run that fails (an FP8 run may diverge and stop on NaNs) is
recorded with its exit code, not raised: a failure is one of the outcomes the lab measures.

The divergence guard is off (`--no-divergence-guard`) in every lab run: it would stop exactly the blow-ups
the lab is there to watch (tests/e2e/test_stability_lab_launch.py checks the flag is in every recorded command).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[2]

# The variants the inject and natural presets run by default; Smooth-SwiGLU and fc2-in-BF16 are on top of plain
# delayed FP8.
BASE_VARIANTS = ("bf16", "fp8", "fp8_smooth_channel", "fp8_smooth_token", "fp8_fc2_bf16")
# More, on request (--variants) and in the lr preset: plain FP8 with the FP8 controller (`--fp8-autoheal`), the
# full recipe (Smooth-SwiGLU channel + Fp8AdamW) and the full recipe with the controller.
VARIANTS = BASE_VARIANTS + ("fp8_autoheal", "fp8_full", "fp8_full_autoheal")
LR_VARIANTS = ("bf16", "fp8", "fp8_full", "fp8_full_autoheal")

# A tiny Llama (~0.62M parameters with the demo tokenizer's 4096 tokens, 0.1M outside the embeddings): small
# enough to overtrain for many epochs on 2 cores, with the same SwiGLU/RMSNorm/RoPE blocks as the demo model.
TINY_MODEL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-key-value-heads",
              "2", "--ffn-hidden-size", "176", "--seq-length", "64", "--swiglu", "--normalization", "RMSNorm",
              "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.02")


@dataclass(frozen=True)
class Fp8Settings:
    """The FP8 knobs the lab sweeps: amax history length and margin (delayed scaling)."""
    recipe: str = "delayed"
    amax_history_len: int = 16
    margin: int = 0
    autoheal_patience: int = 1  # the controller's variants state it in their commands (`--fp8-autoheal-patience`)

    def flags(self) -> list[str]:
        return ["--fp8-format", "hybrid", "--fp8-recipe", self.recipe, "--fp8-amax-history-len",
                str(self.amax_history_len), "--fp8-amax-compute-algo", "max", "--fp8-margin", str(self.margin),
                "--log-fp8-stats"]


def variant_flags(variant: str, fp8: Fp8Settings = Fp8Settings()) -> list[str]:
    """The flags that make `variant` (one of VARIANTS) on top of a BF16 run."""
    if variant == "bf16":
        return []
    if variant == "fp8":
        return fp8.flags()
    if variant == "fp8_smooth_channel":
        return fp8.flags() + ["--smooth-swiglu", "--smooth-swiglu-granularity", "channel"]
    if variant == "fp8_smooth_token":
        return fp8.flags() + ["--smooth-swiglu", "--smooth-swiglu-granularity", "token"]
    if variant == "fp8_fc2_bf16":
        return fp8.flags() + ["--fp8-mlp-fc2-bf16"]
    autoheal = ["--fp8-autoheal", "--fp8-autoheal-patience", str(fp8.autoheal_patience)]
    if variant == "fp8_autoheal":
        return fp8.flags() + autoheal
    if variant in ("fp8_full", "fp8_full_autoheal"):
        full = fp8.flags() + ["--smooth-swiglu", "--smooth-swiglu-granularity", "channel", "--optimizer", "fp8adam"]
        return full + (autoheal if variant == "fp8_full_autoheal" else [])
    raise ValueError(f"unknown variant {variant!r}: pick from {', '.join(VARIANTS)} (--variants)")


def data_flags(data_dir: Path, train: str = "train", valid: str = "valid", test: Optional[str] = "test") -> list[str]:
    """Indexed demo-corpus splits; `train="valid"` turns the 24k-token validation books into a small corpus."""
    flags = ["--train-data-path", str(data_dir / f"{train}_text_document"),
             "--valid-data-path", str(data_dir / f"{valid}_text_document"),
             "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(data_dir / "tokenizer.model"),
             "--data-cache-path", str(data_dir / "index-cache")]
    if test is not None:
        flags += ["--test-data-path", str(data_dir / f"{test}_text_document")]
    return flags


def ensure_demo_data(data_dir: Path) -> None:
    """Prepare the bundled demo corpus if it is missing (a few seconds; nothing is downloaded)."""
    needed = [data_dir / f"{s}_text_document.{e}" for s in ("train", "valid", "test") for e in ("bin", "idx")]
    if all(p.exists() for p in needed) and (data_dir / "tokenizer.model").exists():
        return
    subprocess.run([sys.executable, str(REPO / "tools" / "prepare_demo_data.py"), "--output-dir", str(data_dir)],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)


@dataclass
class RunRecord:
    name: str
    command: str
    returncode: int
    wall_s: float
    run_dir: str
    cpu_s: float = float("nan")  # user + system CPU seconds of the run's process: its cost on an idle machine

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def command_text(flags: Sequence[str], threads: int) -> str:
    """The shell command line of a run, as recorded."""
    cmd = [sys.executable, "pretrain_gpt.py", *flags]
    return f"OMP_NUM_THREADS={threads} " + " ".join(shlex.quote(c) for c in cmd)


def run_pretrain(name: str, flags: Sequence[str], run_dir: Path, threads: int = 1, dry_run: bool = False,
                 echo: bool = True) -> RunRecord:
    """Run `pretrain_gpt.py flags` with its log in run_dir/train.log; the record holds the exact command."""
    if "--no-divergence-guard" not in flags:
        raise ValueError(f"run {name}: lab runs must pass --no-divergence-guard (the guard stops what the lab "
                         "studies)")
    cmd = [sys.executable, "pretrain_gpt.py", *flags]
    text = command_text(flags, threads)
    if echo:
        print(f"[lab] {name}: {text}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(text + "\n")
    if dry_run:
        return RunRecord(name, text, 0, 0.0, str(run_dir))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        # wait4 reports this child's own CPU time (exact also when other runs go on in parallel, --jobs).
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
    record = RunRecord(name, text, rc, time.time() - start, str(run_dir), usage.ru_utime + usage.ru_stime)
    if echo:
        print(f"[lab] {name}: exit {rc} after {record.wall_s:.1f} s ({record.cpu_s:.1f} CPU-s)", flush=True)
    return record
