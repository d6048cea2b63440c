"""FSDP2 against DeepSpeed ZeRO-3, and FP8 weight gathers against BF16 ones, measured side by side in one run.

Usage:
    python bench/bench_fsdp2.py gather [--num-layers 4 --hidden-size 512 --ffn-hidden-size 1376]
    python bench/bench_fsdp2.py async [--params 1e9]

gather: 2 gloo ranks of `pretrain_gpt.py` (synthetic data, --bf16, FP8 hybrid delayed, 6 iterations of 2
micro-batches per rank) per engine: FSDP2 gathering in BF16, FSDP2 with --fp8-param-gather, DeepSpeed ZeRO-3
(every parameter partitioned). Prints, per engine, the all-gather bytes one rank moved in a steady-state step
(counted on the process group by tests/support/count_collectives.py, ring convention), per parameter, with the ratio
to FSDP2's BF16 gathers; and the mean time of iterations 3-6 from a second, uncounted run, with the ratio to
ZeRO-3's. A CPU time says nothing of a GPU's; the bytes are the same on any machine.

async: one process, the save path of --ckpt-format torch_dist on a state of --params FP32 parameters (as one
rank's shards): the time the loop is blocked by a synchronous save (write + fsync + commit) and by --async-save
(the snapshot), with their ratio, then the time until the background write is committed; for a first async save
(its host copies allocated) and a second one (copied into them, as every later save of a run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import REPO, free_port  # noqa: E402

ITERS = 6
ENGINES = {  # name: flags (besides the model's)
    "FSDP2, BF16 gathers": ["--use-torch-fsdp2"],
    "FSDP2, --fp8-param-gather": ["--use-torch-fsdp2", "--fp8-param-gather"],
    "DeepSpeed ZeRO-3": ["--deepspeed", "--zero-stage", "3"],
}


def _model_flags(a: argparse.Namespace) -> list[str]:
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--ffn-hidden-size",
            str(a.ffn_hidden_size), "--num-attention-heads", str(a.num_attention_heads), "--seq-length", "128",
            "--max-position-embeddings", "128", "--swiglu", "--normalization", "RMSNorm",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--mock-data", "--vocab-size", "8000", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(ITERS), "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--log-interval", "1", "--bf16", "--fp8-format", "hybrid", "--device", "cpu", "--seed", "1234"]


def _launch(script: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           *script]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(script[:3])}: failed\n{out.stderr[-3000:]}")
    return out


def _gathered_bytes(argv: list[str], folder: Path) -> float:
    counts = folder / "counts"
    _launch(["tests/support/count_collectives.py", str(counts), "--", *argv])
    last = json.loads((folder / "counts.rank0.json").read_text())[str(ITERS - 1)]
    return last.get("all-gather", [0, 0.0])[1]


def _step_ms(argv: list[str]) -> float:
    log = _launch(["pretrain_gpt.py", *argv]).stderr
    times = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)]
    return statistics.mean(times[2:])


def gather(a: argparse.Namespace) -> None:
    from megatron.arguments import parse_config
    from megatron.perf.flops import count_parameters, fp8_gathered_parameters

    with tempfile.TemporaryDirectory() as tmp:
        zero3 = Path(tmp) / "zero3.json"  # every parameter partitioned (DeepSpeed keeps < 1e5-element ones whole)
        zero3.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
        base = _model_flags(a)
        params = count_parameters(parse_config(base).model)
        fp8 = fp8_gathered_parameters(parse_config(base + ENGINES["FSDP2, --fp8-param-gather"], world_size=2))
        rows = {}
        for name, flags in ENGINES.items():
            argv = base + flags + (["--deepspeed_config", str(zero3)] if "--deepspeed" in flags else [])
            folder = Path(tmp) / re.sub(r"\W+", "_", name)
            folder.mkdir()
            rows[name] = (_gathered_bytes(argv, folder), _step_ms(argv))
    bf16, zero3_ms = rows["FSDP2, BF16 gathers"][0], rows["DeepSpeed ZeRO-3"][1]
    print(f"{params / 1e6:.1f}M parameters ({fp8 / params:.0%} of them in the FP8 linears, gathered as 1 byte under "
          f"--fp8-param-gather; the rest in BF16), 2 ranks, {ITERS} iterations of 2 micro-batches per rank")
    print(f"{'engine':28s} {'gathered B/param/step':>22s} {'vs BF16 gathers':>16s} {'step ms':>9s} {'vs ZeRO-3':>10s}")
    for name, (gathered, ms) in rows.items():
        print(f"{name:28s} {gathered / params:22.3f} {gathered / bf16:15.3f}x {ms:9.1f} {ms / zero3_ms:9.3f}x")


def async_save(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from megatron.checkpoint import dcp_io
    from megatron.checkpoint.dcp_async import AsyncSaver

    n = int(a.params)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    chunk = 64 << 20  # tensors of 64M elements, as a model's largest matrices
    state = {f"model/w{i}": torch.randn(min(chunk, n - i * chunk)) for i in range(-(-n // chunk))}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        began = time.perf_counter()
        dcp_io.save_sharded_checkpoint(tmp, 1, state, {}, {"iteration": 1}, {}, 0, None, None)
        sync = time.perf_counter() - began
        saver = AsyncSaver(0, None)
        timings = []
        for iteration in (2, 3):  # the first snapshot maps its host copies, the next ones copy into them
            began = time.perf_counter()
            saver.start(tmp, iteration, state, {}, {"iteration": iteration}, {})
            blocked = time.perf_counter() - began
            saver.poll(wait=True)
            timings.append((blocked, time.perf_counter() - began))
            for tensor in state.values():  # training changes the weights between saves
                tensor.add_(1.0)
    dist.destroy_process_group()
    where = a.dir or tempfile.gettempdir()
    print(f"{n / 1e9:.2f}B FP32 parameters ({n * 4 / 2**30:.1f} GiB), one rank, written under {where}")
    print(f"synchronous save: loop blocked {sync:.2f} s")
    for which, (blocked, committed) in zip(("first", "second"), timings):
        print(f"--async-save, {which} save: loop blocked {blocked:.2f} s ({blocked / sync:.3f}x), committed after "
              f"{committed:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["gather", "async"])
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--ffn-hidden-size", type=int, default=1376)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--params", type=float, default=1e9, help="async: FP32 parameters in the saved state")
    ap.add_argument("--dir", default=None, help="async: where to write (default: the temporary folder)")
    a = ap.parse_args()
    if a.what == "gather":
        gather(a)
    else:
        async_save(a)


if __name__ == "__main__":
    main()
