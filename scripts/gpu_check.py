"""One-command check of the CUDA path on a machine with NVIDIA GPUs (called by scripts/gpu_check.sh).

Sized for the machine we can expect to borrow: one H200 with its preinstalled torch, no network, minutes of
machine time. torchao and DeepSpeed come as wheels carried from a machine with network (scripts/
fetch_gpu_wheels.sh; scripts/gpu_check.sh installs them into .gpu_site when wheels/gpu/ holds them). The decisive
number comes first. Every stage streams its output as it goes, has a time limit (the limits of a one-GPU machine
sum to less than the whole check's deadline), and the results are rewritten into gpu_check.json after every
stage, the block-stack bench's rows after every variant: a stage cut short keeps what it printed. Stages:

  env          torch/CUDA versions, driver, GPU name, compute capability, GPU count, optional packages present
  block_stack  bench/bench_block_stack.py: 2 Llama blocks at Llama2-7B shapes (sequence 4096), forward + backward
               + optimizer step, compiled BF16 vs our FP8 delayed + Smooth-SwiGLU vs our tensorwise vs torchao's
               tensorwise, CUDA events, a profile per variant by kernel class
  gpu_tests    pytest -m gpu (scaled_mm vs emulation on the GPU, a tiny FP8 GPT trained on the GPU, the
               fine-grained recipes against their emulation), one line per test, each stopped after 40 s
  train_1gpu   pretrain_gpt.py under torchrun on one GPU: FP8 + Smooth-SwiGLU + Fp8AdamW, NCCL process group
               with the collective path forced on at world size 1 (MEGATRON_FORCE_COLLECTIVES=1)
  train_tp2    the same at tensor-parallel size 2 (only with 2+ GPUs, within what the deadline leaves)
  train_fsdp2  FSDP2 with FP8 weight gathers and Fp8AdamW (--use-torch-fsdp2 --fp8-param-gather) on 2 GPUs, NCCL,
               every collective counted: fsdp2_counts.rank<r>.json holds the bytes gathered per iteration (only with
               2+ GPUs, within what the deadline leaves)
  model        bench/project.py --against block_stack.json: each measured block-stack row next to the performance
               model's projection of the same stack on this GPU, with the residuals (CPU work, last, in what the
               deadline leaves; `python bench/project.py --against OUT/block_stack.json` makes the same table
               anywhere afterwards)

    bash scripts/gpu_check.sh                # all stages; writes gpu_check.json and gpu_check.md
    bash scripts/gpu_check.sh --dry-run      # print the plan (commands and limits) and exit 0
    bash scripts/gpu_check.sh --out DIR      # where the files go (default: $OUT, else docs/gpu/)

Without an FP8-capable GPU (compute capability >= 8.9) it prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 285  # the whole check (< 5 minutes), so that a failed first try can be rerun within the machine's time
PY = sys.executable
TINY_MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --num-key-value-heads 4 "
              "--ffn-hidden-size 1408 --seq-length 512 --micro-batch-size 8 --global-batch-size 16 "
              "--vocab-size 32000 --mock-data --swiglu --normalization RMSNorm --use-rotary-position-embeddings "
              "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
              "--lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5 --train-iters 20 --eval-iters 2 --eval-interval 10 "
              "--log-interval 5 --bf16 --device cuda")
FP8_RECIPE = "--fp8-format hybrid --smooth-swiglu --optimizer fp8adam --fp8-optimizer-block-size 128"



def _torchrun(nproc: int, extra: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "pretrain_gpt.py"), *TINY_MODEL.split(), *FP8_RECIPE.split(), *extra.split()]


def fsdp2_command() -> list[str]:
    """FSDP2 with FP8 weight gathers and Fp8AdamW on its shards over NCCL on 2 GPUs, every collective counted by
    tests/support/count_collectives.py: {out}/fsdp2_counts.rank<r>.json holds, per iteration, the bytes each rank
    gathered."""
    flags = [*TINY_MODEL.split(), *FP8_RECIPE.split()]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(REPO / "tests" / "support" / "count_collectives.py"), "{out}/fsdp2_counts", "--", *flags,
            "--use-torch-fsdp2", "--fp8-param-gather"]


def plan(gpus: int) -> list[dict]:
    """The stages: name, command, environment additions and time limit (seconds)."""
    stages = [
        {"name": "block_stack", "limit": 120, "env": {},
         "cmd": [PY, str(REPO / "bench" / "bench_block_stack.py"), "--device", "cuda", "--layers", "2",
                 "--iters", "10", "--warmup", "2", "--profile", "--top-kernels", "12", "--json",
                 "{out}/block_stack.json"]},
        {"name": "gpu_tests", "limit": 70, "env": {},
         "cmd": [PY, "-m", "pytest", "-v", "--timeout", "40", "-m", "gpu", "-p", "no:cacheprovider",
                 str(REPO / "tests" / "unit" / "test_gpu.py"), str(REPO / "tests" / "unit" / "test_fp8_recipes.py")]},
        {"name": "train_1gpu", "limit": 85, "env": {"MEGATRON_FORCE_COLLECTIVES": "1"}, "cmd": _torchrun(1, "")},
    ]
    if gpus >= 2:
        stages.append({"name": "train_tp2", "limit": 45, "env": {},
                       "cmd": _torchrun(2, "--tensor-model-parallel-size 2 --sequence-parallel")})
        stages.append({"name": "train_fsdp2", "limit": 45, "env": {}, "cmd": fsdp2_command()})
    stages.append({"name": "model", "limit": 90, "env": {}, "leftover": True,
                   "cmd": [PY, str(REPO / "bench" / "project.py"), "--against", "{out}/block_stack.json", "--json",
                           "{out}/model_vs_measured.json"]})
    return stages


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _probe() -> dict:
    import importlib.util

    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
            "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
            "optional": {m: importlib.util.find_spec(m) is not None for m in ("deepspeed", "torchao", "triton")}}
    if info["gpus"]:
        info["name"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["driver"] = _driver()
    return info


def _summary_line(name: str, output: str) -> str:
    """The one line of a stage's output worth putting in the summary."""
    patterns = {"gpu_tests": r"^\d+ (passed|failed).*$|^=+ .*(passed|failed).* =+$",
                "train_1gpu": r"iteration +\d+/ +\d+ \|.*$", "train_tp2": r"iteration +\d+/ +\d+ \|.*$",
                "train_fsdp2": r"iteration +\d+/ +\d+ \|.*$",
                "block_stack": r"^(fp8-delayed|fp8-tensorwise|torchao) .*$",
                "model": r"^(bf16|fp8-delayed|fp8-tensorwise|torchao) \| .*$"}
    lines = [ln for ln in output.splitlines() if re.search(patterns.get(name, r"$^"), ln)]
    if not lines:
        return ""
    if name in ("block_stack", "model"):
        return " / ".join(ln.strip() for ln in lines[-4:])
    return lines[-1].strip()


def run_stage(stage: dict, out: Path, limit: float, echo=print) -> dict:
    """Run one stage, echoing its output line by line as it comes; killed (with what it printed kept) at `limit`."""
    cmd = [c.replace("{out}", str(out)) for c in stage["cmd"]]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONUNBUFFERED="1", **stage["env"])
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            echo(f"  [{stage['name']}] {line.rstrip()}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = 124
    reader.join(timeout=10)
    output = "".join(lines)
    return {"rc": rc, "seconds": round(time.time() - start, 1), "summary": _summary_line(stage["name"], output),
            "output_tail": output[-6000:]}


def run_stages(stages: list[dict], results: dict, out: Path, json_path: Path, deadline_s: float, tag: str) -> bool:
    """Run `stages` in order within `deadline_s` (a stage starts only with 10 s left, and gets at most what is left),
    rewriting `json_path` with `results` after each: a later stage may not finish. Whether every stage passed (a
    `leftover` stage, the CPU-only model table, does not decide it: it can be made afterwards)."""
    deadline = time.time() + deadline_s
    leftover = {s["name"] for s in stages if s.get("leftover")}
    for stage in stages:
        left = deadline - time.time()
        if left < 10:
            results[stage["name"]] = {"rc": 124, "seconds": 0, "summary": "skipped: the check's time ran out",
                                      "output_tail": ""}
            continue
        print(f"[{tag}] {stage['name']} ...", flush=True)
        result = results[stage["name"]] = run_stage(stage, out, min(stage["limit"], left))
        print(f"[{tag}] {stage['name']}: rc {result['rc']} in {result['seconds']} s {result['summary']}", flush=True)
        json_path.write_text(json.dumps(results, indent=1))
    return all(r["rc"] == 0 for k, r in results.items() if k != "env" and k not in leftover)


def write_markdown(results: dict, path: Path) -> None:
    env = results.get("env", {})
    lines = ["# GPU check", "", f"- GPU: {env.get('name', '?')} x{env.get('gpus', '?')} (sm {env.get('capability')}), "
             f"driver {env.get('driver', '?')}",
             f"- torch {env.get('torch')} (CUDA {env.get('cuda')}), python {env.get('python')}, "
             f"optional: {env.get('optional')}", f"- date: {env.get('date')}; command: `bash scripts/gpu_check.sh`",
             "", "| stage | rc | seconds | summary |", "|---|---|---|---|"]
    for name, r in results.items():
        if name != "env":
            lines.append(f"| {name} | {r['rc']} | {r['seconds']} | {r['summary'].replace('|', '/')[:300]} |")
    if "block_stack" in results:
        lines += ["", "## block_stack", "", "```", results["block_stack"]["output_tail"][-4000:].strip(), "```"]
    if "model" in results:
        lines += ["", "## model: measured vs projected (bench/project.py --against)", "", "```",
                  results["model"]["output_tail"][-3000:].strip(), "```"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit 0")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "docs" / "gpu"),
                   help="folder for gpu_check.json, gpu_check.md and block_stack.json (default: $OUT, else docs/gpu)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.dry_run:
        print(f"gpu_check plan, {DEADLINE_S} s in all (results -> {out / 'gpu_check.json'}, {out / 'gpu_check.md'}):")
        print("  env: torch/CUDA versions, driver, GPU name and capability, optional packages")
        for stage in plan(gpus=2):
            env = " ".join(f"{k}={v}" for k, v in stage["env"].items())
            cmd = " ".join(c.replace("{out}", str(out)) for c in stage["cmd"])
            when = " (only with 2+ GPUs)" if stage["name"] in ("train_tp2", "train_fsdp2") else ""
            print(f"  {stage['name']}{when}: limit {stage['limit']} s: {env + ' ' if env else ''}{cmd}")
        return 0
    info = _probe()
    if not info["gpus"] or tuple(info.get("capability", (0, 0))) < (8, 9):
        print("gpu_check: no CUDA GPU with FP8 tensor cores (compute capability >= 8.9) here; nothing to check")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"env": info}
    json_path = out / "gpu_check.json"
    json_path.write_text(json.dumps(results, indent=1))
    passed = run_stages(plan(info["gpus"]), results, out, json_path, DEADLINE_S, "gpu_check")
    write_markdown(results, out / "gpu_check.md")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
