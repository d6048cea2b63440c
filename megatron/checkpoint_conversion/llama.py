"""Our `GPTModel` <-> Hugging Face `LlamaForCausalLM`: config and state-dict mapping (pure functions).

Both models are the same network, so the mapping is a renaming plus two re-slicings:

* `self_attention.linear_qkv` is grouped per key/value head (Megatron's layout, see
  `megatron/model/transformer.py`): for each of the G kv groups, [its H/G query heads | key | value],
  each head_dim rows. HF keeps three matrices, `q_proj` (query heads in order), `k_proj`, `v_proj`.
  Query head h belongs to group h // (H/G) in both models (HF's `repeat_kv` is our
  `repeat_interleave`), so un-grouping is a view and two slices, and no head is permuted.
* `mlp.linear_fc1` is [gate | up] (h = silu(gate) * up): HF's `gate_proj` and `up_proj`.

RoPE needs no permutation: our `apply_rotary` already uses HF's "rotate_half" layout (the Meta
checkpoints' interleaved layout is the one that needs it). RMSNorm is computed in FP32 by both.

Only what Llama can express is converted: RMSNorm, SwiGLU, RoPE, no biases. FP8 scaling state and
optimizer state are not part of the model's state dict and are dropped by the callers.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megatron.config import ModelConfig, Normalization, PositionEmbedding

_LAYER_RENAMES = {  # ours -> HF, inside `decoder.layers.{i}.` / `model.layers.{i}.`
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


class NotLlamaCompatibleError(ValueError):
    """A checkpoint (or HF config) that the Llama architecture cannot represent; says which feature."""


def check_llama_compatible(config: ModelConfig) -> None:
    """Raise `NotLlamaCompatibleError` naming every feature Llama lacks (and the flag that set it)."""
    problems = []
    if config.normalization is not Normalization.RMSNORM:
        problems.append(f"normalization {config.normalization.value} (Llama uses RMSNorm: --normalization RMSNorm)")
    if not config.swiglu:
        problems.append("a GeLU MLP (Llama uses SwiGLU: --swiglu)")
    if config.add_bias_linear:
        problems.append("biases in the linear layers (Llama has none: --disable-bias-linear)")
    if config.position_embedding_type is not PositionEmbedding.ROPE:
        problems.append(f"{config.position_embedding_type.value} position embeddings "
                        "(Llama uses RoPE: --use-rotary-position-embeddings)")
    if problems:
        raise NotLlamaCompatibleError("this checkpoint cannot be expressed as a Llama model: it has "
                                      + "; ".join(problems))


def fold_smooth_swiglu_scales(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights to export for a (possibly `--smooth-swiglu`) model.

    Smooth-SwiGLU's scales are recomputed per micro-batch and undone after fc2: an exact
    re-parametrisation, not parameters, so a smooth model's weights already are plain SwiGLU weights
    and export unchanged. Folding calibrated per-channel scales into the weights (an FP8-inference
    optimisation) is `megatron.model.smooth_swiglu.fold_smooth_swiglu_scales(state, config, scales)`.
    """
    if config.smooth_swiglu is None:
        return state_dict
    from megatron.model.smooth_swiglu import fold_smooth_swiglu_scales as fold

    return fold(state_dict, config, None)


# ------------------------------------------------------------------------------------------ config
def to_hf_config(config: ModelConfig, dtype: str = "float32", bos_token_id: Optional[int] = None,
                 eos_token_id: Optional[int] = None) -> dict[str, Any]:
    """The `config.json` of the equivalent `LlamaForCausalLM` (readable by transformers 4.x and 5.x)."""
    check_llama_compatible(config)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_epsilon,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta: write both, they agree.
        "rope_theta": config.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.padded_vocab_size,  # the padded embedding table: ids past the tokenizer are unused
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": config.init_method_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in (None, "default"):
            raise NotLlamaCompatibleError(f"RoPE scaling type {kind!r} is not supported by GPTModel "
                                          "(only plain RoPE with --rotary-base)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def from_hf_config(hf: dict[str, Any], seq_length: Optional[int] = None) -> ModelConfig:
    """Our `ModelConfig` for an HF Llama `config.json` dict; refuses what GPTModel cannot run."""
    if hf.get("model_type", "llama") != "llama":
        raise NotLlamaCompatibleError(f"model_type {hf.get('model_type')!r} is not 'llama'")
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, allowed) != allowed:
            raise NotLlamaCompatibleError(f"{key}={hf[key]!r} is not supported (GPTModel needs {key}={allowed!r})")
    if hf.get("pretraining_tp", 1) != 1:
        raise NotLlamaCompatibleError("pretraining_tp != 1 is not supported")
    heads = hf["num_attention_heads"]
    max_pos = hf["max_position_embeddings"]
    seq = seq_length or min(max_pos, 4096)
    if seq > max_pos:
        raise ValueError(f"--seq-length {seq} exceeds the model's max_position_embeddings {max_pos}")
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        seq_length=seq, max_position_embeddings=max_pos, padded_vocab_size=hf["vocab_size"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, normalization=Normalization.RMSNORM,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), add_bias_linear=False,
        position_embedding_type=PositionEmbedding.ROPE, rotary_base=_rope_theta(hf), hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=hf.get("initializer_range", 0.02),
    )


def training_flags(config: ModelConfig) -> list[str]:
    """The pretrain_gpt.py model flags that rebuild exactly `config` (vocabulary padding included)."""
    flags = ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
             "--ffn-hidden-size", str(config.ffn_hidden_size),
             "--num-attention-heads", str(config.num_attention_heads),
             "--num-key-value-heads", str(config.num_key_value_heads),
             "--seq-length", str(config.seq_length),
             "--max-position-embeddings", str(config.max_position_embeddings)]
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        flags += ["--kv-channels", str(config.kv_channels)]
    flags += ["--normalization", "RMSNorm", "--norm-epsilon", repr(config.norm_epsilon), "--swiglu",
              "--use-rotary-position-embeddings", "--rotary-base", repr(config.rotary_base),
              "--disable-bias-linear"]
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    # Largest power of two (<= 128, Megatron's default) dividing the table: then any tokenizer within
    # one multiple of it pads back to the same size.
    divisor = math.gcd(config.padded_vocab_size, 128)
    if divisor != 128:
        flags += ["--make-vocab-size-divisible-by", str(divisor)]
    return flags


# ------------------------------------------------------------------------------------ state dicts
def _q_per_group(config: ModelConfig) -> int:
    return config.num_attention_heads // config.num_key_value_heads


def to_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF `LlamaForCausalLM` tensors from our `GPTModel.state_dict()` (contiguous, same dtype)."""
    check_llama_compatible(config)
    state = fold_smooth_swiglu_scales(state, config)
    g, d, qpg, ffn = config.num_key_value_heads, config.kv_channels, _q_per_group(config), config.ffn_hidden_size
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        for src, dst in _LAYER_RENAMES.items():
            out[hf + dst] = state[ours + src]
        qkv = state[ours + "self_attention.linear_qkv.weight"]
        grouped = qkv.view(g, qpg + 2, d, qkv.shape[-1])
        out[hf + "self_attn.q_proj.weight"] = grouped[:, :qpg].reshape(g * qpg * d, -1)
        out[hf + "self_attn.k_proj.weight"] = grouped[:, qpg].reshape(g * d, -1)
        out[hf + "self_attn.v_proj.weight"] = grouped[:, qpg + 1].reshape(g * d, -1)
        fc1 = state[ours + "mlp.linear_fc1.weight"]
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = fc1[:ffn], fc1[ffn:]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our `GPTModel` state dict from HF `LlamaForCausalLM` tensors (the inverse of `to_hf_state_dict`)."""
    g, d, qpg = config.num_key_value_heads, config.kv_channels, _q_per_group(config)
    unused = set(hf)

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise KeyError(f"HF checkpoint has no tensor {key!r}: is it a LlamaForCausalLM with "
                           f"{config.num_layers} layers?")
        unused.discard(key)
        return hf[key]

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")
    else:
        unused.discard("lm_head.weight")  # a tied model may still store the shared matrix
    for i in range(config.num_layers):
        ours, pre = f"decoder.layers.{i}.", f"model.layers.{i}."
        for dst, src in _LAYER_RENAMES.items():
            out[ours + dst] = take(pre + src)
        q = take(pre + "self_attn.q_proj.weight")
        k = take(pre + "self_attn.k_proj.weight")
        v = take(pre + "self_attn.v_proj.weight")
        hidden = q.shape[-1]
        out[ours + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.view(g, qpg, d, hidden), k.view(g, 1, d, hidden), v.view(g, 1, d, hidden)], dim=1
        ).reshape(-1, hidden)
        out[ours + "mlp.linear_fc1.weight"] = torch.cat(
            [take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")], dim=0)
    leftovers = sorted(k for k in unused if not k.endswith("rotary_emb.inv_freq"))
    if leftovers:
        raise NotLlamaCompatibleError(f"HF tensors with no place in GPTModel: {leftovers[:6]}"
                                      f"{' ...' if len(leftovers) > 6 else ''}")
    return {k: v.contiguous() for k, v in out.items()}
