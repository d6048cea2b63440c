"""One-command check of the CUDA path on a machine with NVIDIA GPUs (called by scripts/gpu_check.sh).

Sized for the machine we can expect to borrow: one H200 with its preinstalled torch, no DeepSpeed, no torchao,
no network, and minutes of machine time. Every stage has its own time limit and writes its result into
gpu_check.json the moment it finishes (a stage that dies still leaves the earlier ones), then a markdown
summary is written next to it. Stages:

  env          torch/CUDA versions, GPU name, compute capability, GPU count, optional packages present
  gpu_tests    pytest -m gpu (scaled_mm vs emulation on the GPU, a tiny FP8 GPT trained on the GPU, the
               fine-grained recipes against their emulation)
  train_1gpu   pretrain_gpt.py under torchrun on one GPU: FP8 + Smooth-SwiGLU + Fp8AdamW, NCCL process group
               with the collective path forced on at world size 1 (MEGATRON_FORCE_COLLECTIVES=1)
  train_tp2    the same at tensor-parallel size 2 (only with 2+ GPUs)
  bench_linear bench/bench_fp8_linear.py at the Llama2-7B linear shapes (ours vs BF16, torchao when present)
  bench_step   bench/bench_train_step.py on a ~1B-parameter Llama: FP8 recipe vs the faster of eager and
               compiled BF16, 30 timed steps after warm-up
  bench_host   bench/bench_host_overhead.py on the GPU: host time per FP8 layer call (eager, fused, traced),
               per fp8_optimizer_step (batched vs per module) and per Fp8AdamW chunk call
  bench_traced bench/bench_train_step.py on the demo model, compiled: FP8 layers traced into the blocks vs
               as graph breaks (`--torch-compile on,on-break`), BF16 alongside

    bash scripts/gpu_check.sh                # all stages; writes gpu_check.json and gpu_check.md
    bash scripts/gpu_check.sh --dry-run      # print the plan (commands and limits) and exit 0
    bash scripts/gpu_check.sh --out DIR      # where the two files go (default: $OUT or the current folder)

Without an FP8-capable GPU (compute capability >= 8.9) it prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 235  # the whole check, so that a failed first try can be rerun within the machine's time
PY = sys.executable
TINY_MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --num-key-value-heads 4 "
              "--ffn-hidden-size 1408 --seq-length 512 --micro-batch-size 8 --global-batch-size 16 "
              "--vocab-size 32000 --mock-data --swiglu --normalization RMSNorm --use-rotary-position-embeddings "
              "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
              "--lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5 --train-iters 40 --eval-iters 2 --eval-interval 20 "
              "--log-interval 10 --bf16 --device cuda")
FP8_RECIPE = "--fp8-format hybrid --smooth-swiglu --optimizer fp8adam --fp8-optimizer-block-size 128"
# ~1.06B parameters: 18 layers, hidden 2048, FFN 5632, GQA 16/8, vocab 32000, seq 2048.
ONE_B = ("--num-layers 18 --hidden-size 2048 --num-attention-heads 16 --num-key-value-heads 8 "
         "--ffn-hidden-size 5632 --seq-length 2048 --vocab-size 32000")


def _torchrun(nproc: int, extra: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "pretrain_gpt.py"), *TINY_MODEL.split(), *FP8_RECIPE.split(), *extra.split()]


def plan(gpus: int) -> list[dict]:
    """The stages: name, command, environment additions and time limit (seconds)."""
    stages = [
        {"name": "gpu_tests", "limit": 60, "env": {},
         "cmd": [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                 str(REPO / "tests" / "unit" / "test_gpu.py"), str(REPO / "tests" / "unit" / "test_fp8_recipes.py")]},
        {"name": "train_1gpu", "limit": 60, "env": {"MEGATRON_FORCE_COLLECTIVES": "1"}, "cmd": _torchrun(1, "")},
    ]
    if gpus >= 2:
        stages.append({"name": "train_tp2", "limit": 60, "env": {},
                       "cmd": _torchrun(2, "--tensor-model-parallel-size 2 --sequence-parallel")})
    stages += [
        {"name": "bench_linear", "limit": 50, "env": {},
         "cmd": [PY, str(REPO / "bench" / "bench_fp8_linear.py"), "--tokens", "8192", "--iters", "20"]},
        {"name": "bench_host", "limit": 40, "env": {},
         "cmd": [PY, str(REPO / "bench" / "bench_host_overhead.py"), "--device", "cuda", "--rounds", "10"]},
        {"name": "bench_step", "limit": 150, "env": {},
         "cmd": [PY, str(REPO / "bench" / "bench_train_step.py"), "--device", "cuda", "--compile-bf16",
                 "--iters", "30", "--warmup", "3", "--micro-batch-size", "4", "--micro-batches", "1",
                 "--variants", "bf16,fp8 linears,fp8 linears + Fp8AdamW", "--extra", ONE_B,
                 "--json", "{out}/bench_step.json"]},
        # Compiled blocks with the FP8 layers traced into them vs as graph breaks, on a small model where the
        # host's per-layer overhead shows (the GPU waits for Python): the gain megatron/fp8/traced.py is for.
        {"name": "bench_traced", "limit": 60, "env": {},
         "cmd": [PY, str(REPO / "bench" / "bench_train_step.py"), "--device", "cuda", "--torch-compile", "on,on-break",
                 "--iters", "20", "--warmup", "3", "--micro-batch-size", "4", "--micro-batches", "2",
                 "--variants", "bf16,fp8 + smooth-swiglu + Fp8AdamW", "--json", "{out}/bench_traced.json"]},
    ]
    return stages


def _probe() -> dict:
    import importlib.util

    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
            "python": sys.version.split()[0],
            "optional": {m: importlib.util.find_spec(m) is not None for m in ("deepspeed", "torchao", "triton")}}
    if info["gpus"]:
        info["name"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    return info


def _summary_line(name: str, output: str) -> str:
    """The one line of a stage's output worth putting in the summary."""
    patterns = {"gpu_tests": r"^\d+ (passed|failed).*$|^=+ .*(passed|failed).* =+$",
                "train_1gpu": r"iteration +\d+/ +\d+ \|.*$", "train_tp2": r"iteration +\d+/ +\d+ \|.*$"}
    lines = [ln for ln in output.splitlines() if re.search(patterns.get(name, r"$^"), ln)]
    return lines[-1].strip() if lines else ""


def run_stage(stage: dict, out: Path, limit: float) -> dict:
    cmd = [c.replace("{out}", str(out)) for c in stage["cmd"]]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **stage["env"])
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    return {"rc": rc, "seconds": round(time.time() - start, 1), "summary": _summary_line(stage["name"], output),
            "output_tail": output[-6000:]}


def write_markdown(results: dict, path: Path) -> None:
    env = results.get("env", {})
    lines = ["# GPU check", "", f"- GPU: {env.get('name', '?')} x{env.get('gpus', '?')} (sm {env.get('capability')})",
             f"- torch {env.get('torch')} (CUDA {env.get('cuda')}), python {env.get('python')}, "
             f"optional: {env.get('optional')}", "", "| stage | rc | seconds | summary |", "|---|---|---|---|"]
    for name, r in results.items():
        if name != "env":
            lines.append(f"| {name} | {r['rc']} | {r['seconds']} | {r['summary'].replace('|', '/')[:200]} |")
    for name in ("bench_linear", "bench_host", "bench_step", "bench_traced"):
        if name in results:
            lines += ["", f"## {name}", "", "```", results[name]["output_tail"][-3000:].strip(), "```"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit 0")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json / gpu_check.md")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.dry_run:
        print(f"gpu_check plan, {DEADLINE_S} s in all (results -> {out / 'gpu_check.json'}, {out / 'gpu_check.md'}):")
        print("  env: torch/CUDA versions, GPU name and capability, optional packages")
        for stage in plan(gpus=2):
            env = " ".join(f"{k}={v}" for k, v in stage["env"].items())
            cmd = " ".join(c.replace("{out}", str(out)) for c in stage["cmd"])
            when = " (only with 2+ GPUs)" if stage["name"] == "train_tp2" else ""
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
    deadline = time.time() + DEADLINE_S
    for stage in plan(info["gpus"]):
        left = deadline - time.time()
        if left < 10:
            results[stage["name"]] = {"rc": 124, "seconds": 0, "summary": "skipped: the check's time ran out",
                                      "output_tail": ""}
            continue
        print(f"[gpu_check] {stage['name']} ...", flush=True)
        results[stage["name"]] = run_stage(stage, out, min(stage["limit"], left))
        print(f"[gpu_check] {stage['name']}: rc {results[stage['name']]['rc']} in "
              f"{results[stage['name']]['seconds']} s {results[stage['name']]['summary']}", flush=True)
        json_path.write_text(json.dumps(results, indent=1))  # at once: a later stage may not finish
    write_markdown(results, out / "gpu_check.md")
    return 0 if all(r["rc"] == 0 for k, r in results.items() if k != "env") else 1


if __name__ == "__main__":
    sys.exit(main())
