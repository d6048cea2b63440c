"""Command-line flags (Megatron-DeepSpeed names and defaults) and their resolution into a typed config.

`build_parser()` groups the flags as Megatron does. `parse_config(argv)` is the only code in the
project that reads the argparse Namespace: it validates the flags (errors name the flag and the
fix), computes derived values once, and returns a frozen `MegatronConfig`. Flags that parse but are
not implemented yet are rejected with a clear "not supported yet" error, never silently ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron.config import (
    CheckpointConfig, DataConfig, DivergenceConfig, Fp8AutohealConfig, LoggingConfig, LrDecayStyle, MegatronConfig,
    ModelConfig, Normalization, OptimizerConfig, ParallelConfig, PositionEmbedding, RecomputeGranularity,
    SchedulerConfig, SmoothSwiGLUGranularity, TrainingConfig,
)
from megatron.compat import (
    CompatConfig, add_compat_arguments, env_recipe_flags, normalization_type, optimizer_type,
    parse_collecting_problems, resolve_compat,
)
from megatron.fp8.recipe import (AUTOHEAL_ACTIONS, DEFAULT_FAST_ACCUM, AmaxComputeAlgo, Fp8Backend, Fp8Format,
                                 Fp8Recipe, Fp8Scaling)
from megatron.model.compile import check_torch_compile_supported
from megatron.parallel_state import world_size_from_env

_AUTOHEAL = Fp8AutohealConfig()  # the controller flags' defaults (--fp8-autoheal-*), defined once in the config
_AUTOHEAL_TUNABLES = ("clip_threshold", "flush_threshold", "patience", "max_margin", "undo_after")
DEFAULT_VOCAB_DIVISOR = 128  # --make-vocab-size-divisible-by's default (Megatron's)


REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size", "--lr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False,
                                usage="%(prog)s FLAGS  (required: " + " ".join(REQUIRED)
                                      + " and --train-iters or --train-samples; flags by group below)",
                                description="Megatron-FP8 GPT pretraining. Flags keep Megatron-DeepSpeed's names "
                                            "and defaults; README.md has a first run.")

    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden, or int(8*hidden/3 / 64)*64 with --swiglu (Megatron's rule)")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-key-value-heads", "--num-query-groups", dest="num_key_value_heads", type=int, default=None,
                   help="grouped-query attention; default = --num-attention-heads (multi-head)")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim; default hidden/heads")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="same as --position-embedding-type rope")
    g.add_argument("--rotary-position-embeddings-theta", "--rope-theta", "--rotary-base", dest="rotary_base",
                   type=float, default=10000.0)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="pad the vocabulary to a multiple of this x --tensor-model-parallel-size (default 128; with "
                        "--load, the checkpoint's padded vocabulary is kept)")
    g.add_argument("--normalization", type=normalization_type, choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="also the upstream lowercase spellings layernorm, rmsnorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")

    g = p.add_argument_group("regularization and optimizer")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--optimizer", type=optimizer_type, choices=["adam", "fp8adam"], default="adam",
                   help="adam = AdamW (decoupled weight decay, as Megatron; upstream adamw and fusedadamw are "
                        "accepted for it); fp8adam = moments stored in FP8")
    g.add_argument("--fp8-optimizer", action="store_true", help="same as --optimizer fp8adam")
    g.add_argument("--fp8-optimizer-m-dtype", choices=["e4m3", "e5m2", "bf16", "fp32"], default="e4m3")
    g.add_argument("--fp8-optimizer-v-dtype", choices=["e4m3", "e5m2", "bf16", "fp32"], default="e5m2")
    g.add_argument("--fp8-optimizer-block-size", type=int, default=0, help="0 = one scale per tensor")
    g.add_argument("--fp8-optimizer-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="run Fp8AdamW's update through torch.compile (default; eager with a warning where compiling "
                        "fails); --no-fp8-optimizer-compile keeps it eager")
    g.add_argument("--fp8-optimizer-stochastic-rounding", action=argparse.BooleanOptionalAction, default=True,
                   help="requantize Adam's v with stochastic rounding (default; unbiased, see docs/fp8_adam.md)")

    g = p.add_argument_group("batch, schedule and training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true", help="on SIGTERM save a checkpoint and exit")
    g.add_argument("--exit-on-stall-seconds", type=float, default=None, metavar="S",
                   help="end the process (one line, exit code 4, every thread's stack in a file it names) when no "
                        "iteration has finished for S seconds: a stuck filesystem or data worker, a hang outside "
                        "the collectives; torchrun --max-restarts then restarts the job. Default: off")
    g.add_argument("--max-consecutive-nan-steps", type=int, default=10)
    g.add_argument("--divergence-guard", action=argparse.BooleanOptionalAction, default=True,
                   help="stop a run that explodes without a NaN, before it saves (docs/reliability.md)")
    g.add_argument("--divergence-loss-factor", type=float, default=2.5,
                   help="the loss must stay above this x its running median for --divergence-patience iterations")
    g.add_argument("--divergence-patience", type=int, default=20)
    g.add_argument("--divergence-window", type=int, default=100, help="iterations in the loss's running median")
    g.add_argument("--divergence-zero-grad-iters", type=int, default=10,
                   help="consecutive iterations with a gradient norm of exactly 0")
    g.add_argument("--divergence-max-weight", type=float, default=1e4, help="largest |weight| allowed")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-activations", action="store_true", help="same as --recompute-granularity selective")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, parameter count, FLOPs and memory estimate, then exit")
    g.add_argument("--project-on", default=None, metavar="DEVICE[,DEVICE]",
                   help="with --dry-run: also the projected step time, tokens/s, MFU and time to --train-iters of "
                        "this run and of the same run in BF16 on these devices (h100, h200, b200, gaudi2, gaudi3; "
                        "megatron/perf, docs/performance.md)")
    g.add_argument("--project-devices", type=int, default=None, metavar="N",
                   help="with --project-on: project on N devices (default: the world size this run resolves to)")
    g.add_argument("--torch-compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile each transformer block (FP8 layers traced into it) and the FP8 quantization; "
                        "auto = both on CUDA (blocks eager with PP or ZeRO-3), on CPU the FP8 quantization only for "
                        "runs of >= 100 iterations, nothing on Gaudi (docs/performance.md)")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="BF16 autocast with FP32 master weights")
    g.add_argument("--params-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the weights on the device (with --bf16). fp32: the weights are the master weights. "
                        "bf16: Megatron's layout (upstream --bf16): BF16 weights, FP32 main gradients, the FP32 master "
                        "copy kept with the optimizer state and sharded with it by ZeRO (docs/fp8_adam.md, Memory)")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--device", choices=["auto", "cpu", "cuda", "hpu"], default="auto")

    g = p.add_argument_group("fp8")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None, help="turns FP8 linears on")
    g.add_argument("--fp8-hybrid", action="store_true", help="legacy alias of --fp8-format hybrid")
    g.add_argument("--fp8-e4m3", action="store_true", help="legacy alias of --fp8-format e4m3")
    g.add_argument("--fp8-recipe", choices=[s.value for s in Fp8Scaling], default="delayed",
                   help="delayed / tensorwise: one scale per tensor; rowwise, blockwise (1x128 activations, 128x128 "
                        "weights), mxfp8 (1x32, power-of-two scales): current scales per tile (docs/fp8.md)")
    g.add_argument("--fp8-margin", type=int, default=0)
    g.add_argument("--fp8-amax-history-len", type=int, default=1)
    g.add_argument("--fp8-amax-compute-algo", choices=["max", "most_recent"], default="most_recent")
    g.add_argument("--no-fp8-wgrad", action="store_true", help="run the weight-gradient GEMM in high precision")
    g.add_argument("--fp8-power-of-two-scales", action="store_true")
    g.add_argument("--fp8-backend", choices=["auto", "scaled_mm", "cuda", "hpu", "emulated"], default="auto",
                   help="scaled_mm (alias cuda): torch._scaled_mm, on sm89+ GPUs and on the CPU")
    g.add_argument("--fp8-first-last-layers-bf16", type=int, default=0, help="keep N blocks at each end in BF16")
    g.add_argument("--fp8-mlp-fc2-bf16", action="store_true", help="keep only the fc2 GEMM in BF16 (ablation)")
    g.add_argument("--fp8-grad-stochastic-rounding", action="store_true")
    g.add_argument("--fp8-fast-accum", default=None, metavar="GEMMS",
                   help="GEMMs whose FP8 kernel accumulates in the tensor cores' fast, less precise accumulator "
                        "(torch._scaled_mm use_fast_accum): comma-separated fprop, dgrad, wgrad, or none, all "
                        "(default: fprop, as Transformer Engine and torchao). The emulation and Gaudi accumulate in "
                        "FP32 either way")
    g.add_argument("--log-fp8-stats", action="store_true", help="per-layer FP8 amax/clipping statistics")
    g.add_argument("--fp8-autoheal", action="store_true",
                   help="at log iterations, repair the scaling of an FP8 tensor that keeps clipping: more margin, "
                        "then current scaling, Smooth-SwiGLU for fc2, BF16 (docs/stability.md)")
    g.add_argument("--fp8-autoheal-actions", default=None,
                   help="comma-separated rungs the controller may climb, in order: margin,current,smooth,bf16 "
                        "(default: those that apply to the recipe and model)")
    g.add_argument("--fp8-autoheal-clip-threshold", type=float, default=_AUTOHEAL.clip_threshold,
                   help="clipped fraction of a tensor's values that counts against it")
    g.add_argument("--fp8-autoheal-flush-threshold", type=float, default=_AUTOHEAL.flush_threshold,
                   help="fraction of a current-scaled tensor's nonzero values flushed to 0 that counts against it")
    g.add_argument("--fp8-autoheal-patience", type=int, default=_AUTOHEAL.patience,
                   help="consecutive log iterations over the threshold before acting")
    g.add_argument("--fp8-autoheal-max-margin", type=int, default=_AUTOHEAL.max_margin,
                   help="the most extra margin (powers of two) one tensor may get")
    g.add_argument("--fp8-autoheal-undo-after", type=int, default=_AUTOHEAL.undo_after,
                   help="clean log iterations after which an extra margin is lowered by one (0: never)")
    g.add_argument("--smooth-swiglu", action="store_true",
                   help="scale the SwiGLU output per channel/token before its FP8 quantization (needs --swiglu, FP8)")
    g.add_argument("--smooth-swiglu-granularity", choices=["channel", "token"], default="channel",
                   help="channel: the paper's per-channel scales; token: the reference code's per-token scales")
    g.add_argument("--no-swiglu-diagnostics", action="store_true",
                   help="turn off the per-layer SwiGLU outlier and w1/w2 alignment diagnostics")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; reset iteration and optimizer")
    g.add_argument("--exit-on-save-failure", type=int, default=3, metavar="N",
                   help="a checkpoint that cannot be written at a --save-interval is logged and training goes on "
                        "(the previous one stays the newest); N failed saves in a row end the run (default 3)")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None, metavar="K",
                   help="after each complete save, remove all but the K newest checkpoints of --save (never the "
                        "newest healthy one); default: keep all")
    g.add_argument("--no-checkpoint-fallback", action="store_true",
                   help="a resume whose newest checkpoint fails its manifest check (a file missing, truncated or "
                        "with a wrong CRC-32) stops with an error instead of loading the next older intact one")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="write batch-size/batch-size (and its vs samples / vs tokens twins)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write iteration-time/iteration-time (seconds, and its twins)")

    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None, help="PREFIX or WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ...")
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--data-args-path", type=str, default=None,
                   help="a file holding what --data-path would (W1 P1 W2 P2 ... or P1 P2 ...), for long blends")
    g.add_argument("--per-split-data-args-path", type=str, default=None,
                   help='a JSON file {"train": [...], "valid": [...], "test": [...]} of per-split data paths')
    g.add_argument("--data-cache-shared", action="store_true",
                   help="the index cache is on a filesystem every node sees: rank 0 alone builds the indices "
                        "(default: local rank 0 of each node)")
    g.add_argument("--mock-data", action="store_true", help="synthetic learnable tokens (needs --vocab-size)")
    g.add_argument("--tokenizer-type", type=str, default=None,
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HFTokenizer",
                            "GPT2BPETokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (Megatron's default is 2)")

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo", "hccl"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long a collective waits for a hung rank before the run fails")

    g = p.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", action="store_true")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", type=str, default=None)
    g.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage 0-3 (default 0, or the JSON's)")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="passed by the deepspeed launcher; must agree with the LOCAL_RANK environment variable, "
                        "which is what is used")
    add_compat_arguments(p)
    for action in p._actions:  # every flag with its default (argparse shows one only where the help asks for it)
        if not action.option_strings or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            continue
        if action.help is None:
            action.help = "default: %(default)s"
        elif "%(default)" not in action.help:
            action.help += " (default: %(default)s)"
    return p


def _require(value, flag: str, hint: str = "") -> None:
    if value is None:
        raise ValueError(f"{flag} is required{': ' + hint if hint else ''}")


def _json_zero_stage(path: Optional[str]) -> Optional[int]:
    """The ZeRO stage a DeepSpeed run's JSON gives when --zero-stage does not (None: neither gives one, DeepSpeed's
    default 0 applies). Resolved here so that every later decision (torch.compile, the memory estimate, the
    parse-time refusals) sees a stage given in the JSON as one given by the flag; deepspeed_config.py validates the
    JSON in full."""
    if path is None:
        return None
    from megatron.training.deepspeed_config import load_json

    zero = load_json(path).get("zero_optimization", {})
    if not isinstance(zero, dict) or "stage" not in zero:
        return None
    try:
        return int(zero["stage"])
    except (TypeError, ValueError):
        raise ValueError(f"--deepspeed_config {path}: `zero_optimization.stage` is {zero['stage']!r}; "
                         "use 0, 1, 2 or 3") from None


def _project_on(a: argparse.Namespace) -> tuple[str, ...]:
    """--project-on's devices, checked; --project-on/--project-devices only with --dry-run."""
    if a.project_devices is not None and a.project_on is None:
        raise ValueError("--project-devices needs --project-on DEVICE (and --dry-run)")
    if a.project_on is None:
        return ()
    if not a.dry_run:
        raise ValueError("--project-on only applies with --dry-run: add --dry-run (nothing is trained)")
    if a.project_devices is not None and a.project_devices < 1:
        raise ValueError(f"--project-devices must be >= 1, got {a.project_devices}")
    from megatron.perf.hardware import device

    return tuple(device(name).name for name in a.project_on.split(",") if name.strip())


def _not_supported_yet(a: argparse.Namespace) -> None:
    if not a.deepspeed and (a.deepspeed_config is not None or a.zero_stage is not None):
        raise ValueError("--deepspeed_config and --zero-stage need --deepspeed; add it, or drop them for torch DDP")
    if a.zero_stage is not None and a.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {a.zero_stage}")
    if a.deepspeed and a.zero_stage is None:
        a.zero_stage = _json_zero_stage(a.deepspeed_config)
    if a.deepspeed and a.no_save_optim:
        raise ValueError("--no-save-optim is not supported with --deepspeed: DeepSpeed checkpoints always carry "
                         "the (partitioned) optimizer state; drop the flag")
    if a.exit_on_save_failure < 1:
        raise ValueError(f"--exit-on-save-failure must be at least 1 (the failed saves in a row that end the run), got "
                         f"{a.exit_on_save_failure}")
    if a.exit_on_stall_seconds is not None and not a.exit_on_stall_seconds > 0:
        raise ValueError(f"--exit-on-stall-seconds must be > 0 (the seconds without a finished iteration that end the "
                         f"process), got {a.exit_on_stall_seconds}; leave it out to turn the check off")
    if a.keep_last_n_checkpoints is not None and (a.keep_last_n_checkpoints < 1 or not a.save):
        raise ValueError(f"--keep-last-n-checkpoints {a.keep_last_n_checkpoints} needs --save and a count of at least "
                         "1 (the checkpoints it keeps); leave it out to keep every checkpoint")
    env_local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.local_rank is not None and a.local_rank != env_local_rank:
        raise ValueError(f"--local_rank {a.local_rank} disagrees with the environment's LOCAL_RANK={env_local_rank}, "
                         "which decides the device: launch with torchrun or deepspeed, which set both")
    if a.fp16:
        raise ValueError("--fp16 is not supported: use --bf16 (BF16 autocast with FP32 master weights). "
                         "On CPU, FP16 compute is also about 1000x slower than BF16.")
    _main_params_checks(a)


def _main_params_checks(a: argparse.Namespace) -> None:
    """--params-dtype bf16 (Megatron's layout): where it is implemented, and what it needs."""
    if a.params_dtype == "fp32":
        return
    stage = a.zero_stage  # None: the DeepSpeed JSON decides (deepspeed_config.py checks it there)
    unsupported = (
        (not a.bf16, "needs --bf16 (BF16 compute; the weights themselves become BF16)"),
        (a.pipeline_model_parallel_size > 1, "is not supported yet with --pipeline-model-parallel-size > 1"),
        (a.deepspeed and stage == 0,
         "under --deepspeed needs --zero-stage 1, 2 or 3 (got 0): DeepSpeed 0.19 accumulates BF16 weights' "
         "gradients in BF16 without ZeRO (FP32 accumulation is what this layout keeps); without --deepspeed the "
         "torch engine implements it at any data-parallel size"),
        (not a.deepspeed and a.sequence_parallel and a.tensor_model_parallel_size > 1,
         "is not supported yet with --sequence-parallel under the torch engine (use --deepspeed --zero-stage 1)"),
    )
    for bad, why in unsupported:
        if bad:
            raise ValueError(f"--params-dtype bf16 {why}")


def _parallel_size(flag: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    return value


def _pipeline_parallel_checks(a: argparse.Namespace, model: ModelConfig) -> None:
    pp = _parallel_size("--pipeline-model-parallel-size", a.pipeline_model_parallel_size)
    if pp == 1:
        return
    unsupported = (
        (not a.deepspeed, "needs --deepspeed (the stages run under DeepSpeed's PipelineEngine)"),
        (a.zero_stage not in (None, 0, 1), f"needs --zero-stage 0 or 1 (got {a.zero_stage}): DeepSpeed's pipeline "
                                           "engine refuses ZeRO 2/3"),
        (not model.untie_embeddings_and_output_weights,
         "needs --untie-embeddings-and-output-weights: a tied embedding would live on the first and the last stage"),
        (a.reset_position_ids or a.reset_attention_mask,
         "with --reset-position-ids / --reset-attention-mask is not supported yet (stages exchange hidden states only)"),
        (model.recompute_granularity is RecomputeGranularity.FULL and model.recompute_method != "uniform",
         "with --recompute-granularity full needs --recompute-method uniform (DeepSpeed checkpoints every "
         "--recompute-num-layers layers of a stage)"),
        (model.num_layers % pp != 0, f"needs --num-layers ({model.num_layers}) divisible by it: each stage gets "
                                     "the same number of transformer layers"),
    )
    for bad, why in unsupported:
        if bad:
            raise ValueError(f"--pipeline-model-parallel-size {pp} {why}")


def _tensor_parallel_checks(a: argparse.Namespace, model: ModelConfig) -> None:
    tp = _parallel_size("--tensor-model-parallel-size", a.tensor_model_parallel_size)
    if tp == 1:
        return
    for flag, value in (("--num-attention-heads", model.num_attention_heads),
                        ("--num-key-value-heads", model.num_key_value_heads),
                        ("--ffn-hidden-size", model.ffn_hidden_size)):
        if value % tp:
            raise ValueError(f"{flag} {value} must be divisible by --tensor-model-parallel-size {tp}: "
                             "each tensor-parallel rank holds whole heads / FFN channels")
    if a.sequence_parallel and model.seq_length % tp:
        raise ValueError(f"--sequence-parallel needs --seq-length ({model.seq_length}) divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if model.add_bias_linear:
        raise ValueError("--tensor-model-parallel-size > 1 needs --disable-bias-linear: biases of row-parallel "
                         "linears are not supported yet")


def _model_config(a: argparse.Namespace, padded_vocab: int) -> ModelConfig:
    for flag, value in (("--num-layers", a.num_layers), ("--hidden-size", a.hidden_size),
                        ("--num-attention-heads", a.num_attention_heads), ("--seq-length", a.seq_length)):
        _require(value, flag)
    if a.hidden_size % a.num_attention_heads:
        raise ValueError(f"--hidden-size {a.hidden_size} must be divisible by --num-attention-heads {a.num_attention_heads}")
    kv_heads = a.num_key_value_heads or a.num_attention_heads
    if a.num_attention_heads % kv_heads:
        raise ValueError(f"--num-attention-heads {a.num_attention_heads} must be divisible by "
                         f"--num-key-value-heads {kv_heads}")
    ffn = a.ffn_hidden_size
    if ffn is None:
        ffn = int(4 * a.hidden_size * 2 / 3 / 64) * 64 if a.swiglu else 4 * a.hidden_size
    max_pos = a.max_position_embeddings or a.seq_length
    if a.seq_length > max_pos:
        raise ValueError(f"--seq-length {a.seq_length} exceeds --max-position-embeddings {max_pos}")
    granularity = a.recompute_granularity or ("selective" if a.recompute_activations else None) or (
        "full" if a.deepspeed_activation_checkpointing else None)  # upstream: DeepSpeed's checkpointing = ours
    if a.recompute_num_layers < 1:
        raise ValueError("--recompute-num-layers must be >= 1")
    pos = "rope" if a.use_rotary_position_embeddings else a.position_embedding_type
    smooth = None
    if a.smooth_swiglu:
        if not a.swiglu:
            raise ValueError("--smooth-swiglu needs --swiglu (it rescales the SwiGLU product)")
        if not (a.fp8_format or a.fp8_hybrid or a.fp8_e4m3):
            raise ValueError("--smooth-swiglu only matters for FP8 training: add --fp8-format hybrid (or e4m3)")
        smooth = SmoothSwiGLUGranularity(a.smooth_swiglu_granularity)
    return ModelConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=kv_heads, ffn_hidden_size=ffn, seq_length=a.seq_length, max_position_embeddings=max_pos,
        padded_vocab_size=padded_vocab, kv_channels=a.kv_channels or a.hidden_size // a.num_attention_heads,
        normalization=Normalization(a.normalization), norm_epsilon=a.norm_epsilon, swiglu=a.swiglu,
        untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
        add_bias_linear=not a.disable_bias_linear, position_embedding_type=PositionEmbedding(pos),
        rotary_base=a.rotary_base, hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
        init_method_std=a.init_method_std,
        recompute_granularity=RecomputeGranularity(granularity) if granularity else None,
        recompute_method=a.recompute_method, recompute_num_layers=a.recompute_num_layers, smooth_swiglu=smooth,
    )


def _data_config(a: argparse.Namespace) -> DataConfig:
    from megatron.data.data_args import resolve_data_paths  # reads --data-args-path / --per-split-data-args-path

    paths = resolve_data_paths(a.data_path, a.train_data_path, a.valid_data_path, a.test_data_path,
                               a.data_args_path, a.per_split_data_args_path)
    has_paths = bool(paths.data_path or paths.train_data_path)
    if a.mock_data and has_paths:
        raise ValueError("--mock-data and --data-path/--train-data-path are exclusive: pick one")
    if not a.mock_data and not has_paths:
        raise ValueError("no data: pass --data-path PREFIX (or --train-data-path ...), or --mock-data for a synthetic run")
    if a.mock_data:
        _require(a.vocab_size, "--vocab-size", "--mock-data draws tokens from [0, --vocab-size)")
    elif a.tokenizer_type is None:
        raise ValueError("--tokenizer-type is required with --data-path (e.g. SentencePieceTokenizer, HFTokenizer)")
    return DataConfig(
        data_path=paths.data_path, split=a.split, train_data_path=paths.train_data_path,
        valid_data_path=paths.valid_data_path, test_data_path=paths.test_data_path,
        data_cache_path=a.data_cache_path, data_cache_shared=a.data_cache_shared, mock_data=a.mock_data,
        tokenizer_type=a.tokenizer_type,
        tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file, merge_file=a.merge_file, vocab_size=a.vocab_size,
        make_vocab_size_divisible_by=a.make_vocab_size_divisible_by or DEFAULT_VOCAB_DIVISOR,
        eod_mask_loss=a.eod_mask_loss,
        reset_position_ids=a.reset_position_ids, reset_attention_mask=a.reset_attention_mask,
        num_workers=a.num_workers,
    )


def _padded_vocab_size(a: argparse.Namespace, data: DataConfig) -> tuple[int, Optional[str]]:
    """(the padded vocabulary, a note for the log or None). Without an explicit `--make-vocab-size-divisible-by`, a
    run resuming from `--load` keeps the checkpoint's padded vocabulary (its padding rows take part in the
    softmax) when this run's tensor-parallel size divides it: a TP=2 checkpoint resumes at TP=1 unchanged."""
    if data.mock_data:
        vocab = data.vocab_size
    else:
        from megatron.tokenizer import build_tokenizer

        vocab = build_tokenizer(data).vocab_size
    from megatron.tokenizer import pad_vocab_size

    tp = a.tensor_model_parallel_size
    padded = pad_vocab_size(vocab, a.make_vocab_size_divisible_by or DEFAULT_VOCAB_DIVISOR, tp)
    saved = _saved_padded_vocab(a.load) if a.load and a.make_vocab_size_divisible_by is None else None
    if saved is None or saved == padded or saved < vocab or saved % tp:
        return padded, None  # a checkpoint this run cannot keep: the loader names the flag that would
    return saved, (f"--load {a.load}: keeping the checkpoint's padded vocabulary of {saved} rows (--make-vocab-size-"
                   f"divisible-by {DEFAULT_VOCAB_DIVISOR} x --tensor-model-parallel-size {tp} would pad {vocab} to "
                   f"{padded}); pass --make-vocab-size-divisible-by to choose")


def _check_writable(flag: str, path: Optional[str]) -> None:
    """A folder the run will write into must be writable now, not hours later at the first save: the folder itself,
    or the nearest existing folder above it (where it will be created). No file is written to find out."""
    if not path:
        return
    target = Path(path).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder: pass a folder")
    existing = target
    while not existing.exists():
        existing = existing.parent
    read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY) if existing.is_dir() else False
    if not existing.is_dir() or read_only or not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == target else f" (it would be created in {existing})"
        raise ValueError(f"{flag} {path}: cannot write there{where}: a read-only file system or no permission; "
                         "pass a folder this user can write")


def _saved_padded_vocab(load: str) -> Optional[int]:
    """The padded vocabulary recorded in the config.json of `load`'s newest checkpoint; None when there is none to
    read (a fresh run, another writer): the loader reports what is wrong with the folder itself."""
    from megatron.checkpoint import store

    try:  # read only (every rank parses the flags): the tracker's iteration, that folder's config.json
        iteration = int((Path(load) / store.TRACKER_FILE).read_text().strip())
        config = store.read_json(store.iteration_dir(load, iteration) / "config.json")
        return int(config["model"]["padded_vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fp8_autoheal(a: argparse.Namespace) -> Fp8AutohealConfig:
    tuned = {"--fp8-autoheal-actions": a.fp8_autoheal_actions is not None,
             **{"--fp8-autoheal-" + f.replace("_", "-"): getattr(a, "fp8_autoheal_" + f) != getattr(_AUTOHEAL, f)
                for f in _AUTOHEAL_TUNABLES}}
    unused = [flag for flag, given in tuned.items() if given and not a.fp8_autoheal]
    if unused:
        raise ValueError(f"{', '.join(unused)} only apply with --fp8-autoheal: add it or drop them")
    if not a.fp8_autoheal:
        return Fp8AutohealConfig()
    # The rungs that make sense here: current scaling only under delayed scaling (tensorwise is current already);
    # Smooth-SwiGLU only for an FP8 fc2 behind a SwiGLU that is not smoothed already.
    why_not = {"current": a.fp8_recipe != "delayed" and f"--fp8-recipe {a.fp8_recipe} scales every tensor by its "
                                                        "own amax already",
               "smooth": (not a.swiglu and "the model has no --swiglu")
               or (a.smooth_swiglu and "--smooth-swiglu is on for every layer already")
               or (a.fp8_mlp_fc2_bf16 and "--fp8-mlp-fc2-bf16 keeps every fc2 in BF16")}
    if a.fp8_autoheal_actions is None:
        actions = tuple(x for x in AUTOHEAL_ACTIONS if not why_not.get(x))
    else:
        actions = tuple(x for x in a.fp8_autoheal_actions.split(",") if x)
        refused = [f"{x} ({why_not[x]})" for x in actions if why_not.get(x)]
        if refused:
            raise ValueError(f"--fp8-autoheal-actions: {'; '.join(refused)}: drop it from the list")
    return Fp8AutohealConfig(enabled=True, actions=actions,
                             **{f: getattr(a, "fp8_autoheal_" + f) for f in _AUTOHEAL_TUNABLES})


def _fp8_recipe(a: argparse.Namespace, model: ModelConfig) -> Optional[Fp8Recipe]:
    aliases = [f for f, on in (("hybrid", a.fp8_hybrid), ("e4m3", a.fp8_e4m3)) if on]
    if len(aliases) > 1 or (aliases and a.fp8_format and a.fp8_format != aliases[0]):
        raise ValueError("conflicting FP8 formats: use one of --fp8-format, --fp8-hybrid, --fp8-e4m3")
    fmt = a.fp8_format or (aliases[0] if aliases else None)
    fp8_only = {"--fp8-mlp-fc2-bf16": a.fp8_mlp_fc2_bf16, "--log-fp8-stats": a.log_fp8_stats,
                "--fp8-autoheal": a.fp8_autoheal,
                "--fp8-first-last-layers-bf16": a.fp8_first_last_layers_bf16 > 0,
                "--no-fp8-wgrad": a.no_fp8_wgrad, "--fp8-power-of-two-scales": a.fp8_power_of_two_scales,
                "--fp8-grad-stochastic-rounding": a.fp8_grad_stochastic_rounding,
                "--fp8-fast-accum": a.fp8_fast_accum is not None}
    if fmt is None:
        used = [flag for flag, on in fp8_only.items() if on]
        if used:
            raise ValueError(f"{', '.join(used)} only apply to FP8 training: add --fp8-format hybrid (or e4m3)")
        return None
    if a.fp8_first_last_layers_bf16 * 2 >= (a.num_layers or 0):
        raise ValueError(f"--fp8-first-last-layers-bf16 {a.fp8_first_last_layers_bf16} keeps every one of the "
                         f"{a.num_layers} layers in BF16: lower it, or drop --fp8-format")
    recipe = Fp8Recipe(
        format=Fp8Format(fmt), scaling=Fp8Scaling(a.fp8_recipe), amax_history_len=a.fp8_amax_history_len,
        amax_compute_algo=AmaxComputeAlgo(a.fp8_amax_compute_algo), margin=a.fp8_margin,
        power_of_two_scales=a.fp8_power_of_two_scales, fp8_wgrad=not a.no_fp8_wgrad,
        backend=Fp8Backend(a.fp8_backend), first_last_layers_bf16=a.fp8_first_last_layers_bf16,
        mlp_fc2_bf16=a.fp8_mlp_fc2_bf16, grad_stochastic_rounding=a.fp8_grad_stochastic_rounding,
        fast_accum=DEFAULT_FAST_ACCUM if a.fp8_fast_accum is None else a.fp8_fast_accum,
    )
    if a.fp8_autoheal and recipe.scaling.fine_grained:
        raise ValueError(f"--fp8-autoheal raises per-tensor scales' margins; --fp8-recipe {recipe.scaling.value} "
                         "scales every tile by its own amax (nothing to raise): drop one")
    recipe.check_tensor_parallel(a.tensor_model_parallel_size, {
        "--num-attention-heads x --kv-channels (queries, attention output)":
            model.num_attention_heads * model.kv_channels,
        "--num-key-value-heads x --kv-channels (keys, values)": model.num_key_value_heads * model.kv_channels,
        "--ffn-hidden-size": model.ffn_hidden_size})
    return recipe


def _schedule(a: argparse.Namespace, gbs: int) -> tuple[int, SchedulerConfig]:
    if (a.train_iters is None) == (a.train_samples is None):
        raise ValueError("pass exactly one of --train-iters and --train-samples")
    train_iters = a.train_iters if a.train_iters is not None else math.ceil(a.train_samples / gbs)
    if train_iters < 1:
        raise ValueError("--train-iters / --train-samples must give at least one iteration")
    _require(a.lr, "--lr")
    decay = a.lr_decay_iters
    if a.lr_decay_samples is not None:
        decay = math.ceil(a.lr_decay_samples / gbs)
    decay = decay if decay is not None else train_iters
    warmup_sources = [a.lr_warmup_iters > 0, a.lr_warmup_samples > 0, a.lr_warmup_fraction is not None]
    if sum(warmup_sources) > 1:
        raise ValueError("pass only one of --lr-warmup-iters, --lr-warmup-samples, --lr-warmup-fraction")
    if a.lr_warmup_fraction is not None:
        if not 0.0 <= a.lr_warmup_fraction <= 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1], got {a.lr_warmup_fraction}")
        warmup = int(a.lr_warmup_fraction * decay)
    elif a.lr_warmup_samples > 0:
        warmup = math.ceil(a.lr_warmup_samples / gbs)
    else:
        warmup = a.lr_warmup_iters
    if a.lr_decay_style != "constant" and warmup > decay:
        raise ValueError(f"LR warm-up ({warmup} iterations) is longer than the decay ({decay} iterations, "
                         "--lr-decay-iters): shorten the warm-up or lengthen the decay")
    if a.min_lr > a.lr:
        raise ValueError(f"--min-lr {a.min_lr} is larger than --lr {a.lr}")
    return train_iters, SchedulerConfig(lr=a.lr, min_lr=a.min_lr, decay_style=LrDecayStyle(a.lr_decay_style),
                                        warmup_iters=warmup, decay_iters=decay)


def parse_config(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
                 env: Optional[dict] = None) -> MegatronConfig:
    """Parse and validate flags into a `MegatronConfig`. Raises ValueError naming the flag and the fix.

    `env` (default: os.environ) may hold the reference code's FP8 recipe variables (megatron/compat.py); they
    become flags placed before `argv`, so a flag given explicitly wins. All flag problems (unknown flags, invalid
    choices, and the first semantic error when the values parsed) are reported together, in one error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_flags, recipe = env_recipe_flags(os.environ if env is None else env)
    a, problems, choices_ok = parse_collecting_problems(build_parser(), recipe_flags + argv)
    config = None
    if choices_ok:
        try:
            config = _resolve(a, world_size, recipe)
        except ValueError as exc:
            message = str(exc)
            if recipe_flags:
                message += (" (the environment's FP8 recipe added: " + " ".join(recipe_flags) + "; see "
                            "docs/guides/migrate.md)")
            problems.append(message)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} problems with the flags: "
                         + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))
    return config


def _missing_required(a: argparse.Namespace) -> None:
    """Every missing required flag in one message (not one per run)."""
    missing = [flag for flag in REQUIRED if getattr(a, flag[2:].replace("-", "_")) is None]
    if a.train_iters is None and a.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        raise ValueError(f"missing required flag{'s' if len(missing) > 1 else ''}: {', '.join(missing)} "
                         "(pretrain_gpt.py --help lists every flag with its default)")


def _resolve(a: argparse.Namespace, world_size: Optional[int], recipe: list) -> MegatronConfig:
    _missing_required(a)
    _not_supported_yet(a)
    if a.use_torch_compile is not None:  # Habana's spelling of --torch-compile
        wanted = "on" if a.use_torch_compile else "off"
        if a.torch_compile not in ("auto", wanted):
            raise ValueError(f"--use-torch-compile {str(a.use_torch_compile).lower()} contradicts --torch-compile "
                             f"{a.torch_compile}: drop one")
        a.torch_compile = wanted
    compat = resolve_compat(a, a.device)
    compat = CompatConfig(kernels=compat.kernels, env_recipe=tuple(recipe),
                          notes=tuple(f"environment {var}={value}: {meaning}" for var, value, meaning in recipe)
                          + compat.notes)
    world = world_size if world_size is not None else world_size_from_env()
    model_parallel = (_parallel_size("--tensor-model-parallel-size", a.tensor_model_parallel_size)
                      * _parallel_size("--pipeline-model-parallel-size", a.pipeline_model_parallel_size))
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by tensor x pipeline parallel size {model_parallel}")
    dp = world // model_parallel
    _require(a.micro_batch_size, "--micro-batch-size")
    gbs = a.global_batch_size or a.micro_batch_size * dp
    if gbs % (a.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {gbs} must be divisible by --micro-batch-size {a.micro_batch_size} "
                         f"x data-parallel size {dp}")
    train_iters, scheduler = _schedule(a, gbs)
    for flag, value in (("--log-interval", a.log_interval), ("--eval-interval", a.eval_interval)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if a.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {a.eval_iters}")
    if a.fp8_optimizer:
        a.optimizer = "fp8adam"
    if a.optimizer != "fp8adam":
        opt_defaults = (a.fp8_optimizer_m_dtype, a.fp8_optimizer_v_dtype, a.fp8_optimizer_block_size,
                        a.fp8_optimizer_stochastic_rounding, a.fp8_optimizer_compile)
        if opt_defaults != ("e4m3", "e5m2", 0, True, True):
            raise ValueError("--fp8-optimizer-* flags need --optimizer fp8adam (or --fp8-optimizer)")
    for flag, path in (("--save", a.save), ("--tensorboard-dir", a.tensorboard_dir),
                       ("--data-cache-path", a.data_cache_path)):
        _check_writable(flag, path)
    data = _data_config(a)
    padded_vocab, vocab_note = _padded_vocab_size(a, data)
    if vocab_note:
        compat = dataclasses.replace(compat, notes=compat.notes + (vocab_note,))
    model = _model_config(a, padded_vocab)
    _tensor_parallel_checks(a, model)
    _pipeline_parallel_checks(a, model)
    config = MegatronConfig(
        model=model,
        optimizer=OptimizerConfig(
            optimizer=a.optimizer, lr=a.lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad, fp8_m_dtype=a.fp8_optimizer_m_dtype,
            fp8_v_dtype=a.fp8_optimizer_v_dtype, fp8_block_size=a.fp8_optimizer_block_size,
            fp8_stochastic_rounding=a.fp8_optimizer_stochastic_rounding, fp8_compile=a.fp8_optimizer_compile),
        scheduler=scheduler,
        training=TrainingConfig(
            micro_batch_size=a.micro_batch_size, global_batch_size=gbs, data_parallel_size=dp, train_iters=train_iters,
            seed=a.seed, eval_interval=a.eval_interval, eval_iters=a.eval_iters, exit_interval=a.exit_interval,
            exit_duration_in_mins=a.exit_duration_in_mins, exit_signal_handler=a.exit_signal_handler,
            exit_on_stall_seconds=a.exit_on_stall_seconds,
            max_consecutive_nan_steps=a.max_consecutive_nan_steps, bf16=a.bf16, params_dtype=a.params_dtype, dry_run=a.dry_run,
            project_on=_project_on(a), project_devices=a.project_devices,
            torch_compile=a.torch_compile),
        checkpoint=CheckpointConfig(
            save=a.save, load=a.load, save_interval=a.save_interval, no_save_optim=a.no_save_optim,
            no_save_rng=a.no_save_rng, no_load_optim=a.no_load_optim, no_load_rng=a.no_load_rng, finetune=a.finetune,
            verify=a.verify_checkpoint, keep_last=a.keep_last_n_checkpoints,
            exit_on_save_failure=a.exit_on_save_failure, fallback=not a.no_checkpoint_fallback),
        logging=LoggingConfig(log_interval=a.log_interval, tensorboard_dir=a.tensorboard_dir,
                              log_fp8_stats=a.log_fp8_stats, log_swiglu_diagnostics=not a.no_swiglu_diagnostics,
                              log_batch_size=a.log_batch_size_to_tensorboard,
                              log_timers=a.log_timers_to_tensorboard),
        data=data,
        parallel=ParallelConfig(
            tensor_model_parallel_size=a.tensor_model_parallel_size,
            pipeline_model_parallel_size=a.pipeline_model_parallel_size,
            # Megatron's rule: sequence parallelism is meaningless (and off) without tensor parallelism.
            sequence_parallel=a.sequence_parallel and a.tensor_model_parallel_size > 1,
            distributed_backend=a.distributed_backend, deepspeed=a.deepspeed, deepspeed_config=a.deepspeed_config,
            zero_stage=a.zero_stage, distributed_timeout_minutes=a.distributed_timeout_minutes),
        fp8=_fp8_recipe(a, model),
        device=a.device,
        divergence=DivergenceConfig(
            enabled=a.divergence_guard, loss_factor=a.divergence_loss_factor, patience=a.divergence_patience,
            window=a.divergence_window, zero_grad_iters=a.divergence_zero_grad_iters,
            max_weight=a.divergence_max_weight),
        fp8_autoheal=_fp8_autoheal(a),
        compat=compat,
    )
    if config.training.torch_compile == "on":  # refused here, before any process group or model is built
        check_torch_compile_supported(config)
    return config
