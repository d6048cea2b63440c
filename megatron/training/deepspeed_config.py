"""The DeepSpeed JSON of a run: generated from our flags, or a user's file checked against them.

The flags stay the single source of truth. A user JSON (`--deepspeed_config ds.json`) may carry
DeepSpeed-only settings (bucket sizes, overlap, ...); every key that our flags also decide must agree
with them, and keys it omits are filled from the flags:

| DeepSpeed key                                   | our flag                                       |
|-------------------------------------------------|------------------------------------------------|
| `train_batch_size`                              | `--global-batch-size`                          |
| `train_micro_batch_size_per_gpu`                | `--micro-batch-size`                           |
| `gradient_accumulation_steps`                   | global / (micro x data-parallel size)          |
| `gradient_clipping`                             | `--clip-grad` (0 = off in both)                |
| `zero_optimization.stage`                       | `--zero-stage` (default 0)                     |
| `torch_autocast.enabled`, `.dtype`              | `--bf16` (BF16 autocast, FP32 master weights)  |
| `bf16.enabled`, `data_types.grad_accum_dtype`   | `--params-dtype bf16` (true, fp32; ZeRO 1-3)   |
| `pipeline.pipe_partitioned`, `.grad_partitioned`| false under `--sequence-parallel` with PP x TP |

Why `--bf16` is DeepSpeed's `torch_autocast` and not its `bf16` section: our `--bf16` means FP32
weights with BF16 autocast around the forward (the FP32 weights are the master weights). DeepSpeed's
`bf16.enabled` instead casts the module to BF16 (the FP32 master copy lives in the optimizer) and,
without ZeRO, accumulates gradients in BF16. That is another recipe (FP8 linears and Fp8AdamW are
tested on FP32 weights), so `bf16.enabled: true` is refused with a message saying what to write
instead. `torch_autocast` (DeepSpeed >= 0.17) keeps the module in FP32 and runs the engine's forward
under `torch.autocast`, which is exactly our recipe. We generate `lower_precision_safe_modules: []`
so gradients are communicated in FP32 as with torch DDP; a user JSON may list modules there to
reduce their gradients in BF16 instead.

`--params-dtype bf16` (Megatron's layout, opt-in) is where DeepSpeed's `bf16` section belongs: the module
in BF16, `data_types.grad_accum_dtype: fp32` (FP32 main gradients) and the FP32 master copy in ZeRO's
partitions (ZeRO 1: DeepSpeed's BF16_Optimizer; ZeRO 2 and 3: its ZeRO optimizers; ZeRO-3 reduce-scatters each
micro-batch's gradient and accumulates the pieces in FP32: docs/memory.md), with our AdamW/Fp8AdamW as
the client optimizer stepping the FP32 partitions. `torch_autocast` stays on with it (same compute as
--bf16). ZeRO 0 is refused: DeepSpeed 0.19 accumulates BF16 gradients in BF16 without ZeRO.

Pipeline x tensor parallelism: DeepSpeed's pipeline sends each TP rank only its 1/tp slice of the stage's
output (and of the gradient coming back), and the receiving stage all-gathers the slices from its TP peers.
That assumes every TP rank holds the same tensor, which is true between stages without sequence parallelism
and false with it (each TP rank holds its own part of the sequence), so `--sequence-parallel` turns both
partitionings off, and a JSON asking for them is refused.

ZeRO-3 with FP8 linears and Fp8AdamW: ZeRO-3 gathers a layer's weight for its forward (and again for its
backward); an `Fp8Linear` quantizes the gathered weight, the same values with the same scale as unpartitioned,
so its GEMMs are those of ZeRO 0-2 (its amaxes and delayed-scaling state never see a partition). DeepSpeed steps
the optimizer once per *sub-group*, each call seeing only that sub-group's flat partition, so Fp8AdamW numbers
every sub-group's partition as its first tensor: sub-groups of one param group would share their stochastic-
rounding streams. With Fp8AdamW we therefore generate `sub_group_size` 1e12 (one sub-group per param group,
DeepSpeed's ZeRO-3 optimizer's own default; without offload, which we refuse, sub-groups only batch the step)
and refuse a JSON value below the parameter count. The engine's side is in `deepspeed_engine.py`.
ZeRO-3 builds the model partitioned with DeepSpeed's `zero.Init(module=part)` (`megatron/model/build.py`), given
this config: with `zero_optimization.memory_efficient_linear` (DeepSpeed's default: true) it replaces
`torch.nn.functional.linear` in the whole process by DeepSpeed's own linear function, as `deepspeed.initialize`
did when it partitioned the model itself; the ZeRO-3 losses are therefore those of before (with `false`, models
with biases train on torch's F.linear and move by rounding: ~1e-4 in the loss over 4 tiny steps, measured).

ZeRO-3 with `--tensor-model-parallel-size > 1` is refused: DeepSpeed's consolidation of ZeRO-3 partitions
(`zero_to_fp32`, which our checkpoint reader and its tools use) reads model-parallel rank 0 only, and
ZeRO-3's parameter gathering has not been run on our TP-sharded modules. ZeRO 0, 1 and 2 work with TP.

Refused because they would silently fight our own components: an `optimizer` or `scheduler` section
(our AdamW/Fp8AdamW and LR schedule drive the run), `fp16` (use `--bf16`), ZeRO offload (not tested
with our client optimizers), `zero_optimization.compute_grad_norm: false` (the norm decides whether a
step is skipped), and `zero_allow_untested_optimizer: false` (our optimizers are not on DeepSpeed's
list, so ZeRO needs it).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

from megatron.config import MegatronConfig

# DeepSpeed allocates reduce/all-gather buckets of this many elements per rank. Its default (5e8
# elements = 2 GB in FP32, twice with overlap_comm) dominates memory and start-up time of small and
# CPU runs; 5e7 is still large enough to batch the gradients of a 7B model into few collectives, and
# a run whose model is smaller gets buckets of the model's size.
DEFAULT_BUCKET_SIZE = 50_000_000
SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed's ZeRO-3 optimizer's own default (its config's 1e9 would split a large param group): larger than any
# model's parameter count, so each param group is one sub-group.
ZERO3_ONE_SUB_GROUP = 10**12


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed JSON that disagrees with the flags or asks for something unsupported."""


def load_json(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: file not found")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(f"--deepspeed_config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"--deepspeed_config {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _section(ds: dict, key: str, source: str) -> dict:
    value = ds.setdefault(key, {})
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"{source}: `{key}` must be an object, got {value!r}")
    return value


def _agree(ds: dict, key: str, expected: Any, flag: str, source: str, label: Optional[str] = None) -> None:
    """Fill `ds[key]` from the flags, or check that the JSON's value matches them."""
    if key not in ds:
        ds[key] = expected
        return
    value = ds[key]
    same = (float(value) == float(expected)) if isinstance(expected, (int, float)) and not isinstance(
        expected, bool) and isinstance(value, (int, float)) else value == expected
    if not same:
        raise DeepSpeedConfigError(f"{source}: `{label or key}` is {value!r} but {flag} gives {expected!r}; "
                                   f"make them agree (or drop `{label or key}` from the JSON to take it from the flags)")


def _is_bf16_dtype(value: Any) -> bool:
    return str(value).lower() in ("bf16", "bfloat16", "torch.bfloat16")


def _check_bf16_params(ds: dict, stage: int, source: str) -> None:
    """--params-dtype bf16: DeepSpeed's own bf16 mode (module cast to BF16, FP32 master partitions in its
    optimizer wrapper) with FP32 gradient accumulation. ZeRO-1 then runs DeepSpeed's BF16_Optimizer (FP32
    accumulation buffer, FP32 master partition), ZeRO-2 and ZeRO-3 their ZeRO optimizers over BF16 weights
    (ZeRO-3: FP32 gradient partitions, `grad_accum_dtype` being their dtype; deepspeed_zero3 casts the
    partitions to BF16, `zero3_cast_partitions_to_bf16`)."""
    if stage not in (1, 2, 3):
        raise DeepSpeedConfigError(f"{source}: --params-dtype bf16 needs ZeRO stage 1, 2 or 3 (the config gives "
                                   f"{stage}): DeepSpeed 0.19 accumulates BF16 weights' gradients in BF16 without ZeRO")
    section = next((k for k in ("bf16", "bfloat16") if k in ds), "bf16")
    bf16 = _section(ds, section, source)
    if bf16.setdefault("enabled", True) is not True:
        raise DeepSpeedConfigError(f"{source}: `{section}.enabled` is false but --params-dtype bf16 keeps the weights in "
                                   "BF16 through DeepSpeed's bf16 mode; drop the key or set it true")
    # ZeRO-1's BF16_Optimizer then adds each BF16 gradient into its FP32 buffer as backward produces it and frees
    # it; without, every BF16 gradient also stays alive until the step (2 bytes/param more, measured:
    # bench/bench_memory.py).
    bf16.setdefault("immediate_grad_update", True)
    data_types = _section(ds, "data_types", source)
    accum = data_types.setdefault("grad_accum_dtype", "fp32")
    if str(accum).lower() not in ("fp32", "float32", "torch.float32"):
        raise DeepSpeedConfigError(f"{source}: `data_types.grad_accum_dtype` is {accum!r}; --params-dtype bf16 "
                                   "accumulates gradients in FP32 (Megatron's main gradients): set it to fp32")


def _check_precision(ds: dict, bf16: bool, source: str, bf16_params: bool = False) -> None:
    for key in ("fp16", "float16"):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled", False):
            raise DeepSpeedConfigError(f"{source}: `{key}.enabled` is true, but FP16 training is not supported: "
                                       "remove the section and pass --bf16 for BF16 autocast")
    for key in ("bf16", "bfloat16"):
        if not bf16_params and isinstance(ds.get(key), dict) and ds[key].get("enabled", False):
            raise DeepSpeedConfigError(
                f"{source}: `{key}.enabled` is true, which makes DeepSpeed cast the model to BF16. megatron-fp8's "
                "--bf16 is BF16 autocast with FP32 weights, i.e. DeepSpeed's `torch_autocast` section: remove "
                f"`{key}` (or set `enabled` false) and pass --bf16; `torch_autocast` is then filled in for you. "
                "For BF16 weights with an FP32 master copy in the optimizer, pass --params-dtype bf16")
    autocast = ds.get("torch_autocast")
    if autocast is None:
        if bf16:
            ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
        return
    if not isinstance(autocast, dict):
        raise DeepSpeedConfigError(f"{source}: `torch_autocast` must be an object, got {autocast!r}")
    enabled = bool(autocast.get("enabled", False))
    if enabled != bf16:
        raise DeepSpeedConfigError(f"{source}: `torch_autocast.enabled` is {str(enabled).lower()} but --bf16 is "
                                   f"{'given' if bf16 else 'not given'}; make them agree")
    if enabled:
        dtype = autocast.setdefault("dtype", "bfloat16")
        if not _is_bf16_dtype(dtype):
            raise DeepSpeedConfigError(f"{source}: `torch_autocast.dtype` is {dtype!r}; only bfloat16 is supported "
                                       "(--bf16). FP16 training is not supported")
        autocast.setdefault("lower_precision_safe_modules", [])


def _check_zero(ds: dict, flag_stage: Optional[int], source: str, bucket: int) -> int:
    zero = _section(ds, "zero_optimization", source)
    if "stage" in zero and flag_stage is not None and int(zero["stage"]) != flag_stage:
        raise DeepSpeedConfigError(f"{source}: `zero_optimization.stage` is {zero['stage']} but --zero-stage gives "
                                   f"{flag_stage}; make them agree (or drop one of them)")
    stage = int(zero.setdefault("stage", flag_stage if flag_stage is not None else 0))
    if stage not in SUPPORTED_ZERO_STAGES:
        raise DeepSpeedConfigError(f"{source}: ZeRO stage {stage} does not exist; use --zero-stage 0, 1, 2 or 3")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none") if isinstance(zero.get(key), dict) else "none"
        if device not in (None, "none"):
            raise DeepSpeedConfigError(f"{source}: `zero_optimization.{key}` (device {device!r}) is not supported "
                                       "yet with megatron-fp8's optimizers; remove it")
    if zero.get("compute_grad_norm", True) is False:
        raise DeepSpeedConfigError(f"{source}: `zero_optimization.compute_grad_norm` must stay true: the gradient "
                                   "norm decides whether a step with non-finite gradients is skipped")
    if stage in (1, 2):
        zero.setdefault("reduce_bucket_size", bucket)
        zero.setdefault("allgather_bucket_size", bucket)
    if stage == 3:
        zero.setdefault("reduce_bucket_size", bucket)
    return stage


def _check_zero3_fp8adam_sub_groups(zero: dict, num_parameters: Optional[int], source: str) -> None:
    """ZeRO-3 with Fp8AdamW: one optimizer sub-group per param group (module docstring, "ZeRO-3")."""
    size = zero.setdefault("sub_group_size", ZERO3_ONE_SUB_GROUP)
    if num_parameters is not None and int(size) < num_parameters:
        raise DeepSpeedConfigError(f"{source}: `zero_optimization.sub_group_size` {size} splits the model's "
                                   f"{num_parameters} parameters into several sub-groups, which Fp8AdamW would step "
                                   "with the same stochastic-rounding streams; drop the key (one sub-group per "
                                   f"param group) or set it to at least {num_parameters}")


def _check_pipeline_partitioning(ds: dict, source: str) -> None:
    """Sequence parallel between pipeline stages: each TP rank sends its own sequence part whole (module docstring)."""
    pipeline = _section(ds, "pipeline", source)
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipeline.setdefault(key, False) is not False:
            raise DeepSpeedConfigError(f"{source}: `pipeline.{key}` must be false with --sequence-parallel: DeepSpeed "
                                       "would split the stage's activations over the TP ranks assuming they are "
                                       "identical, but each TP rank holds its own part of the sequence")


def build_deepspeed_config(config: MegatronConfig, user_json: Optional[dict] = None,
                           num_parameters: Optional[int] = None) -> dict:
    """The DeepSpeed config dict for `deepspeed.initialize`, validated against the flags.

    `user_json` defaults to the file named by `--deepspeed_config`; without one, everything comes from
    the flags. `num_parameters` caps the generated ZeRO bucket sizes (a bucket larger than the model
    is only memory). Raises `DeepSpeedConfigError` (a ValueError) naming the JSON key and the flag.
    """
    p, t = config.parallel, config.training
    if user_json is None and p.deepspeed_config:
        user_json = load_json(p.deepspeed_config)
    source = f"--deepspeed_config {p.deepspeed_config}" if p.deepspeed_config else "DeepSpeed config"
    ds = copy.deepcopy(user_json) if user_json is not None else {}
    for key, what in (("optimizer", "--optimizer and the --adam-* flags"),
                      ("scheduler", "--lr, --lr-decay-style, --lr-warmup-* and friends")):
        if key in ds:
            raise DeepSpeedConfigError(f"{source}: remove the `{key}` section; {what} decide it in megatron-fp8")
    _agree(ds, "train_batch_size", t.global_batch_size, "--global-batch-size", source)
    _agree(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, "--micro-batch-size", source)
    _agree(ds, "gradient_accumulation_steps", t.num_micro_batches,
           f"--global-batch-size {t.global_batch_size} / (--micro-batch-size {t.micro_batch_size} x "
           f"data-parallel size {t.data_parallel_size})", source)
    _agree(ds, "gradient_clipping", config.optimizer.clip_grad, "--clip-grad", source)
    bf16_params = t.params_dtype == "bf16"
    _check_precision(ds, t.bf16, source, bf16_params)
    bucket = min(DEFAULT_BUCKET_SIZE, num_parameters) if num_parameters else DEFAULT_BUCKET_SIZE
    stage = _check_zero(ds, p.zero_stage, source, bucket)
    if bf16_params:
        _check_bf16_params(ds, stage, source)
    if stage == 3 and config.optimizer.optimizer == "fp8adam":
        _check_zero3_fp8adam_sub_groups(ds["zero_optimization"], num_parameters, source)
    if stage == 3 and p.tensor_model_parallel_size > 1:
        raise DeepSpeedConfigError(f"ZeRO stage 3 (--zero-stage 3 or `zero_optimization.stage` 3) is not supported with "
                                   f"--tensor-model-parallel-size {p.tensor_model_parallel_size}: DeepSpeed's ZeRO-3 "
                                   "consolidation (zero_to_fp32) reads model-parallel rank 0 only, so the checkpoint "
                                   "could not be read back; use --zero-stage 0, 1 or 2")
    if p.pipeline_model_parallel_size > 1 and p.tensor_model_parallel_size > 1 and p.sequence_parallel:
        _check_pipeline_partitioning(ds, source)
    if ds.setdefault("zero_allow_untested_optimizer", True) is not True:
        raise DeepSpeedConfigError(f"{source}: `zero_allow_untested_optimizer` must be true: megatron-fp8 passes its "
                                   "own AdamW/Fp8AdamW to DeepSpeed, which ZeRO calls 'untested'")
    # Our TrainingLogger reports progress; DeepSpeed's own per-step lines would only duplicate it.
    ds.setdefault("steps_per_print", 2**31 - 1)
    return ds


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
