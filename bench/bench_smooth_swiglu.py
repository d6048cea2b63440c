"""Benchmark: throughput cost of Smooth-SwiGLU (channel and token forms) over plain FP8.

Two measurements, each with all variants run on the same inputs and interleaved iteration by iteration
(so load on a shared machine hits every variant alike), reported as medians and as the median over rounds
of each round's time ratio to plain FP8:

1. MLP block forward + backward (`megatron.model.transformer.MLP`, fc1 and fc2 `Fp8Linear`, bf16 autocast),
   with an optimizer-step boundary (`fp8_optimizer_step`) every `--micro-batches` passes, so plain FP8
   reuses its cached FP8 weights across micro-batches while the channel form re-quantizes fc2's weight
   (W3 * s^-1) at every micro-batch: that cost is part of what is measured, and the fc2 weight casts per
   step are printed.
2. A tiny GPT training step (forward + backward of `--micro-batches` micro-batches, AdamW step,
   `fp8_optimizer_step`).

    python bench/bench_smooth_swiglu.py                                  # CPU defaults, ~1-2 minutes
    python bench/bench_smooth_swiglu.py --hidden 4096 --ffn 11008 --tokens 4096 --iters 20   # GPU, 7B MLP
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.config import LLAMA, ModelConfig, SmoothSwiGLUGranularity  # noqa: E402
from megatron.fp8 import Fp8Linear, Fp8Recipe, convert_to_fp8, fp8_optimizer_step  # noqa: E402
from megatron.fp8.backends import select_backend  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.model.transformer import MLP  # noqa: E402

VARIANTS: dict[str, Optional[SmoothSwiGLUGranularity]] = {
    "plain fp8": None, "smooth channel": SmoothSwiGLUGranularity.CHANNEL, "smooth token": SmoothSwiGLUGranularity.TOKEN}


def _config(layers: int, hidden: int, ffn: int, seq: int, smooth: Optional[SmoothSwiGLUGranularity]) -> ModelConfig:
    heads = max(hidden // 64, 1)
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                       ffn_hidden_size=ffn, seq_length=seq, max_position_embeddings=seq, padded_vocab_size=512,
                       kv_channels=hidden // heads, smooth_swiglu=smooth, **LLAMA)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(steps: dict[str, Callable[[int], None]], iters: int, warmup: int,
                 device: torch.device) -> dict[str, tuple[float, float]]:
    """{label: (median seconds per call, median over rounds of its time / the first label's time)}.

    Each round calls every step function once, in an order rotated every round (no variant always runs
    first). The per-round ratio compares variants run seconds apart, so slow drifts of the machine's load
    cancel; its median discards rounds hit by a burst.
    """
    labels = list(steps)
    times: dict[str, list[float]] = {k: [] for k in labels}
    for i in range(warmup + iters):
        for j in range(len(labels)):
            label = labels[(i + j) % len(labels)]
            _sync(device)
            start = time.perf_counter()
            steps[label](i)
            _sync(device)
            if i >= warmup:
                times[label].append(time.perf_counter() - start)
    base = times[labels[0]]
    return {k: (statistics.median(v), statistics.median(a / b for a, b in zip(v, base))) for k, v in times.items()}


def bench_mlp(hidden: int, ffn: int, tokens: int, micro_batches: int, iters: int, warmup: int,
              device: torch.device) -> list[str]:
    torch.manual_seed(0)
    recipe = Fp8Recipe()
    reference = MLP(_config(1, hidden, ffn, 32, None))
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    mlps = {}
    for label, smooth in VARIANTS.items():
        mlp = MLP(_config(1, hidden, ffn, 32, smooth))
        mlp.load_state_dict(reference.state_dict())
        mlp.linear_fc1 = Fp8Linear.from_linear(mlp.linear_fc1, recipe)
        mlp.linear_fc2 = Fp8Linear.from_linear(mlp.linear_fc2, recipe)
        mlps[label] = mlp.to(device)

    def make_step(mlp: MLP) -> Callable[[int], None]:
        def step(i: int) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                mlp(x).backward(dy)
            x.grad = None
            if (i + 1) % micro_batches == 0:
                mlp.zero_grad(set_to_none=True)
                fp8_optimizer_step(mlp)  # step boundary: cached FP8 weights are dropped
        return step

    for mlp in mlps.values():
        mlp.linear_fc2.fp8.weight_quantizations = 0
    rounds = warmup + iters
    results = _interleaved({k: make_step(m) for k, m in mlps.items()}, iters, warmup, device)
    rows = []
    for label, (t, ratio) in results.items():
        casts = mlps[label].linear_fc2.fp8.weight_quantizations * micro_batches / rounds
        rows.append(f"mlp  {hidden}x{ffn} tok={tokens:<5d} {label:15s} {t * 1e3:9.1f} ms/micro-batch "
                    f"{ratio:6.3f}x   fc2 weight casts/step {casts:.1f}")
    return rows


def bench_gpt_step(layers: int, hidden: int, ffn: int, seq: int, micro_batch: int, micro_batches: int,
                   iters: int, warmup: int, device: torch.device) -> list[str]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (micro_batches, micro_batch, seq), device=device)
    models, optimizers = {}, {}
    for label, smooth in VARIANTS.items():
        torch.manual_seed(1)
        model = GPTModel(_config(layers, hidden, ffn, seq, smooth)).to(device)
        convert_to_fp8(model, Fp8Recipe())
        models[label] = model
        optimizers[label] = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_step(label: str) -> Callable[[int], None]:
        model, opt = models[label], optimizers[label]

        def step(_: int) -> None:
            opt.zero_grad(set_to_none=True)
            for mb in tokens:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(mb, labels=mb).mean()
                loss.backward()
            opt.step()
            fp8_optimizer_step(model)
        return step

    results = _interleaved({k: make_step(k) for k in VARIANTS}, iters, warmup, device)
    return [f"gpt  L{layers} h{hidden} ffn{ffn} {micro_batches}x{micro_batch}x{seq} {label:15s} "
            f"{t * 1e3:9.1f} ms/step {ratio:6.3f}x" for label, (t, ratio) in results.items()]


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--tokens", type=int, default=512, help="tokens per micro-batch of the MLP bench")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--iters", type=int, default=None, help="timed rounds (default 15 on CPU, 30 on GPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpt-layers", type=int, default=2)
    p.add_argument("--gpt-hidden", type=int, default=256)
    p.add_argument("--gpt-ffn", type=int, default=704)
    p.add_argument("--gpt-seq", type=int, default=64)
    p.add_argument("--gpt-micro-batch", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    iters = a.iters or (15 if device.type == "cpu" else 30)
    print(f"device={device} fp8 backend={select_backend('auto', device).name} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} iters={iters} micro_batches/step={a.micro_batches}")
    for row in bench_mlp(a.hidden, a.ffn, a.tokens, a.micro_batches, iters * a.micro_batches,
                         a.warmup * a.micro_batches, device):
        print(row, flush=True)
    for row in bench_gpt_step(a.gpt_layers, a.gpt_hidden, a.gpt_ffn, a.gpt_seq, a.gpt_micro_batch,
                              a.micro_batches, iters, a.warmup, device):
        print(row, flush=True)


if __name__ == "__main__":
    main()
