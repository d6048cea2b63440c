"""Projected speed on hardware we do not have: the step model of megatron/perf at Llama2-7B shapes, side by side.

Nothing runs at the real size: each variant's compiled block is read from inductor's scheduler on fake tensors
(megatron/perf/extract.py) and timed by the roofline of megatron/perf/kernels.py on the chosen device. Prints:

1. the 7B block stack (32 blocks, one micro-batch of 4096 tokens, forward + backward; the blocks only) per kernel
   class, BF16 vs our recipes (delayed + Smooth-SwiGLU, tensorwise, rowwise: its FP8 layers run eagerly inside the
   compiled block, counted op by op) vs torchao's Float8Linear (tensorwise), with the FP8 / BF16 speed-up;
2. the four linears of a 7B block (qkv, proj, fc1, fc2) at 8192 tokens, forward + backward, the same variants;
3. the largest FP8 overhead kernels of our delayed recipe's block: the list to work down on a GPU;
4. with `--calibrate`, the calibration table (megatron/perf/calibration.py): predicted next to observed.

With `--against block_stack.json` (bench/bench_block_stack.py's rows from a GPU, as scripts/gpu_check.sh writes
them) it prints instead each measured row next to the model's projection of the same stack (same flags, blocks,
tokens, optimizer step) on that GPU, with the residuals: each GPU run is a calibration row.

    python bench/project.py                      # H200
    python bench/project.py --device gaudi2 --calibrate --json out.json
    python bench/project.py --against OUT/block_stack.json --json OUT/model_vs_measured.json
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.arguments import parse_config  # noqa: E402
from megatron.perf import calibration  # noqa: E402
from megatron.perf.extract import extract_block, extract_linear  # noqa: E402
from megatron.perf.hardware import DEVICES, device  # noqa: E402
from megatron.perf.kernels import KernelClass, seconds_by_class  # noqa: E402

LAYERS = 32
VARIANTS = {"bf16": {}, "fp8-delayed": {"flags": calibration.DELAYED_SMOOTH},
            "fp8-tensorwise": {"flags": calibration.TENSORWISE}, "fp8-rowwise": {"flags": calibration.ROWWISE},
            "torchao": {"torchao": "tensorwise"}}
CLASSES = (KernelClass.GEMM, KernelClass.ATTENTION, KernelClass.QUANTIZATION, KernelClass.POINTWISE)


def block_table(dev_name: str, shape_flags: str) -> tuple[list[dict], list]:
    dev = device(dev_name)
    rows, delayed = [], []
    for name, v in VARIANTS.items():
        cfg = parse_config(f"{calibration.COMMON} {shape_flags} --global-batch-size 1 {v.get('flags', '')}".split())
        block = extract_block(cfg.model, cfg.fp8, 1, torchao=v.get("torchao"))
        by = seconds_by_class([k.times(LAYERS) for k in block.kernels], dev)
        rows.append({"variant": name, **{c.value: by[c] * 1e3 for c in CLASSES}, "total": sum(by.values()) * 1e3,
                     "kernels": len(block.kernels), "graphs": block.graphs, "extract_s": block.seconds})
        if name == "fp8-delayed":
            delayed = [k for k in block.kernels if k.kind is KernelClass.QUANTIZATION]
    for r in rows:
        r["speed-up"] = rows[0]["total"] / r["total"]
    return rows, sorted(delayed, key=lambda k: -k.seconds(dev))


def linear_table(dev_name: str) -> list[dict]:
    dev = device(dev_name)
    rows = []
    fp8 = {n: parse_config(f"{calibration.COMMON} {calibration.LLAMA2_7B} --global-batch-size 1 "
                           f"{v['flags']}".split()).fp8 for n, v in VARIANTS.items() if "flags" in v}
    for shape, (k, n) in calibration.LINEARS.items():
        row = {"shape": f"7b.{shape} {k}x{n}"}
        for name, v in VARIANTS.items():
            kernels = extract_linear(k, n, calibration.LINEAR_TOKENS, fp8.get(name), torchao=v.get("torchao")).kernels
            row[name] = sum(x.seconds(dev) for x in kernels) * 1e3
        rows.append(row)
    return rows


# GPU names as torch.cuda.get_device_name gives them -> megatron/perf/hardware.py's devices
GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"))


def device_of(gpu_name: str) -> str | None:
    return next((key for part, key in GPU_NAMES if part in gpu_name), None)


def against(measured: dict) -> list[dict]:
    """The model's projection of each measured block-stack row (bench/bench_block_stack.py's JSON) on its GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
    import bench_block_stack as stack
    from megatron.perf.step import project

    dev_name = device_of(measured["device"])
    if dev_name is None:
        raise SystemExit(f"bench/project.py --against: no model of {measured['device']!r} (megatron/perf/hardware.py "
                         f"has {', '.join(sorted(DEVICES))})")
    dev = device(dev_name)
    shape = stack.SHAPES[measured["shape"]]
    seq = int(shape.split("--seq-length ")[1].split()[0])
    mb = measured["tokens_per_step"] // seq
    flags = f"{stack.COMMON} {shape} --num-layers {measured['layers']} --micro-batch-size {mb} --global-batch-size {mb}"
    base = parse_config(flags.split())
    bf16_block = extract_block(base.model, None, mb)
    rows = [r for r in measured["rows"] if "median_step_s" in r]
    projected = {}
    for r in rows:
        name = r["variant"]
        if name == "torchao":
            p = project(base, dev, None, extract_block(base.model, None, mb, torchao="tensorwise"), devices=1)
        elif stack.VARIANTS[name]:
            cfg = parse_config(f"{flags} {stack.VARIANTS[name]}".split())
            p = project(cfg, dev, extract_block(cfg.model, cfg.fp8, mb), bf16_block, devices=1)
        else:
            p = project(base, dev, None, bf16_block, devices=1)
        projected[name] = p.step_seconds
    out = []
    for r in rows:
        name = r["variant"]
        row = {"variant": name, "measured_ms": r["median_step_s"] * 1e3, "projected_ms": projected[name] * 1e3}
        row["residual"] = row["projected_ms"] / row["measured_ms"] - 1
        if "bf16" in projected:
            row["measured_vs_bf16"] = r["vs_bf16"]
            row["projected_vs_bf16"] = projected[name] / projected["bf16"]
            row["ratio_residual"] = row["projected_vs_bf16"] / row["measured_vs_bf16"] - 1
        out.append(row)
    return out


def print_against(measured: dict, rows: list[dict]) -> None:
    print(f"== {measured['layers']} x {measured['shape']} blocks, {measured['tokens_per_step']} tokens/step, on "
          f"{measured['device']} (torch {measured.get('torch', '?')}): measured vs projected "
          f"({calibration.CALIBRATION_SUMMARY})")
    print("variant | measured ms | projected ms | residual | measured vs bf16 | projected vs bf16 | residual")
    for r in rows:
        ratio = (f"{r['measured_vs_bf16']:.2f}x | {r['projected_vs_bf16']:.2f}x | {100 * r['ratio_residual']:+.0f}%"
                 if "measured_vs_bf16" in r else "- | - | -")
        print(f"{r['variant']} | {r['measured_ms']:.1f} | {r['projected_ms']:.1f} | {100 * r['residual']:+.0f}% | "
              f"{ratio}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h200", choices=sorted(DEVICES))
    ap.add_argument("--calibrate", action="store_true", help="also the calibration table (about a minute more)")
    ap.add_argument("--against", metavar="BLOCK_STACK_JSON",
                    help="measured block-stack rows (bench/bench_block_stack.py --json) to put the model next to")
    ap.add_argument("--json", help="write every table here")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    start = time.perf_counter()
    if args.against:
        measured = json.loads(Path(args.against).read_text())
        rows = against(measured)
        print_against(measured, rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"measured": args.against, "rows": rows}, indent=2))
        return 0
    out: dict = {"device": args.device}
    print(f"== projected on one {args.device} (megatron/perf; {calibration.CALIBRATION_SUMMARY})")
    print(f"\n7B block stack: {LAYERS} blocks, 4096 tokens, forward + backward, ms per class")
    blocks, overhead = block_table(args.device, calibration.LLAMA2_7B)
    head = ["variant"] + [c.value for c in CLASSES] + ["total", "speed-up", "kernels"]
    print(" | ".join(head))
    for r in blocks:
        print(" | ".join([r["variant"]] + [f"{r[c.value]:.1f}" for c in CLASSES]
                         + [f"{r['total']:.1f}", f"{r['speed-up']:.2f}x", str(r["kernels"])]))
    print(f"\nper linear, {calibration.LINEAR_TOKENS} tokens, forward + backward, ms (speed-up vs BF16)")
    linears = linear_table(args.device)
    print(" | ".join(["shape"] + list(VARIANTS)))
    for r in linears:
        print(" | ".join([r["shape"]] + [f"{r[v]:.2f} ({r['bf16'] / r[v]:.2f}x)" for v in VARIANTS]))
    dev = device(args.device)
    print(f"\nlargest FP8 overhead kernels of one fp8-delayed block ({args.device}, us each)")
    for k in overhead[:10]:
        print(f"  {k.seconds(dev) * 1e6:8.1f}  {k.where:8s}  {k.bytes / 2**20:8.1f} MiB  {k.name}")
    out.update(blocks=blocks, linears=linears,
               overhead=[{"us": k.seconds(dev) * 1e6, "where": k.where, "bytes": k.bytes, "name": k.name}
                         for k in overhead])
    if args.calibrate:
        rows = calibration.calibration_rows(parse_config)
        print("\ncalibration: figure | observed | predicted | residual | source")
        for r in rows:
            print(f"  {r.figure} | {r.observed:.3g} | {r.predicted:.3g} | {100 * r.residual:+.0f}% | {r.source}")
        print(calibration.summary(rows))
        out["calibration"] = [r.__dict__ | {"residual": r.residual} for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
