"""Benchmark: Fp8Linear vs a BF16 nn.Linear (and torchao float8 when installed), forward + backward.

Every variant runs on the same inputs, interleaved iteration by iteration (so a busy machine slows all of
them alike), on whatever device is present. Reported per shape: median milliseconds per forward+backward,
the ratio to BF16 (> 1 means slower than BF16), and the bytes each variant saves for backward.

Shapes: the four linears of a Llama2-7B layer (hidden 4096, FFN 11008; fc1 is w1|w2 = 22016 outputs) and a
small layer. 4096 tokens per micro-batch and the FP8 weight cast once per 8 micro-batches (one optimizer step
of gradient accumulation), as in training. On CPU the FP8 GEMMs are emulated (real FP8 casts, then an fp32
GEMM on the exact FP8 values, or a bf16 one with power-of-two scales). `--fused` times our layer with the
eager quantization, the compiled one (megatron/fp8/fused.py), or both side by side (default). torchao's
Float8Linear (emulated off CUDA) runs in the same loop as a peer.

    python bench/bench_fp8_linear.py --shapes 7b.proj,7b.fc2 --iters 3  # CPU, 7B shapes, ~10 minutes
    python bench/bench_fp8_linear.py --tokens 8192 --iters 20        # H100/H200
    python bench/bench_fp8_linear.py --recipe delayed,tensorwise,rowwise,blockwise,mxfp8 --no-torchao
    python bench/bench_fp8_linear.py --sqnr --recipe tensorwise,rowwise,blockwise,mxfp8
    python bench/bench_fp8_linear.py --smooth-swiglu --recipe tensorwise,rowwise,blockwise,mxfp8
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from megatron.fp8 import Fp8Linear, Fp8Recipe, Fp8Scaling, fp8_optimizer_step
from megatron.fp8.accuracy import fprop_operands, wgrad_layout_sqnr
from megatron.fp8.backends import select_backend
from megatron.fp8.stats import sqnr_db

SHAPES = {  # name: (in_features, out_features)
    "7b.qkv": (4096, 3 * 4096),
    "7b.proj": (4096, 4096),
    "7b.fc1": (4096, 2 * 11008),
    "7b.fc2": (11008, 4096),
    "small": (512, 2048),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of activations saved for backward (tensors sharing storage with a parameter are not counted)."""
    total = 0
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in param_storages:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return total


def _torchao_variant(linear: nn.Linear, emulate: bool) -> nn.Module | None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # not installed, or its kernels failed to load
        return None
    wrapper = nn.Sequential(linear)
    convert_to_float8_training(wrapper, config=Float8LinearConfig(emulate=emulate))
    return wrapper


def bench_shape(name: str, in_f: int, out_f: int, tokens: int, iters: int, warmup: int,
                device: torch.device, use_torchao: bool, micro_batches_per_step: int,
                recipes: tuple[str, ...] = ("delayed",), fused_modes: tuple[bool, ...] = (False,)) -> list[str]:
    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16)
    variants: dict[str, nn.Module] = {"bf16": base}
    fp8_layers = []
    # Two scale rules: arbitrary scales make the emulated backend run its GEMM in fp32 (one rounding of the
    # bf16 output); power-of-two scales let it use a bf16 GEMM, equally exact. The hardware backends run the
    # same kernel either way.
    configs = []
    for recipe in recipes:
        if recipe == "delayed":
            configs += [("fp8 (ours)", recipe, False), ("fp8 (ours, pow2 scales)", recipe, True)]
        else:
            configs.append((f"fp8 {recipe}", recipe, False))
    for label, recipe, pow2 in configs:
        for on in fused_modes:
            layer = Fp8Linear.from_linear(nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16),
                                          Fp8Recipe(scaling=recipe, power_of_two_scales=pow2))
            layer.fp8.configure(fused_quantization=on)
            variants[f"{label} fused" if on else label] = layer
            fp8_layers.append(layer)
    if use_torchao:
        ao = _torchao_variant(nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16),
                              emulate=device.type != "cuda")
        if ao is not None:
            variants["torchao tensorwise" + (" (emulate)" if device.type != "cuda" else "")] = ao
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)

    def step(module: nn.Module, i: int) -> None:
        module(x).backward(dy)
        if any(module is layer for layer in fp8_layers) and (i + 1) % micro_batches_per_step == 0:
            fp8_optimizer_step(module)  # new step: the FP8 weight is re-quantized

    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(warmup + iters):
        for label, module in variants.items():  # interleaved: load on the machine hits all variants alike
            _sync(device)
            start = time.perf_counter()
            step(module, i)
            _sync(device)
            if i >= warmup:
                times[label].append(time.perf_counter() - start)
            x.grad = None
            for p in module.parameters():
                p.grad = None
    ref = statistics.median(times["bf16"])
    rows = []
    for label, module in variants.items():
        t = statistics.median(times[label])
        saved = _saved_bytes(module, x) / 2**20
        rows.append(f"{name:8s} {in_f:>5d}x{out_f:<5d} {tokens:>5d}  {label:34s} {t * 1e3:10.1f} ms "
                    f"{t / ref:6.2f}x  saved {saved:7.1f} MiB")
    return rows


def sqnr_table(recipes: tuple[str, ...], tokens: int = 512, k: int = 4096, n: int = 1024) -> None:
    """SQNR (dB) of the forward GEMM per recipe at a Llama-like shape (K = hidden 4096), against float64:
    Gaussian x; heavy-tailed x (Student t, 3 degrees of freedom); x with 8 outlier channels along K at 1e4x
    and 1e5x, scored on the non-outlier channels' contribution x[:, rest] W[:, rest]^T; and the weight
    gradient dW = dy^T x with x from the saved second layout vs the requantized fprop layout (tiled.py)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    gaussian = torch.randn(tokens, k, generator=g)
    heavy = torch.distributions.StudentT(3.0).sample((tokens, k))
    channels = torch.randperm(k, generator=g)[:8]
    rest = torch.ones(k, dtype=torch.bool)
    rest[channels] = False
    dy = torch.randn(tokens, n, generator=g)
    print(f"x [{tokens}, {k}], W [{n}, {k}]; hybrid formats; SQNR in dB (higher is better)")
    print(f"{'recipe':11s} {'gaussian':>9s} {'t(3)':>7s} {'1e4 out.':>9s} {'1e5 out.':>9s} "
          f"{'dW 2nd layout':>14s} {'dW requant.':>12s}")
    for recipe in recipes:
        r = Fp8Recipe(scaling=recipe)
        row = []
        for x in (gaussian, heavy):
            xq, wq = fprop_operands(x, w, r)
            row.append(sqnr_db(xq.double() @ wq.double().t(), x.double() @ w.double().t()))
        for magnitude in (1e4, 1e5):
            x = gaussian.clone()
            x[:, channels] *= magnitude
            xq, wq = fprop_operands(x, w, r)
            row.append(sqnr_db(xq[:, rest].double() @ wq[:, rest].double().t(),
                               x[:, rest].double() @ w[:, rest].double().t()))
        layouts = wgrad_layout_sqnr(heavy, dy, r)
        row += [layouts["second_layout"], layouts["requantized"]]
        print(f"{recipe:11s} {row[0]:9.2f} {row[1]:7.2f} {row[2]:9.2f} {row[3]:9.2f} {row[4]:14.2f} {row[5]:12.2f}")


def smooth_swiglu_table(recipes: tuple[str, ...], ratios: tuple[float, ...] = (1e3, 1e4, 1e5)) -> None:
    """Smooth-SwiGLU x recipe: SQNR (dB) of each part of the SwiGLU MLP with one aligned outlier channel
    (megatron/model/swiglu_outliers.py: `fwd others` is fc2's output on the other channels, the part the
    outlier's scale damages), plain FP8 against the channel and token forms of Smooth-SwiGLU, per recipe."""
    from megatron.model import swiglu_outliers as so

    setup = so.OutlierSetup()
    print(f"outlier MLP hidden {setup.hidden}, ffn {setup.ffn}, {setup.tokens} tokens; hybrid; SQNR in dB")
    print(f"{'ratio':>6} {'recipe':<11} {'variant':<15}" + "".join(f"{p:>11}" for p in so.PARTS))
    for ratio in ratios:
        mlp, _, measured = so.outlier_mlp(setup, ratio)
        for recipe in recipes:
            for variant in (so.PLAIN, so.CHANNEL, so.TOKEN):
                parts = so.part_sqnr(mlp, measured, variant, Fp8Recipe(scaling=recipe))
                print(f"{ratio:>6.0e} {recipe:<11} {variant:<15}" + "".join(f"{parts[p]:>11.1f}" for p in so.PARTS),
                      flush=True)


def gemm_table(n: int, iters: int = 4) -> None:
    """bf16 vs fp32 GEMM of n x n x n, interleaved: what the emulated FP8 GEMM (fp32 on exact FP8 values) costs
    against BF16's own GEMM on this machine (docs/performance.md, "The emulated GEMM runs in fp32")."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    ab, bb = a.bfloat16(), b.bfloat16()
    cases = {"bf16 a @ b.T": lambda: ab @ bb.t(), "fp32 a @ b.T": lambda: a @ b.t()}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for f in cases.values():
        f()
    for _ in range(iters):
        for k, f in cases.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    for k, t in times.items():
        print(f"{n}^3 {k:14s} {statistics.median(t) * 1e3:9.1f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="7b.qkv,7b.proj,7b.fc1,7b.fc2,small",
                        help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per micro-batch (default 4096)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 GPU, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batches-per-step", type=int, default=8,
                        help="forward+backward passes per optimizer step (the FP8 weight is cast once per step)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao comparison")
    parser.add_argument("--fused", choices=["off", "on", "both"], default="both",
                        help="our FP8 quantization eager, compiled (megatron/fp8/fused.py), or both side by side")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--recipe", default="delayed",
                        help="comma-separated FP8 recipes timed side by side in one run: "
                             f"{','.join(s.value for s in Fp8Scaling)}")
    parser.add_argument("--sqnr", action="store_true",
                        help="print the SQNR table per recipe (docs/fp8.md, Fine-grained recipes) and exit")
    parser.add_argument("--gemm", type=int, default=0, metavar="N",
                        help="time a bf16 and an fp32 N x N x N GEMM side by side and exit")
    parser.add_argument("--smooth-swiglu", action="store_true",
                        help="print the Smooth-SwiGLU x recipe table (outlier MLP, per part) and exit")
    args = parser.parse_args(argv)
    recipes = tuple(args.recipe.split(","))
    for recipe in recipes:
        Fp8Scaling(recipe)  # an unknown name fails here, not after minutes of timing
    if args.sqnr:
        sqnr_table(recipes)
        return
    if args.smooth_swiglu:
        smooth_swiglu_table(recipes)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gemm:
        gemm_table(args.gemm)
        return
    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    tokens = args.tokens or 4096
    iters = args.iters or (3 if on_cpu else 20)
    backend = select_backend("auto", device).name
    print(f"device={device} fp8 backend={backend} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"tokens={tokens} iters={iters} micro_batches_per_step={args.micro_batches_per_step}")
    print(f"{'shape':8s} {'in x out':11s} {'tok':>5s}  {'variant':34s} {'fwd+bwd':>13s} {'vs bf16':>7s}")
    for name in args.shapes.split(","):
        in_f, out_f = SHAPES[name]
        for row in bench_shape(name, in_f, out_f, tokens, iters, args.warmup, device, not args.no_torchao,
                               args.micro_batches_per_step, recipes,
                               {"off": (False,), "on": (True,), "both": (False, True)}[args.fused]):
            print(row, flush=True)


if __name__ == "__main__":
    main()
