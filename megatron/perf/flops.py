"""Analytic parameter count, FLOPs per iteration and a per-device memory estimate.

Used by the log line (TFLOP/s) and by `--dry-run`, which must work for a 7B configuration without
building the model, so everything here is computed from the config alone.
"""
from __future__ import annotations

from megatron.config import (
    MegatronConfig, ModelConfig, PositionEmbedding, RecomputeGranularity, SmoothSwiGLUGranularity,
)


def sharding_stage(cfg: MegatronConfig) -> int:
    """What the data-parallel ranks shard, as a ZeRO stage: 1 the optimizer state, 2 also the gradients, 3 also the
    parameters. FSDP2 (`--use-torch-fsdp2`) shards all three: 3."""
    p = cfg.parallel
    return 3 if p.use_torch_fsdp2 else (p.zero_stage or 0)


def block_linear_weights(m: ModelConfig) -> dict[str, int]:
    """Elements of each weight matrix of one transformer block (TP = 1)."""
    return {"qkv": m.hidden_size * (m.query_projection_size + 2 * m.kv_projection_size),
            "proj": m.query_projection_size * m.hidden_size,
            "fc1": m.hidden_size * m.ffn_hidden_size * (2 if m.swiglu else 1),
            "fc2": m.ffn_hidden_size * m.hidden_size}


def _block_linear_params(m: ModelConfig) -> int:
    params = sum(block_linear_weights(m).values())
    if m.add_bias_linear:
        params += (m.query_projection_size + 2 * m.kv_projection_size) + m.hidden_size
        params += m.ffn_hidden_size * (2 if m.swiglu else 1) + m.hidden_size
    return params


def count_parameters(m: ModelConfig) -> int:
    """Exactly `sum(p.numel() for p in GPTModel(m).parameters())` (checked by a test)."""
    norm = m.hidden_size * (2 if (m.normalization.value == "LayerNorm" and m.add_bias_linear) else 1)
    per_layer = _block_linear_params(m) + 2 * norm
    total = m.num_layers * per_layer + norm  # + final norm
    total += m.padded_vocab_size * m.hidden_size  # word embeddings
    if m.position_embedding_type is PositionEmbedding.LEARNED_ABSOLUTE:
        total += m.max_position_embeddings * m.hidden_size
    if m.untie_embeddings_and_output_weights:
        total += m.padded_vocab_size * m.hidden_size
    return total


def flops_per_token_forward(m: ModelConfig) -> float:
    """Matmul FLOPs (2 per multiply-add) of one token's forward pass, attention counted in full."""
    linear = 2.0 * m.num_layers * _block_linear_params(m)
    attention = m.num_layers * 4.0 * m.seq_length * m.query_projection_size  # QK^T and AV
    head = 2.0 * m.hidden_size * m.padded_vocab_size
    return linear + attention + head


def flops_per_iteration(m: ModelConfig, global_batch_size: int) -> float:
    """Forward + backward (2x forward), plus one more forward with full activation recompute."""
    passes = 4.0 if m.recompute_granularity is RecomputeGranularity.FULL else 3.0
    return passes * flops_per_token_forward(m) * global_batch_size * m.seq_length


def memory_estimate_bytes(cfg: MegatronConfig) -> dict[str, float]:
    """A rough per-device estimate in GiB: weights, gradients, master weights, optimizer state, activations.

    Default layout (--params-dtype fp32): FP32 weights (they are the master weights) and FP32 gradients;
    DeepSpeed ZeRO >= 1 still keeps its own FP32 copy of each rank's partition (counted as master).
    Megatron's layout (--params-dtype bf16): BF16 weights, FP32 main gradients and an FP32 master copy that
    lives with the optimizer state (ZeRO >= 1 shards it like the moments). AdamW keeps 8 bytes/param of
    moments, Fp8AdamW about 2; ZeRO stages divide what they shard by the data-parallel size; TP/PP divide
    the model.
    Activations follow Korthikanti et al. (sbh(34 + 5as/h) bytes per layer in 16-bit, no recompute). With FP8
    linears the inputs that QKV, the attention projection, fc1 and fc2 save for backward are kept in 1 byte
    instead of 2: per FP8 layer s*b*(3h + ffn) bytes less (fc2's input is ffn wide; its term stays with
    --fp8-mlp-fc2-bf16, and --fp8-first-last-layers-bf16 layers save nothing). Full recompute keeps only the
    layer inputs (BF16), so FP8 changes nothing there.

    Not in the total: `fp8_weights_in_step_GiB`, the FP8 copies of the FP8 layers' weights that exist during a
    step (made at the step's first forward, dropped by the scaling update after the optimizer step): 2 bytes per
    weight with real FP8 GEMMs (the E4M3 weight and, for `torch._scaled_mm`'s dgrad, its transpose; Transformer
    Engine keeps the same pair), for one linear at a time under ZeRO-3 (each layer quantizes per call there). The
    emulated CPU GEMM keeps 5 (FP8 + its FP32 values). It is the step's peak, like the activations, not state
    that persists between steps.
    """
    m, t, p = cfg.model, cfg.training, cfg.parallel
    model_split = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    params = count_parameters(m) / model_split
    dp = t.data_parallel_size
    zero = sharding_stage(cfg)
    opt_bytes = 2.0 if cfg.optimizer.optimizer == "fp8adam" else 8.0
    bf16_params = cfg.training.params_dtype == "bf16"
    weights = params * (2.0 if bf16_params else 4.0) / (dp if zero >= 3 else 1)
    grads = params * 4.0 / (dp if zero >= 2 else 1)  # FP32 either way (main gradients in the BF16 layout)
    # DeepSpeed ZeRO >= 1 copies FP32 weights into its FP32 partitions too (the default layout's master, sharded)
    separate_master = bf16_params or (p.deepspeed and zero >= 1)
    master = params * 4.0 / (dp if zero >= 1 else 1) if separate_master else 0.0
    optim = params * opt_bytes / (dp if zero >= 1 else 1)
    s, b, h, a = m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    layers = m.num_layers / p.pipeline_model_parallel_size
    if m.recompute_granularity is RecomputeGranularity.FULL:
        # only the layer inputs are kept: each TP rank its share of the tokens under sequence parallelism
        act = s * b * h * 2.0 * layers / (p.tensor_model_parallel_size if p.sequence_parallel else 1)
    elif m.recompute_granularity is RecomputeGranularity.SELECTIVE:
        act = s * b * h * 34.0 * layers / p.tensor_model_parallel_size
    else:
        act = s * b * h * (34.0 + 5.0 * a * s / h) * layers / p.tensor_model_parallel_size
    if cfg.fp8 is not None and m.recompute_granularity is not RecomputeGranularity.FULL:
        fp8_layers = max(m.num_layers - 2 * cfg.fp8.first_last_layers_bf16, 0) / p.pipeline_model_parallel_size
        saved_bytes_per_token = 3.0 * h + (0.0 if cfg.fp8.mlp_fc2_bf16 else float(m.ffn_hidden_size))
        act -= s * b * saved_bytes_per_token * fp8_layers / p.tensor_model_parallel_size
    gib = 2.0**30
    out = {"weights_GiB": weights / gib, "grads_GiB": grads / gib, "master_GiB": master / gib,
           "optimizer_GiB": optim / gib, "activations_GiB": act / gib}
    out["total_GiB"] = sum(out.values())
    out["fp8_weights_in_step_GiB"] = fp8_weight_copy_bytes(cfg) / gib
    return out


def fp8_gathered_parameters(cfg: MegatronConfig) -> float:
    """Parameters per device that FSDP2 gathers in FP8 under --fp8-param-gather (megatron/training/fp8_gather.py):
    the FP8 layers' weight matrices, less fc2 where it stays BF16 or scales its weight columns per call
    (Smooth-SwiGLU's channel form)."""
    m, p = cfg.model, cfg.parallel
    if cfg.fp8 is None or not (p.use_torch_fsdp2 and p.fp8_param_gather):
        return 0.0
    column_scaled = m.smooth_swiglu is SmoothSwiGLUGranularity.CHANNEL
    linears = [n for name, n in block_linear_weights(m).items()
               if not (name == "fc2" and (cfg.fp8.mlp_fc2_bf16 or column_scaled))]
    fp8_layers = max(m.num_layers - 2 * cfg.fp8.first_last_layers_bf16, 0)
    return sum(linears) * fp8_layers / (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def fp8_weight_copy_bytes(cfg: MegatronConfig) -> float:
    """Bytes of FP8 weight copies one device holds during a step with real FP8 GEMMs (see memory_estimate_bytes)."""
    m, p = cfg.model, cfg.parallel
    if cfg.fp8 is None:
        return 0.0
    linears = [n for name, n in block_linear_weights(m).items() if not (name == "fc2" and cfg.fp8.mlp_fc2_bf16)]
    fp8_layers = max(m.num_layers - 2 * cfg.fp8.first_last_layers_bf16, 0)
    if not fp8_layers:
        return 0.0
    if sharding_stage(cfg) >= 3:  # FP8 weights cast per call (ZeRO-3, FSDP2): one layer's copy at a time
        return 2.0 * max(linears) / p.tensor_model_parallel_size
    return 2.0 * sum(linears) * fp8_layers / (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
