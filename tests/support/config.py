"""The repository's path and the tiny configuration of the tests (2 layers, hidden 64, vocab 128, seq 32)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from bench.common import REPO  # noqa: F401  (the tests' one definition of the repository's path)

TINY = {
    "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--num-key-value-heads": 2,
    "--seq-length": 32, "--micro-batch-size": 4, "--global-batch-size": 8, "--train-iters": 20,
    "--lr": 3e-3, "--min-lr": 3e-4, "--lr-decay-style": "cosine", "--lr-warmup-iters": 2,
    "--vocab-size": 128, "--normalization": "RMSNorm", "--log-interval": 5, "--eval-interval": 10,
    "--eval-iters": 2, "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--seed": 1234,
    "--weight-decay": 0.1,
}
TINY_SWITCHES = ["--mock-data", "--swiglu", "--use-rotary-position-embeddings",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def load_tool(name: str):
    """Import `tools/<name>.py` as a module (the tools folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_bench(name: str):
    """Import `bench/<name>.py` as the module `name` (the bench folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_argv(*switches: str, **overrides) -> list[str]:
    """argv for a tiny Llama-style run; overrides use underscores (train_iters=5); None drops a flag."""
    values = dict(TINY)
    for key, value in overrides.items():
        values["--" + key.replace("_", "-")] = value
    argv = list(TINY_SWITCHES)
    for flag, value in values.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(switches)


def write_zero3_config(folder: Path) -> str:
    """`folder`/zero3.json, a DeepSpeed config of ZeRO stage 3 with `stage3_param_persistence_threshold: 0`, so that
    every parameter is partitioned and gathered (DeepSpeed's default, 1e5 elements, keeps every tensor of the tiny
    model whole); its path, for `--deepspeed_config`."""
    path = Path(folder) / "zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return str(path)
