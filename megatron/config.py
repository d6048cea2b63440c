"""Typed, frozen configuration objects.

`megatron.arguments.parse_config` is the only code that reads the argparse Namespace; it returns a
`MegatronConfig` made of the dataclasses below. Every component receives only its own slice
(the model gets `ModelConfig`, the optimizer factory `OptimizerConfig`, ...). Values derived from
several flags (padded vocabulary, gradient-accumulation steps) are computed once, at parse time or
when the tokenizer is known, never re-derived downstream.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from megatron.compat import CompatConfig
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
    """Shape and regularisation of the Llama-style GPT (Megatron-Core `TransformerConfig` analogue)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    padded_vocab_size: int
    kv_channels: int
    normalization: Normalization = Normalization.RMSNORM
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    position_embedding_type: PositionEmbedding = PositionEmbedding.ROPE
    rotary_base: float = 10000.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    recompute_granularity: Optional[RecomputeGranularity] = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    smooth_swiglu: Optional[SmoothSwiGLUGranularity] = None

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_key_value_heads


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (or Fp8Adam) hyper-parameters and Megatron's parameter-group rule."""

    optimizer: str = "adam"  # "adam" (decoupled AdamW, as in Megatron) or "fp8adam"
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    fp8_m_dtype: str = "e4m3"
    fp8_v_dtype: str = "e5m2"
    fp8_block_size: int = 0
    fp8_stochastic_rounding: bool = True
    # Fp8AdamW's update through torch.compile (--no-fp8-optimizer-compile: eager); falls back to eager with
    # a warning where compiling fails.
    fp8_compile: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule, resolved to iterations."""

    lr: float
    min_lr: float
    decay_style: LrDecayStyle
    warmup_iters: int
    decay_iters: int


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int
    global_batch_size: int
    data_parallel_size: int
    train_iters: int
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_on_stall_seconds: Optional[float] = None  # no iteration finished for this long ends the process
    exit_signal_handler: bool = False
    max_consecutive_nan_steps: int = 10
    bf16: bool = False
    # "fp32": the weights are the master weights; "bf16": Megatron's layout (BF16 weights, FP32 main grads, FP32
    # master copy with the optimizer state; megatron/optimizer/main_params.py), --params-dtype
    params_dtype: str = "fp32"
    dry_run: bool = False
    project_on: Tuple[str, ...] = ()  # --project-on: devices the dry run projects this run on (megatron/perf)
    project_devices: Optional[int] = None  # --project-devices: how many of them (default: the world size)
    # --torch-compile: "auto" (on for CUDA, off on CPU: docs/performance.md), "on" or "off"; per transformer block
    torch_compile: str = "auto"

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    verify: bool = False  # --verify-checkpoint: each file read back and compared before the commit
    keep_last: Optional[int] = None  # --keep-last-n-checkpoints: older checkpoints removed after each save
    exit_on_save_failure: int = 3  # failed interval saves in a row that end the run
    fallback: bool = True  # a resume loads the newest checkpoint that matches its manifest (not --no-checkpoint-fallback)


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    log_fp8_stats: bool = False
    log_swiglu_diagnostics: bool = True
    log_batch_size: bool = False  # --log-batch-size-to-tensorboard
    log_timers: bool = False  # --log-timers-to-tensorboard


@dataclass(frozen=True)
class DataConfig:
    """What to read and how to tokenize it. Paths are kept as given on the command line."""

    data_path: Tuple[str, ...] = ()
    split: str = "969,30,1"
    train_data_path: Tuple[str, ...] = ()
    valid_data_path: Tuple[str, ...] = ()
    test_data_path: Tuple[str, ...] = ()
    data_cache_path: Optional[str] = None
    # The index cache is on a filesystem every node sees: one rank in all builds (else one rank per node).
    data_cache_shared: bool = False
    mock_data: bool = False
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    num_workers: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    distributed_backend: Optional[str] = None
    deepspeed: bool = False
    deepspeed_config: Optional[str] = None
    zero_stage: Optional[int] = None
    distributed_timeout_minutes: float = 10.0  # how long a collective waits for a hung rank

    def __post_init__(self) -> None:
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}")


@dataclass(frozen=True)
class DivergenceConfig:
    """The divergence guard's rules (megatron/training/divergence.py); `enabled=False` is --no-divergence-guard."""

    enabled: bool = True
    loss_factor: float = 2.5
    patience: int = 20
    window: int = 100
    zero_grad_iters: int = 10
    max_weight: float = 1e4

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
    device: str = "auto"
    divergence: DivergenceConfig = DivergenceConfig()
    fp8_autoheal: Fp8AutohealConfig = Fp8AutohealConfig()
    compat: CompatConfig = CompatConfig()  # upstream flags / env recipe (megatron/compat.py)

    def to_dict(self) -> dict:
        """Plain JSON-able dict (enums as their values); stored in checkpoints instead of a Namespace."""
        return _plain(dataclasses.asdict(self))


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
