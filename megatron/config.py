"""Typed, frozen configuration objects.

`megatron.arguments.parse_config` is the only code that reads the argparse Namespace; it returns a
`MegatronConfig` made of the dataclasses below. Every component receives only its own slice
(the model gets `ModelConfig`, the optimizer factory `OptimizerConfig`, ...). Values derived from
several flags (padded vocabulary, gradient-accumulation steps) are computed once, at parse time or
when the tokenizer is known, never re-derived downstream.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from megatron.compat import CompatConfig, normalization_type, optimizer_type
from megatron.flagspec import (
    CHECKPOINTING, DATA, DEEPSPEED, DISTRIBUTED, FP8, LOGGING, NETWORK, PRECISION, REGULARIZATION, TRAINING, Flag, flag,
)
from megatron.fp8.recipe import Fp8AutohealConfig, Fp8Recipe


class Normalization(str, enum.Enum):
    RMSNORM = "RMSNorm"
    LAYERNORM = "LayerNorm"


class PositionEmbedding(str, enum.Enum):
    ROPE = "rope"
    LEARNED_ABSOLUTE = "learned_absolute"


class RecomputeGranularity(str, enum.Enum):
    FULL = "full"
    SELECTIVE = "selective"


class LrDecayStyle(str, enum.Enum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class SmoothSwiGLUGranularity(str, enum.Enum):
    CHANNEL = "channel"
    TOKEN = "token"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and regularisation of the GPT (Megatron-Core `TransformerConfig` analogue). Its defaults are the
    command line's (Megatron's GPT-2 architecture); `LLAMA` gives the Llama-style choices."""

    num_layers: int = flag("--num-layers", group=NETWORK, help="transformer layers (blocks)")
    hidden_size: int = flag("--hidden-size", group=NETWORK, help="model width: the hidden size of every block")
    num_attention_heads: int = flag("--num-attention-heads", group=NETWORK,
                                    help="query heads per attention layer (--num-key-value-heads for GQA)")
    num_key_value_heads: int = flag("--num-key-value-heads", "--num-query-groups", group=NETWORK, type=int,
                                    derived=True, help="grouped-query attention; default = --num-attention-heads "
                                                       "(multi-head)")
    ffn_hidden_size: int = flag("--ffn-hidden-size", group=NETWORK, type=int, derived=True,
                                help="default 4*hidden, or int(8*hidden/3 / 64)*64 with --swiglu (Megatron's rule)")
    seq_length: int = flag("--seq-length", group=NETWORK, type=int, help="tokens per training sample")
    max_position_embeddings: int = flag("--max-position-embeddings", group=NETWORK, type=int, derived=True,
                                        help="default --seq-length")
    padded_vocab_size: int = dataclasses.field()  # the tokenizer's vocabulary, padded (arguments.py)
    kv_channels: int = flag("--kv-channels", group=NETWORK, type=int, derived=True,
                            help="head dim; default hidden/heads")
    normalization: Normalization = flag("--normalization", group=NETWORK, default=Normalization.LAYERNORM,
                                        type=normalization_type, choices=["LayerNorm", "RMSNorm"],
                                        help="also the upstream lowercase spellings layernorm, rmsnorm")
    norm_epsilon: float = flag("--norm-epsilon", "--layernorm-epsilon", group=NETWORK, default=1e-5,
                               dest="norm_epsilon")
    swiglu: bool = flag("--swiglu", group=NETWORK, default=False, help="SwiGLU MLP (Llama's) instead of GELU")
    untie_embeddings_and_output_weights: bool = flag("--untie-embeddings-and-output-weights", group=NETWORK,
                                                     default=False,
                                                     help="a separate output layer instead of the input embedding's "
                                                          "transpose (Llama's layout)")
    add_bias_linear: bool = flag("--disable-bias-linear", group=NETWORK, default=True, negate=True,
                                 help="no biases in the linear layers (Llama's layout)")
    position_embedding_type: PositionEmbedding = flag(
        "--position-embedding-type", group=NETWORK, default=PositionEmbedding.LEARNED_ABSOLUTE,
        choices=["learned_absolute", "rope"], derived=True, cli_default="learned_absolute",
        more=[Flag(("--use-rotary-position-embeddings",), NETWORK, action="store_true", default=False,
                   help="same as --position-embedding-type rope")])
    rotary_base: float = flag("--rotary-position-embeddings-theta", "--rope-theta", "--rotary-base", group=NETWORK,
                              default=10000.0, dest="rotary_base")
    hidden_dropout: float = flag("--hidden-dropout", group=REGULARIZATION, default=0.1)
    attention_dropout: float = flag("--attention-dropout", group=REGULARIZATION, default=0.1)
    init_method_std: float = flag("--init-method-std", group=REGULARIZATION, default=0.02)
    recompute_granularity: Optional[RecomputeGranularity] = flag(
        "--recompute-granularity", group=TRAINING, default=None, choices=["full", "selective"], derived=True,
        more=[Flag(("--recompute-activations",), TRAINING, action="store_true", default=False,
                   help="same as --recompute-granularity selective")],
                   help="activation recompute: full (each block's forward again in backward) or selective (the "
                        "attention core only)")
    recompute_method: str = flag("--recompute-method", group=TRAINING, default="uniform", choices=["uniform", "block"])
    recompute_num_layers: int = flag("--recompute-num-layers", group=TRAINING, default=1)
    smooth_swiglu: Optional[SmoothSwiGLUGranularity] = flag(
        "--smooth-swiglu", group=FP8, default=None, action="store_true", cli_default=False, derived=True,
        help="scale the SwiGLU output per channel/token before its FP8 quantization (needs --swiglu, FP8)",
        more=[Flag(("--smooth-swiglu-granularity",), FP8, choices=["channel", "token"], default="channel",
                   help="channel: the paper's per-channel scales; token: the reference code's per-token scales")])

    def __post_init__(self) -> None:
        if self.recompute_num_layers < 1:
            raise ValueError("--recompute-num-layers must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} must be divisible by --num-attention-heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} must be divisible by "
                             f"--num-key-value-heads {self.num_key_value_heads}")
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}")
        if self.smooth_swiglu is not None and not self.swiglu:
            raise ValueError("--smooth-swiglu needs --swiglu (it rescales the SwiGLU product)")

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_key_value_heads


# The Llama-style architecture (RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, no dropout): the model fields a
# Llama run sets away from the command line's GPT-2 defaults.
LLAMA = dict(normalization=Normalization.RMSNORM, swiglu=True, untie_embeddings_and_output_weights=True,
             add_bias_linear=False, position_embedding_type=PositionEmbedding.ROPE, hidden_dropout=0.0,
             attention_dropout=0.0)
# The flags of the FP8 optimizer's moment storage, which only apply with --optimizer fp8adam.
_FP8_MOMENT_FIELDS = ("fp8_m_dtype", "fp8_v_dtype", "fp8_block_size", "fp8_stochastic_rounding", "fp8_compile")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (or Fp8Adam) hyper-parameters and Megatron's parameter-group rule."""

    lr: float = flag("--lr", group=TRAINING, type=float, help="peak learning rate, reached after the warm-up")
    optimizer: str = flag("--optimizer", group=REGULARIZATION, default="adam", type=optimizer_type,
                          choices=["adam", "fp8adam"], derived=True,
                          help="adam = AdamW (decoupled weight decay, as Megatron; upstream adamw and fusedadamw are "
                               "accepted for it); fp8adam = moments stored in FP8",
                          more=[Flag(("--fp8-optimizer",), REGULARIZATION, action="store_true", default=False,
                                     help="same as --optimizer fp8adam")])
    weight_decay: float = flag("--weight-decay", group=REGULARIZATION, default=0.01)
    adam_beta1: float = flag("--adam-beta1", group=REGULARIZATION, default=0.9)
    adam_beta2: float = flag("--adam-beta2", group=REGULARIZATION, default=0.999)
    adam_eps: float = flag("--adam-eps", group=REGULARIZATION, default=1e-8)
    clip_grad: float = flag("--clip-grad", group=REGULARIZATION, default=1.0, help="0 disables clipping")
    fp8_m_dtype: str = flag("--fp8-optimizer-m-dtype", group=REGULARIZATION, default="e4m3",
                            choices=["e4m3", "e5m2", "bf16", "fp32"])
    fp8_v_dtype: str = flag("--fp8-optimizer-v-dtype", group=REGULARIZATION, default="e5m2",
                            choices=["e4m3", "e5m2", "bf16", "fp32"])
    fp8_block_size: int = flag("--fp8-optimizer-block-size", group=REGULARIZATION, default=0,
                               help="0 = one scale per tensor")
    fp8_stochastic_rounding: bool = flag(
        "--fp8-optimizer-stochastic-rounding", group=REGULARIZATION, default=True,
        action=argparse.BooleanOptionalAction,
        help="requantize Adam's v with stochastic rounding (default; unbiased, see docs/fp8_adam.md)")
    # Fp8AdamW's update through torch.compile (--no-fp8-optimizer-compile: eager); falls back to eager with
    # a warning where compiling fails.
    fp8_compile: bool = flag("--fp8-optimizer-compile", group=REGULARIZATION, default=True,
                             action=argparse.BooleanOptionalAction,
                             help="run Fp8AdamW's update through torch.compile (default; eager with a warning where "
                                  "compiling fails); --no-fp8-optimizer-compile keeps it eager")

    def __post_init__(self) -> None:
        if self.optimizer != "fp8adam":
            defaults = self._moment_defaults()
            if any(getattr(self, name) != default for name, default in defaults.items()):
                raise ValueError("--fp8-optimizer-* flags need --optimizer fp8adam (or --fp8-optimizer)")

    @classmethod
    def _moment_defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name in _FP8_MOMENT_FIELDS}

    def adamw(self) -> "OptimizerConfig":
        """The same hyper-parameters with AdamW's FP32 moments (the FP8 moment settings back to their defaults)."""
        return dataclasses.replace(self, optimizer="adam", **self._moment_defaults())


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule, resolved to iterations."""

    lr: float
    decay_iters: int = flag("--lr-decay-iters", group=TRAINING, type=int, derived=True, help="default --train-iters",
                            more=[Flag(("--lr-decay-samples",), TRAINING, type=int, default=None,
                                       help="decay the learning rate over this many samples (instead of "
                                            "--lr-decay-iters)")])
    min_lr: float = flag("--min-lr", group=TRAINING, default=0.0)
    decay_style: LrDecayStyle = flag("--lr-decay-style", group=TRAINING, default=LrDecayStyle.LINEAR,
                                     choices=["constant", "linear", "cosine"])
    warmup_iters: int = flag("--lr-warmup-iters", group=TRAINING, default=0, derived=True,
                             more=[Flag(("--lr-warmup-samples",), TRAINING, default=0, type=int),
                                   Flag(("--lr-warmup-fraction",), TRAINING, type=float, default=None,
                                        help="warm up over this fraction of the decay (instead of --lr-warmup-iters)")])


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int = flag("--micro-batch-size", group=TRAINING, type=int,
                                 help="samples per forward/backward on each data-parallel rank")
    global_batch_size: int = flag("--global-batch-size", group=TRAINING, type=int, derived=True,
                                  help="default micro batch x data-parallel size")
    data_parallel_size: int = dataclasses.field()  # the world size over tensor x pipeline parallelism
    train_iters: int = flag("--train-iters", group=TRAINING, type=int, derived=True,
                            more=[Flag(("--train-samples",), TRAINING, type=int, default=None,
                                       help="samples to train, in place of --train-iters (iterations = samples / "
                                            "global batch)")], help="optimizer steps to train (or --train-samples)")
    seed: int = flag("--seed", group=TRAINING, default=1234)
    eval_interval: int = flag("--eval-interval", group=TRAINING, default=1000)
    eval_iters: int = flag(
        "--eval-iters", group=TRAINING, default=100, cli_default=None, type=int, derived=True,
        help="global batches each validation and test evaluation reads (the first ones of the split, the same each "
             "time). Default 100, capped to one pass over the split (a warning says so); given, it is read as given")
    exit_interval: Optional[int] = flag("--exit-interval", group=TRAINING, default=None, type=int,
                                        help="save (with --save) and exit when the iteration is a multiple of this")
    exit_duration_in_mins: Optional[float] = flag("--exit-duration-in-mins", group=TRAINING, default=None, type=float,
                                                  help="save (with --save) and exit after this many minutes of "
                                                       "training")
    # no iteration finished for this long ends the process
    exit_on_stall_seconds: Optional[float] = flag(
        "--exit-on-stall-seconds", group=TRAINING, default=None, type=float, metavar="S",
        help="end the process (one line, exit code 4, every thread's stack in a file it names) when no iteration has "
             "finished for S seconds: a stuck filesystem or data worker, a hang outside the collectives; torchrun "
             "--max-restarts then restarts the job. Default: off")
    exit_signal_handler: bool = flag("--exit-signal-handler", group=TRAINING, default=False,
                                     help="on SIGTERM save a checkpoint and exit")
    max_consecutive_nan_steps: int = flag("--max-consecutive-nan-steps", group=TRAINING, default=10)
    bf16: bool = flag("--bf16", group=PRECISION, default=False, help="BF16 autocast with FP32 master weights")
    # "fp32": the weights are the master weights; "bf16": Megatron's layout (BF16 weights, FP32 main grads, FP32
    # master copy with the optimizer state; megatron/optimizer/main_params.py)
    params_dtype: str = flag(
        "--params-dtype", group=PRECISION, default="fp32", choices=["fp32", "bf16"],
        help="dtype of the weights on the device (with --bf16). fp32: the weights are the master weights. bf16: "
             "Megatron's layout (upstream --bf16): BF16 weights, FP32 main gradients, the FP32 master copy kept with "
             "the optimizer state and sharded with it by ZeRO (docs/fp8_adam.md, Memory)")
    dry_run: bool = flag("--dry-run", group=TRAINING, default=False,
                         help="print the resolved config, parameter count, FLOPs and memory estimate, then exit")
    # devices the dry run projects this run on (megatron/perf)
    project_on: Tuple[str, ...] = flag(
        "--project-on", group=TRAINING, default=(), cli_default=None, derived=True, metavar="DEVICE[,DEVICE]",
        help="with --dry-run: also the projected step time, tokens/s, MFU and time to --train-iters of this run and "
             "of the same run in BF16 on these devices (h100, h200, b200, gaudi2, gaudi3; megatron/perf, "
             "docs/performance.md)")
    project_devices: Optional[int] = flag(
        "--project-devices", group=TRAINING, default=None, type=int, metavar="N",
        help="with --project-on: project on N devices (default: the world size this run resolves to)")
    # "auto" (by device and run length: megatron/model/compile.py, docs/performance.md), "on" or "off"
    torch_compile: str = flag(
        "--torch-compile", group=TRAINING, default="auto", choices=["auto", "on", "off"], derived=True,
        help="torch.compile each transformer block (FP8 layers traced into it) and the FP8 quantization; auto = both "
             "on CUDA (blocks eager with PP or ZeRO-3), on CPU both for runs of >= 1000 iterations and the FP8 "
             "quantization only for runs of >= 100 (not in the BF16 GEMM mode, whose eager casts are as fast), "
             "nothing on Gaudi (docs/performance.md)")
    # --eval-iters was left at its default: each evaluation reads at most one pass (megatron/training/run_plan.py)
    eval_iters_capped: bool = False

    def __post_init__(self) -> None:
        for flag_name, value in (("--eval-interval", self.eval_interval),):
            if value is not None and value < 1:
                raise ValueError(f"{flag_name} must be >= 1, got {value}")
        if self.eval_iters < 0:
            raise ValueError(f"--eval-iters must be >= 0, got {self.eval_iters}")
        if self.exit_on_stall_seconds is not None and not self.exit_on_stall_seconds > 0:
            raise ValueError(f"--exit-on-stall-seconds must be > 0 (the seconds without a finished iteration that end "
                             f"the process), got {self.exit_on_stall_seconds}; leave it out to turn the check off")

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = flag("--save", group=CHECKPOINTING, default=None, type=str,
                               help="folder the checkpoints are written to (iter_XXXXXXX folders and a tracker file)")
    load: Optional[str] = flag("--load", group=CHECKPOINTING, default=None, type=str,
                               help="folder to resume from: its newest complete checkpoint, or a given iter_XXXXXXX "
                                    "folder")
    save_interval: Optional[int] = flag("--save-interval", group=CHECKPOINTING, default=None, type=int,
                                        help="write a checkpoint every this many iterations (and at the end, with "
                                             "--save)")
    no_save_optim: bool = flag("--no-save-optim", group=CHECKPOINTING, default=False,
                               help="leave the optimizer state out of checkpoints (they cannot resume training "
                                    "exactly)")
    no_save_rng: bool = flag("--no-save-rng", group=CHECKPOINTING, default=False,
                             help="leave the random-number generator states out of checkpoints")
    no_load_optim: bool = flag("--no-load-optim", group=CHECKPOINTING, default=False,
                               help="resume the weights without the checkpoint's optimizer state")
    no_load_rng: bool = flag("--no-load-rng", group=CHECKPOINTING, default=False,
                             help="resume without the checkpoint's random-number generator states")
    finetune: bool = flag("--finetune", group=CHECKPOINTING, default=False,
                          help="load weights only; reset iteration and optimizer")
    ckpt_format: str = flag(
        "--ckpt-format", group=CHECKPOINTING, default="torch", choices=["torch", "torch_dist"],
        help="torch: full tensors written by rank 0 (every engine); torch_dist: each rank writes its shards through "
             "torch.distributed.checkpoint (--use-torch-fsdp2)")
    async_save: bool = flag(
        "--async-save", group=CHECKPOINTING, default=False,
        help="--ckpt-format torch_dist: the loop blocks only to copy the state; the files are written in the "
             "background and committed once every rank has written them")
    verify: bool = False  # --verify-checkpoint (megatron/compat.py): each file read back and compared before the commit
    # --keep-last-n-checkpoints: older checkpoints removed after each save
    keep_last: Optional[int] = flag(
        "--keep-last-n-checkpoints", group=CHECKPOINTING, default=None, type=int, metavar="K",
        help="after each complete save, remove all but the K newest checkpoints of --save (never the newest healthy "
             "one); default: keep all")
    exit_on_save_failure: int = flag(
        "--exit-on-save-failure", group=CHECKPOINTING, default=3, metavar="N",
        help="a checkpoint that cannot be written at a --save-interval is logged and training goes on (the previous "
             "one stays the newest); N failed saves in a row end the run (default 3)")
    fallback: bool = flag(
        "--no-checkpoint-fallback", group=CHECKPOINTING, default=True, negate=True,
        help="a resume whose newest checkpoint fails its manifest check (a file missing, truncated or with a wrong "
             "CRC-32) stops with an error instead of loading the next older intact one")

    def __post_init__(self) -> None:
        if self.exit_on_save_failure < 1:
            raise ValueError(f"--exit-on-save-failure must be at least 1 (the failed saves in a row that end the run), "
                             f"got {self.exit_on_save_failure}")
        if self.keep_last is not None and (self.keep_last < 1 or not self.save):
            raise ValueError(f"--keep-last-n-checkpoints {self.keep_last} needs --save and a count of at least 1 (the "
                             "checkpoints it keeps); leave it out to keep every checkpoint")


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = flag("--log-interval", group=LOGGING, default=100)
    tensorboard_dir: Optional[str] = flag("--tensorboard-dir", group=LOGGING, default=None, type=str,
                                          help="write TensorBoard scalars here (Megatron's tag names, docs/flags.md)")
    log_fp8_stats: bool = flag("--log-fp8-stats", group=FP8, default=False,
                               help="per-layer FP8 amax/clipping statistics")
    log_swiglu_diagnostics: bool = flag("--no-swiglu-diagnostics", group=FP8, default=True, negate=True,
                                        help="turn off the per-layer SwiGLU outlier and w1/w2 alignment diagnostics")
    log_batch_size: bool = flag("--log-batch-size-to-tensorboard", group=LOGGING, default=False,
                                help="write batch-size/batch-size (and its vs samples / vs tokens twins)")
    log_timers: bool = flag("--log-timers-to-tensorboard", group=LOGGING, default=False,
                            help="write iteration-time/iteration-time (seconds, and its twins)")
    wandb_project: Optional[str] = flag(
        "--wandb-project", group=LOGGING, default=None, type=str,
        help="log the TensorBoard scalars (by iteration, under the same tags) to this Weights & Biases project from "
             "rank 0; offline (wandb sync uploads later) without WANDB_API_KEY or a wandb login, or with WANDB_MODE")
    wandb_exp_name: Optional[str] = flag("--wandb-exp-name", group=LOGGING, default=None, type=str,
                                         help="the Weights & Biases run name (with --wandb-project)")
    wandb_save_dir: Optional[str] = flag(
        "--wandb-save-dir", group=LOGGING, default=None, type=str,
        help="folder for the Weights & Biases files (with --wandb-project); default: --save/wandb, else ./wandb")

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
        for flag_name, value in (("--wandb-exp-name", self.wandb_exp_name), ("--wandb-save-dir", self.wandb_save_dir)):
            if value is not None and not self.wandb_project:
                raise ValueError(f"{flag_name} is given without --wandb-project: name the Weights & Biases project "
                                 f"(--wandb-project NAME), or leave {flag_name} out")


_DATA_PATHS = [Flag(("--data-args-path",), DATA, type=str, default=None,
                    help="a file holding what --data-path would (W1 P1 W2 P2 ... or P1 P2 ...), for long blends"),
               Flag(("--per-split-data-args-path",), DATA, type=str, default=None,
                    help='a JSON file {"train": [...], "valid": [...], "test": [...]} of per-split data paths')]


@dataclass(frozen=True)
class DataConfig:
    """What to read and how to tokenize it. Paths are kept as given on the command line."""

    data_path: Tuple[str, ...] = flag("--data-path", group=DATA, default=(), cli_default=None, nargs="*", derived=True,
                                      help="PREFIX or WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ...")
    split: str = flag("--split", group=DATA, default="969,30,1", type=str)
    train_data_path: Tuple[str, ...] = flag("--train-data-path", group=DATA, default=(), cli_default=None, nargs="*",
                                            derived=True,
                                            help="the training split's own data: PREFIX or W1 P1 W2 P2 ... (instead "
                                                 "of --data-path)")
    valid_data_path: Tuple[str, ...] = flag("--valid-data-path", group=DATA, default=(), cli_default=None, nargs="*",
                                            derived=True,
                                            help="the validation split's own data: PREFIX or W1 P1 W2 P2 ...")
    test_data_path: Tuple[str, ...] = flag("--test-data-path", group=DATA, default=(), cli_default=None, nargs="*",
                                           derived=True, more=_DATA_PATHS,
                                           help="the test split's own data: PREFIX or W1 P1 W2 P2 ...")
    data_cache_path: Optional[str] = flag("--data-cache-path", group=DATA, default=None, type=str,
                                          help="folder for the sample, shuffle and blend indices (default: next to "
                                               "the data)")
    # The index cache is on a filesystem every node sees: one rank in all builds (else one rank per node).
    data_cache_shared: bool = flag("--data-cache-shared", group=DATA, default=False,
                                   help="the index cache is on a filesystem every node sees: rank 0 alone builds the "
                                        "indices (default: local rank 0 of each node)")
    mock_data: bool = flag("--mock-data", group=DATA, default=False,
                           help="synthetic learnable tokens (needs --vocab-size)")
    tokenizer_type: Optional[str] = flag("--tokenizer-type", group=DATA, default=None, type=str,
                                         choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HFTokenizer",
                                                  "GPT2BPETokenizer", "NullTokenizer"],
                                         help="the tokenizer the data was preprocessed with (docs/data.md)")
    tokenizer_model: Optional[str] = flag("--tokenizer-model", group=DATA, default=None, type=str,
                                          help="SentencePiece .model file, or a Hugging Face tokenizer folder / "
                                               "tokenizer.json")
    vocab_file: Optional[str] = flag("--vocab-file", group=DATA, default=None, type=str,
                                     help="GPT-2 BPE vocab.json (GPT2BPETokenizer)")
    merge_file: Optional[str] = flag("--merge-file", group=DATA, default=None, type=str,
                                     help="GPT-2 BPE merges.txt (GPT2BPETokenizer)")
    vocab_size: Optional[int] = flag("--vocab-size", group=DATA, default=None, type=int,
                                     help="vocabulary size of NullTokenizer and --mock-data (ids 0..N-1)")
    make_vocab_size_divisible_by: int = flag(
        "--make-vocab-size-divisible-by", group=NETWORK, default=128, type=int, cli_default=None, derived=True,
        help="pad the vocabulary to a multiple of this x --tensor-model-parallel-size (default 128; with --load, the "
             "checkpoint's padded vocabulary is kept)")
    eod_mask_loss: bool = flag("--eod-mask-loss", group=DATA, default=False, help="no loss on end-of-document tokens")
    reset_position_ids: bool = flag("--reset-position-ids", group=DATA, default=False,
                                    help="restart position ids after each end-of-document token")
    reset_attention_mask: bool = flag("--reset-attention-mask", group=DATA, default=False,
                                      help="no attention across end-of-document tokens (documents packed in one "
                                           "sample stay apart)")
    num_workers: int = flag("--num-workers", group=DATA, default=0, help="DataLoader workers (Megatron's default is 2)")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", group=DISTRIBUTED, default=1)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", group=DISTRIBUTED, default=1)
    # Megatron's rule: sequence parallelism is meaningless (and off) without tensor parallelism.
    sequence_parallel: bool = flag("--sequence-parallel", group=DISTRIBUTED, default=False, derived=True,
                                   help="with tensor parallelism: shard the norms' and dropouts' activations along "
                                        "the sequence")
    distributed_backend: Optional[str] = flag("--distributed-backend", group=DISTRIBUTED, default=None, type=str,
                                              choices=["nccl", "gloo", "hccl"],
                                              help="nccl, gloo or hccl (default: the device's: nccl on CUDA, hccl on "
                                                   "Gaudi, gloo on CPU)")
    deepspeed: bool = flag("--deepspeed", group=DEEPSPEED, default=False,
                           help="train under DeepSpeed (ZeRO stage from --zero-stage or the --deepspeed_config JSON)")
    deepspeed_config: Optional[str] = flag("--deepspeed_config", "--deepspeed-config", group=DEEPSPEED, default=None,
                                           type=str, dest="deepspeed_config",
                                           help="DeepSpeed JSON config (its ZeRO section; batch sizes and precision "
                                                "come from the flags)")
    zero_stage: Optional[int] = flag("--zero-stage", group=DEEPSPEED, default=None, type=int, derived=True,
                                     help="ZeRO stage 0-3 (default 0, or the JSON's)")
    use_torch_fsdp2: bool = flag(
        "--use-torch-fsdp2", group=DISTRIBUTED, default=False,
        help="PyTorch FSDP2: each transformer block and the model sharded over the data-parallel ranks "
             "(fully_shard); docs/distributed.md")
    fsdp_reshard_after_forward: bool = flag(
        "--fsdp-reshard-after-forward", group=DISTRIBUTED, default=True, action=argparse.BooleanOptionalAction,
        help="FSDP2: free each block's gathered parameters after its forward and gather them again for backward")
    grad_reduce_in_bf16: bool = flag(
        "--grad-reduce-in-bf16", group=DISTRIBUTED, default=False,
        help="FSDP2: reduce-scatter gradients in BF16 instead of FP32")
    fp8_param_gather: bool = flag(
        "--fp8-param-gather", group=DISTRIBUTED, default=False,
        help="FSDP2: cast each FP8 linear's weight to FP8 on its shard and all-gather it as 1 byte per element")
    # how long a collective waits for a hung rank
    distributed_timeout_minutes: float = flag("--distributed-timeout-minutes", group=DISTRIBUTED, default=10.0,
                                              help="how long a collective waits for a hung rank before the run fails")

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _raise_first("--use-torch-fsdp2", () if not self.use_torch_fsdp2 else (
            (self.deepspeed, "and --deepspeed are two engines: pick one (FSDP2 shards like ZeRO-3)"),
            (self.pipeline_model_parallel_size > 1, "with --pipeline-model-parallel-size > 1 is not supported"),
        ))
        if not self.use_torch_fsdp2:
            for name, set_ in (("--grad-reduce-in-bf16", self.grad_reduce_in_bf16),
                               ("--fp8-param-gather", self.fp8_param_gather),
                               ("--no-fsdp-reshard-after-forward", not self.fsdp_reshard_after_forward)):
                if set_:
                    raise ValueError(f"{name} applies to --use-torch-fsdp2 only: add it, or drop {name}")


@dataclass(frozen=True)
class DivergenceConfig:
    """The divergence guard's rules (megatron/training/divergence.py); `enabled=False` is --no-divergence-guard."""

    enabled: bool = flag("--divergence-guard", group=TRAINING, default=True, action=argparse.BooleanOptionalAction,
                         help="stop a run that explodes without a NaN, before it saves (docs/reliability.md)")
    loss_factor: float = flag(
        "--divergence-loss-factor", group=TRAINING, default=2.5,
        help="the loss must stay above this x its running median for --divergence-patience iterations")
    patience: int = flag("--divergence-patience", group=TRAINING, default=20)
    window: int = flag("--divergence-window", group=TRAINING, default=100,
                       help="iterations in the loss's running median")
    zero_grad_iters: int = flag("--divergence-zero-grad-iters", group=TRAINING, default=10,
                                help="consecutive iterations with a gradient norm of exactly 0")
    max_weight: float = flag("--divergence-max-weight", group=TRAINING, default=1e4, help="largest |weight| allowed")

    def __post_init__(self) -> None:
        checks = ((self.loss_factor > 1.0, f"--divergence-loss-factor must be > 1, got {self.loss_factor}"),
                  (self.patience >= 1, f"--divergence-patience must be >= 1, got {self.patience}"),
                  (self.window >= 1, f"--divergence-window must be >= 1, got {self.window}"),
                  (self.zero_grad_iters >= 1, f"--divergence-zero-grad-iters must be >= 1, got {self.zero_grad_iters}"),
                  (self.max_weight > 0, f"--divergence-max-weight must be > 0, got {self.max_weight}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class MegatronConfig:
    """The whole resolved configuration of a run."""

    model: ModelConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    data: DataConfig
    parallel: ParallelConfig
    fp8: Optional[Fp8Recipe] = None
    device: str = flag("--device", group=PRECISION, default="auto", choices=["auto", "cpu", "cuda", "hpu"])
    divergence: DivergenceConfig = DivergenceConfig()
    fp8_autoheal: Fp8AutohealConfig = Fp8AutohealConfig()
    compat: CompatConfig = CompatConfig()  # upstream flags / env recipe (megatron/compat.py)

    def __post_init__(self) -> None:
        """The checks across the parts: the parallel layout against the model, the engine and the precision."""
        if self.model.smooth_swiglu is not None and self.fp8 is None:
            raise ValueError("--smooth-swiglu only matters for FP8 training: add --fp8-format hybrid (or e4m3)")
        _check_main_params(self)
        _check_fsdp2(self)
        _check_tensor_parallel(self.parallel, self.model)
        _check_pipeline_parallel(self)

    def to_dict(self) -> dict:
        """Plain JSON-able dict (enums as their values); stored in checkpoints instead of a Namespace."""
        return _plain(dataclasses.asdict(self))


def _raise_first(subject: str, unsupported: Tuple[Tuple[bool, str], ...]) -> None:
    for bad, why in unsupported:
        if bad:
            raise ValueError(f"{subject} {why}")


def _check_main_params(config: "MegatronConfig") -> None:
    """--params-dtype bf16 (Megatron's layout): where it is implemented, and what it needs (the ZeRO stage is None
    where neither --zero-stage nor the DeepSpeed JSON gives one)."""
    training, parallel = config.training, config.parallel
    if training.params_dtype == "fp32":
        return
    _raise_first("--params-dtype bf16", (
        (not training.bf16, "needs --bf16 (BF16 compute; the weights themselves become BF16)"),
        (parallel.pipeline_model_parallel_size > 1, "is not supported yet with --pipeline-model-parallel-size > 1"),
        (parallel.deepspeed and parallel.zero_stage == 0,
         "under --deepspeed needs --zero-stage 1, 2 or 3 (got 0): DeepSpeed 0.19 accumulates BF16 weights' "
         "gradients in BF16 without ZeRO (FP32 accumulation is what this layout keeps); without --deepspeed the "
         "torch engine implements it at any data-parallel size"),
        (not parallel.deepspeed and parallel.sequence_parallel,
         "is not supported yet with --sequence-parallel under the torch engine (use --deepspeed --zero-stage 1)"),
    ))


def _check_fsdp2(config: "MegatronConfig") -> None:
    """What FSDP2 does not combine with yet, beyond the parallel layout (ParallelConfig's own checks)."""
    if config.checkpoint.ckpt_format == "torch_dist" and not config.parallel.use_torch_fsdp2:
        raise ValueError("--ckpt-format torch_dist (sharded checkpoints) is built for --use-torch-fsdp2 only: add it, "
                         "or use --ckpt-format torch")
    if config.checkpoint.verify and config.checkpoint.ckpt_format == "torch_dist":
        raise ValueError("--verify-checkpoint is not built for --ckpt-format torch_dist: its files are checked against "
                         "their CRC-32s in manifest.json before a resume; drop --verify-checkpoint")
    if config.checkpoint.async_save and config.checkpoint.ckpt_format != "torch_dist":
        raise ValueError("--async-save writes sharded checkpoints in the background: add --ckpt-format torch_dist "
                         "(with --use-torch-fsdp2)")
    if not config.parallel.use_torch_fsdp2:
        return
    _raise_first("--use-torch-fsdp2", (
        (config.training.params_dtype == "bf16",
         "with --params-dtype bf16: FSDP2 keeps FP32 shards and gathers them in BF16 under --bf16 already; drop "
         "--params-dtype"),
    ))
    if config.parallel.fp8_param_gather:
        _raise_first("--fp8-param-gather", (
            (config.fp8 is None, "gathers FP8 weights: add --fp8-format hybrid (or e4m3)"),
            (config.fp8 is not None and config.fp8.tiles is not None,
             f"is not built for the tile recipes (--fp8-recipe {config.fp8.scaling.value if config.fp8 else ''}): "
             "use delayed or tensorwise scaling, or drop --fp8-param-gather"),
        ))


def _check_tensor_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    tp = parallel.tensor_model_parallel_size
    if tp == 1:
        return
    for flag_name, value in (("--num-attention-heads", model.num_attention_heads),
                             ("--num-key-value-heads", model.num_key_value_heads),
                             ("--ffn-hidden-size", model.ffn_hidden_size)):
        if value % tp:
            raise ValueError(f"{flag_name} {value} must be divisible by --tensor-model-parallel-size {tp}: "
                             "each tensor-parallel rank holds whole heads / FFN channels")
    if parallel.sequence_parallel and model.seq_length % tp:
        raise ValueError(f"--sequence-parallel needs --seq-length ({model.seq_length}) divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if model.add_bias_linear:
        raise ValueError("--tensor-model-parallel-size > 1 needs --disable-bias-linear: biases of row-parallel "
                         "linears are not supported yet")


def _check_pipeline_parallel(config: "MegatronConfig") -> None:
    parallel, model, data = config.parallel, config.model, config.data
    pp, zero_stage = parallel.pipeline_model_parallel_size, parallel.zero_stage
    if pp == 1:
        return
    _raise_first(f"--pipeline-model-parallel-size {pp}", (
        (not parallel.deepspeed, "needs --deepspeed (the stages run under DeepSpeed's PipelineEngine)"),
        (zero_stage not in (None, 0, 1), f"needs --zero-stage 0 or 1 (got {zero_stage}): DeepSpeed's pipeline "
                                         "engine refuses ZeRO 2/3"),
        (not model.untie_embeddings_and_output_weights,
         "needs --untie-embeddings-and-output-weights: a tied embedding would live on the first and the last stage"),
        (data.reset_position_ids or data.reset_attention_mask,
         "with --reset-position-ids / --reset-attention-mask is not supported yet (stages exchange hidden states "
         "only)"),
        (model.recompute_granularity is RecomputeGranularity.FULL and model.recompute_method != "uniform",
         "with --recompute-granularity full needs --recompute-method uniform (DeepSpeed checkpoints every "
         "--recompute-num-layers layers of a stage)"),
        (model.num_layers % pp != 0, f"needs --num-layers ({model.num_layers}) divisible by it: each stage gets "
                                     "the same number of transformer layers"),
    ))


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
