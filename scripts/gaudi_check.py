"""One-command check of the Gaudi path on a machine with Gaudi2 and habana_frameworks (scripts/gaudi_check.sh).

Nothing of the HPU path has run on a Gaudi from this repository yet: on CPU it is exercised through stand-ins of
Habana's ops written from their documented semantics (tests/support/fake_hpu.py). This check is the first thing to
run on a Gaudi machine. Stages, each streaming its output and cut at its limit (the whole check < 5 minutes); the
results are rewritten into gaudi_check.json after every stage:

  env        torch and habana_frameworks versions, device count, PT_HPU_LAZY_MODE / PT_ENABLE_INT64_SUPPORT, lazy
  probes     pytest -m hpu tests/unit/test_gaudi.py: the E4M3 cast of +-300, the power-of-two bit ops, Fp8AdamW's
             int32 noise vs the CPU, int64 sums past 2**31 (PT_ENABLE_INT64_SUPPORT), fp8_gemm_v2 with 0-d scale
             inverses in the E4M3 x E4M3, E5M2 x E4M3 and E5M2 x E5M2 pairs, one FP8 layer's three GEMMs against
             FP32 (as accurate as the emulation), one Fp8AdamW step against the CPU
  train_1    pretrain_gpt.py on one Gaudi: FP8 (hpu backend) + Smooth-SwiGLU + Fp8AdamW, 30 iterations, HCCL

    bash scripts/gaudi_check.sh                # all stages; writes gaudi_check.json and gaudi_check.md
    bash scripts/gaudi_check.sh --dry-run      # print the plan and exit 0
    bash scripts/gaudi_check.sh --out DIR      # where the files go (default: $OUT, else docs/gaudi/)

Without a Gaudi it prints one line and exits 2. docs/gaudi.md says what this verifies and what the CPU tests do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from gpu_check import run_stages  # noqa: E402  (the same stage runner: streaming, limits, partial output kept)

DEADLINE_S = 280
PY = sys.executable
TINY_MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --num-key-value-heads 4 "
              "--ffn-hidden-size 1408 --seq-length 512 --micro-batch-size 8 --global-batch-size 16 "
              "--vocab-size 32000 --mock-data --swiglu --normalization RMSNorm --use-rotary-position-embeddings "
              "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
              "--lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5 --train-iters 30 --eval-iters 2 --eval-interval 15 "
              "--log-interval 10 --bf16 --device hpu")
FP8_RECIPE = "--fp8-format hybrid --fp8-backend hpu --smooth-swiglu --optimizer fp8adam --fp8-optimizer-block-size 128"


def plan() -> list[dict]:
    """The stages: name, command, environment additions and time limit (seconds)."""
    return [
        {"name": "probes", "limit": 120, "env": {},
         "cmd": [PY, "-m", "pytest", "-v", "-s", "-m", "hpu", "-p", "no:cacheprovider",
                 str(REPO / "tests" / "unit" / "test_gaudi.py")]},
        {"name": "train_1", "limit": 120, "env": {"MEGATRON_FORCE_COLLECTIVES": "1"},
         "cmd": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                 str(REPO / "pretrain_gpt.py"), *TINY_MODEL.split(), *FP8_RECIPE.split()]},
    ]


def _probe() -> dict:
    import importlib.util

    info = {"python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
            "habana_frameworks": importlib.util.find_spec("habana_frameworks") is not None, "devices": 0}
    if not info["habana_frameworks"]:
        return info
    sys.path.insert(0, str(REPO))
    from megatron.accelerator import hpu_is_lazy, prepare_habana_environment

    prepare_habana_environment()
    try:
        import habana_frameworks.torch.hpu as hthpu
        import torch

        info.update(torch=torch.__version__, devices=int(hthpu.device_count()) if hthpu.is_available() else 0,
                    lazy=hpu_is_lazy(), env={k: os.environ.get(k) for k in ("PT_HPU_LAZY_MODE",
                                                                             "PT_ENABLE_INT64_SUPPORT")})
        if info["devices"]:
            info["name"] = hthpu.get_device_name()
    except Exception as exc:  # noqa: BLE001 - a broken install: reported, no device
        info["error"] = f"{exc.__class__.__name__}: {exc}"
    return info


def write_markdown(results: dict, path: Path) -> None:
    env = results.get("env", {})
    lines = ["# Gaudi check", "", f"- device: {env.get('name', '?')} x{env.get('devices', '?')}, lazy mode "
             f"{env.get('lazy')}, {env.get('env')}", f"- torch {env.get('torch')}, python {env.get('python')}",
             f"- date: {env.get('date')}; command: `bash scripts/gaudi_check.sh`", "",
             "| stage | rc | seconds | summary |", "|---|---|---|---|"]
    for name, r in results.items():
        if name != "env":
            lines.append(f"| {name} | {r['rc']} | {r['seconds']} | {r['summary'].replace('|', '/')[:300]} |")
    for name in ("probes", "train_1"):
        if name in results:
            lines += ["", f"## {name}", "", "```", results[name]["output_tail"][-4000:].strip(), "```"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit 0")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "docs" / "gaudi"),
                   help="folder for gaudi_check.json and gaudi_check.md (default: $OUT, else docs/gaudi)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.dry_run:
        print(f"gaudi_check plan, {DEADLINE_S} s in all (results -> {out / 'gaudi_check.json'}, "
              f"{out / 'gaudi_check.md'}):")
        print("  env: torch and habana_frameworks, devices, lazy mode, PT_HPU_LAZY_MODE / PT_ENABLE_INT64_SUPPORT")
        for stage in plan():
            env = " ".join(f"{k}={v}" for k, v in stage["env"].items())
            print(f"  {stage['name']}: limit {stage['limit']} s: {env + ' ' if env else ''}{' '.join(stage['cmd'])}")
        return 0
    info = _probe()
    if not info["devices"]:
        print("gaudi_check: no Gaudi here (habana_frameworks and an hpu device); nothing to check")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"env": info}
    json_path = out / "gaudi_check.json"
    json_path.write_text(json.dumps(results, indent=1))
    passed = run_stages(plan(), results, out, json_path, DEADLINE_S, "gaudi_check")
    write_markdown(results, out / "gaudi_check.md")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
