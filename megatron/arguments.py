"""Command-line flags (Megatron-DeepSpeed names and defaults) and their resolution into a typed config.

`build_parser()` groups the flags as Megatron does. `parse_config(argv)` is the only code in the
project that reads the argparse Namespace: it validates the flags (errors name the flag and the
fix), computes derived values once, and returns a frozen `MegatronConfig`. Flags that parse but are
not implemented yet are rejected with a clear "not supported yet" error, never silently ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron.config import (
    CheckpointConfig, DataConfig, DivergenceConfig, Fp8AutohealConfig, LoggingConfig, MegatronConfig, ModelConfig,
    OptimizerConfig, ParallelConfig, PositionEmbedding, RecomputeGranularity, SchedulerConfig, SmoothSwiGLUGranularity,
    TrainingConfig,
)
from megatron.compat import (
    CompatConfig, add_compat_arguments, env_recipe_flags,
    parse_collecting_problems, resolve_compat,
)
from megatron.flagspec import (
    COMPAT, DEEPSPEED, GROUPS, NETWORK, PRECISION, Flag, add_flags, changed_from_default, copy_flags,
)
from megatron.fp8.recipe import AUTOHEAL_ACTIONS, DEFAULT_FAST_ACCUM, Fp8Format, Fp8Recipe
from megatron.model.compile import check_torch_compile_supported
from megatron.parallel_state import world_size_from_env

DEFAULT_VOCAB_DIVISOR = DataConfig.make_vocab_size_divisible_by  # --make-vocab-size-divisible-by's default


REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size", "--lr")


# The config dataclasses whose fields declare the flags (megatron/flagspec.py), in the order --help lists them.
FLAG_CONFIGS = (ModelConfig, OptimizerConfig, SchedulerConfig, TrainingConfig, DivergenceConfig, MegatronConfig,
                Fp8Recipe, Fp8AutohealConfig, CheckpointConfig, LoggingConfig, DataConfig, ParallelConfig)
# Flags that set no config field: checked, then dropped.
INPUT_FLAGS = (
    Flag(("--fp16",), PRECISION, action="store_true", default=False,
         help="refused: FP16 is not supported (use --bf16: BF16 autocast with FP32 master weights)"),
    Flag(("--group-query-attention",), NETWORK, action="store_true", default=False,
         help="Megatron-LM's switch for grouped-query attention: the number of key/value groups is --num-query-groups "
              "(= --num-key-value-heads), 1 when not given, as in Megatron-LM"),
    Flag(("--local_rank", "--local-rank"), DEEPSPEED, type=int, default=None, dest="local_rank",
         help="passed by the deepspeed launcher; must agree with the LOCAL_RANK environment variable, which is what "
              "is used"),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser generated from the flags declared on the config fields, grouped as Megatron groups them."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False,
                                usage="%(prog)s FLAGS  (required: " + " ".join(REQUIRED)
                                      + " and --train-iters or --train-samples; flags by group below)",
                                description="Megatron-FP8 GPT pretraining. Flags keep Megatron-DeepSpeed's names "
                                            "and defaults; README.md has a first run.")
    groups = {title: p.add_argument_group(title) for title in GROUPS if title != COMPAT}
    for cls in FLAG_CONFIGS:
        add_flags(groups, cls)
    for input_flag in INPUT_FLAGS:
        input_flag.add_to(groups[input_flag.group])
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
    if a.deepspeed and a.no_save_optim:
        raise ValueError("--no-save-optim is not supported with --deepspeed: DeepSpeed checkpoints always carry "
                         "the (partitioned) optimizer state; drop the flag")
    env_local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.local_rank is not None and a.local_rank != env_local_rank:
        raise ValueError(f"--local_rank {a.local_rank} disagrees with the environment's LOCAL_RANK={env_local_rank}, "
                         "which decides the device: launch with torchrun or deepspeed, which set both")
    if a.fp16:
        raise ValueError("--fp16 is not supported: use --bf16 (BF16 autocast with FP32 master weights). "
                         "On CPU, FP16 compute is also about 1000x slower than BF16.")


def _parallel_size(flag: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    return value


def _model_config(a: argparse.Namespace, padded_vocab: int) -> ModelConfig:
    for flag, value in (("--num-layers", a.num_layers), ("--hidden-size", a.hidden_size),
                        ("--num-attention-heads", a.num_attention_heads), ("--seq-length", a.seq_length)):
        _require(value, flag)
    if a.group_query_attention and a.num_key_value_heads is None:
        a.num_key_value_heads = 1  # Megatron-LM's --num-query-groups default under --group-query-attention
    kv_heads = a.num_key_value_heads or a.num_attention_heads
    ffn = a.ffn_hidden_size
    if ffn is None:
        ffn = int(4 * a.hidden_size * 2 / 3 / 64) * 64 if a.swiglu else 4 * a.hidden_size
    max_pos = a.max_position_embeddings or a.seq_length
    granularity = a.recompute_granularity or ("selective" if a.recompute_activations else None) or (
        "full" if a.deepspeed_activation_checkpointing else None)  # upstream: DeepSpeed's checkpointing = ours
    pos = "rope" if a.use_rotary_position_embeddings else a.position_embedding_type
    smooth = SmoothSwiGLUGranularity(a.smooth_swiglu_granularity) if a.smooth_swiglu else None
    return ModelConfig(
        **copy_flags(ModelConfig, a), num_key_value_heads=kv_heads, ffn_hidden_size=ffn,
        max_position_embeddings=max_pos, padded_vocab_size=padded_vocab,
        kv_channels=a.kv_channels or a.hidden_size // a.num_attention_heads,
        position_embedding_type=PositionEmbedding(pos),
        recompute_granularity=RecomputeGranularity(granularity) if granularity else None, smooth_swiglu=smooth,
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
        **copy_flags(DataConfig, a), data_path=paths.data_path, train_data_path=paths.train_data_path,
        valid_data_path=paths.valid_data_path, test_data_path=paths.test_data_path,
        make_vocab_size_divisible_by=a.make_vocab_size_divisible_by or DEFAULT_VOCAB_DIVISOR,
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
    tuned = ((["--fp8-autoheal-actions"] if a.fp8_autoheal_actions is not None else [])
             + [f for f in changed_from_default(Fp8AutohealConfig, a) if f != "--fp8-autoheal"])
    if tuned and not a.fp8_autoheal:
        raise ValueError(f"{', '.join(tuned)} only apply with --fp8-autoheal: add it or drop them")
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
    return Fp8AutohealConfig(**copy_flags(Fp8AutohealConfig, a), actions=actions)


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
    recipe = Fp8Recipe(**copy_flags(Fp8Recipe, a), format=Fp8Format(fmt),
                       fast_accum=DEFAULT_FAST_ACCUM if a.fp8_fast_accum is None else a.fp8_fast_accum)
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
    return train_iters, SchedulerConfig(**copy_flags(SchedulerConfig, a), lr=a.lr, warmup_iters=warmup,
                                        decay_iters=decay)


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


@dataclasses.dataclass(frozen=True)
class FileFacts:
    """What the files the flags name say (`read_files`)."""

    zero_stage: Optional[int]  # --zero-stage, else the DeepSpeed JSON's (None: neither gives one)
    data: DataConfig  # with the data paths that --data-args-path / --per-split-data-args-path hold
    padded_vocab_size: int  # the tokenizer's vocabulary padded, or --load's checkpoint's
    vocab_note: Optional[str]  # why the checkpoint's padded vocabulary was kept


def read_files(a: argparse.Namespace) -> FileFacts:
    """The one step of the flags' resolution that reads the file system or builds a tokenizer: the DeepSpeed JSON's
    ZeRO stage, whether the folders the run writes into are writable, the data paths held in files, the tokenizer's
    vocabulary and the padded vocabulary of --load's checkpoint."""
    zero_stage = a.zero_stage
    if a.deepspeed and zero_stage is None:
        zero_stage = _json_zero_stage(a.deepspeed_config)
    for flag, path in (("--save", a.save), ("--tensorboard-dir", a.tensorboard_dir),
                       ("--data-cache-path", a.data_cache_path), ("--wandb-save-dir", a.wandb_save_dir)):
        _check_writable(flag, path)
    if a.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb-project needs the wandb package, which is not installed: pip install wandb (or "
                         "pip install -e .[wandb]), or leave --wandb-project out")
    data = _data_config(a)
    return FileFacts(zero_stage, data, *_padded_vocab_size(a, data))


def _torch_compile(a: argparse.Namespace) -> str:
    """--torch-compile, or Habana's spelling of it (--use-torch-compile true/false)."""
    if a.use_torch_compile is None:
        return a.torch_compile
    wanted = "on" if a.use_torch_compile else "off"
    if a.torch_compile not in ("auto", wanted):
        raise ValueError(f"--use-torch-compile {str(a.use_torch_compile).lower()} contradicts --torch-compile "
                         f"{a.torch_compile}: drop one")
    return wanted


def _compat(a: argparse.Namespace, recipe: list) -> CompatConfig:
    """The upstream flags' and the environment recipe's resolution, with their startup notes."""
    compat = resolve_compat(a, a.device)
    notes = tuple(f"environment {var}={value}: {meaning}" for var, value, meaning in recipe) + compat.notes
    return CompatConfig(kernels=compat.kernels, env_recipe=tuple(recipe), notes=notes)


def _batch(a: argparse.Namespace, world_size: Optional[int]) -> tuple[int, int]:
    """(data-parallel size, global batch size) of this world."""
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
    return dp, gbs


def _resolve(a: argparse.Namespace, world_size: Optional[int], recipe: list) -> MegatronConfig:
    _missing_required(a)
    _not_supported_yet(a)
    torch_compile = _torch_compile(a)
    compat = _compat(a, recipe)
    dp, gbs = _batch(a, world_size)
    train_iters, scheduler = _schedule(a, gbs)
    optimizer = OptimizerConfig(**copy_flags(OptimizerConfig, a),
                                optimizer="fp8adam" if a.fp8_optimizer else a.optimizer)
    files = read_files(a)
    if files.vocab_note:
        compat = dataclasses.replace(compat, notes=compat.notes + (files.vocab_note,))
    model = _model_config(a, files.padded_vocab_size)
    config = MegatronConfig(
        model=model, optimizer=optimizer, scheduler=scheduler,
        training=TrainingConfig(**copy_flags(TrainingConfig, a), global_batch_size=gbs, data_parallel_size=dp,
                                train_iters=train_iters, project_on=_project_on(a), torch_compile=torch_compile,
                                eval_iters=100 if a.eval_iters is None else a.eval_iters,
                                eval_iters_capped=a.eval_iters is None),
        checkpoint=CheckpointConfig(**copy_flags(CheckpointConfig, a), verify=a.verify_checkpoint),
        logging=LoggingConfig(**copy_flags(LoggingConfig, a)),
        data=files.data,
        parallel=ParallelConfig(
            **copy_flags(ParallelConfig, a), zero_stage=files.zero_stage,
            # Megatron's rule: sequence parallelism is meaningless (and off) without tensor parallelism.
            sequence_parallel=a.sequence_parallel and a.tensor_model_parallel_size > 1),
        fp8=_fp8_recipe(a, model),
        divergence=DivergenceConfig(**copy_flags(DivergenceConfig, a)),
        fp8_autoheal=_fp8_autoheal(a),
        compat=compat,
        **copy_flags(MegatronConfig, a),
    )
    if config.training.torch_compile == "on":  # refused here, before any process group or model is built
        check_torch_compile_supported(config)
    return config
