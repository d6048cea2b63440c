"""Bitwise fingerprints of a fixed set of short runs, to show that a change to how the code is organised changes no
number: every printed loss and a SHA-256 of every tensor of every final checkpoint file, per run.

    python -m tests.support.behaviour_digest run OUT.json      # the fixed set (several minutes on 2 cores)
    python -m tests.support.behaviour_digest compare A.json B.json

Run it on the code before a change and after, on the same machine (CPU kernels differ between CPU kinds, so the
fingerprints are not portable), and compare. The set: FP8 delayed scaling with Smooth-SwiGLU and Fp8AdamW, the
tensorwise and blockwise recipes, on the torch engine, DDP over 2 ranks, DeepSpeed ZeRO-1 and ZeRO-3, TP = 2, PP = 2.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

from tests.support.config import tiny_argv, write_zero3_config
from tests.support.launch import BASE, pretrain_command, run_checked

FP8 = ("--bf16", "--fp8-format", "hybrid")
RUNS = {  # name: (processes, switches)
    "delayed-smooth-fp8adam": (1, (*FP8, "--smooth-swiglu", "--optimizer", "fp8adam", "--no-fp8-optimizer-compile")),
    "tensorwise": (1, (*FP8, "--fp8-recipe", "tensorwise")),
    "blockwise": (1, (*FP8, "--fp8-recipe", "blockwise")),
    "ddp2": (2, FP8),
    "zero1": (2, (*FP8, "--deepspeed", "--zero-stage", "1")),
    "zero3": (2, (*FP8, "--deepspeed", "--deepspeed_config", "{zero3}")),
    "tp2": (2, (*FP8, "--tensor-model-parallel-size", "2")),
    "pp2": (2, (*FP8, "--deepspeed", "--zero-stage", "0", "--pipeline-model-parallel-size", "2")),
}
_LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")


def _tensors(folder: Path) -> dict[str, str]:
    import torch

    out = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1)
            out[prefix] = f"{tuple(value.shape)} {data.dtype} " + hashlib.sha256(
                data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)

    for path in sorted(folder.rglob("*.pt")):
        walk(str(path.relative_to(folder)), torch.load(path, map_location="cpu", weights_only=False))
    return out


def fingerprint(name: str, work: Path) -> dict:
    nproc, switches = RUNS[name]
    switches = tuple(s.replace("{zero3}", write_zero3_config(work)) for s in switches)
    save = work / name
    argv = tiny_argv(*switches, **{**BASE, "save": save, "save_interval": BASE["train_iters"]})
    log = run_checked(pretrain_command(nproc, argv), timeout=600).stderr
    return {"losses": _LOSS.findall(log), "tensors": _tensors(save / f"iter_{BASE['train_iters']:07d}")}


def compare(a: dict, b: dict) -> list[str]:
    problems = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            problems.append(f"{name}: only in one file")
            continue
        if a[name]["losses"] != b[name]["losses"]:
            problems.append(f"{name}: losses {a[name]['losses']} != {b[name]['losses']}")
        ta, tb = a[name]["tensors"], b[name]["tensors"]
        differing = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
        if differing:
            problems.append(f"{name}: {len(differing)} of {len(ta)} tensors differ, e.g. {differing[:3]}")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"] and len(argv) == 2:
        with tempfile.TemporaryDirectory() as tmp:
            result = {}
            for name in RUNS:
                result[name] = fingerprint(name, Path(tmp))
                print(f"{name}: {len(result[name]['losses'])} losses, {len(result[name]['tensors'])} tensors",
                      flush=True)
        Path(argv[1]).write_text(json.dumps(result, indent=1, sort_keys=True))
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        problems = compare(*(json.loads(Path(p).read_text()) for p in argv[1:]))
        print("\n".join(problems) or "bitwise the same: every loss and every checkpoint tensor of every run")
        return 1 if problems else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
