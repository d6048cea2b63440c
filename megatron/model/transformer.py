"""One pre-norm transformer layer: causal GQA self-attention with RoPE, and a SwiGLU (or GeLU) MLP.

Attribute names follow Megatron-Core (`input_layernorm`, `self_attention.linear_qkv`,
`self_attention.linear_proj`, `pre_mlp_layernorm`, `mlp.linear_fc1`, `mlp.linear_fc2`) so users
find what they know. Every linear is a plain `nn.Linear`: FP8 is applied afterwards by swapping
modules (`megatron.fp8.convert_to_fp8`), and tensor parallelism by sharding them.

Layouts (they matter for checkpoint conversion and for tensor-parallel sharding):
- `linear_qkv` output is grouped per key/value head as Megatron does: for each of the G kv groups,
  [the (H/G) query heads of the group | its key head | its value head], each head_dim wide. A
  contiguous split of the output dimension therefore hands whole groups to each TP rank.
- `linear_fc1` output for SwiGLU is [gate | up]: h = silu(gate) * up. In the paper's notation the
  gate is the Swish branch w2 and `up` the linear branch w1.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.config import ModelConfig, RecomputeGranularity
from megatron.model.layers import apply_rotary, build_norm
from megatron.model.smooth_swiglu import SmoothSwiGLU, SmoothSwiGLUGranularity, swiglu_product


def _init_linear(linear: nn.Linear, std: float) -> None:
    # For a layer built on its own (the Smooth-SwiGLU experiments). Inside `GPTModel` the layers are built on
    # the meta device and initialized per tensor with the same distributions (megatron/model/init.py).
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


# GQA without expanding K and V: SDPA's `enable_gqa` (torch >= 2.5) reads each key/value head for its group of query
# heads, so neither forward nor backward holds K and V at num_heads (autograd saves them at num_kv_heads) and no
# backward sums the expanded gradients back. Older torch (2.4) gets the expansion. Decided from the version, not by
# calling SDPA: an op run at import starts the thread pools of a process that may fork (tests/support/forkserver.py).
SDPA_ENABLE_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def output_layer_std(config: ModelConfig) -> float:
    """Megatron's scaled init for the projections that write into the residual stream."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.kv_channels
        qkv_out = config.query_projection_size + 2 * config.kv_projection_size
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_out, bias=config.add_bias_linear)
        self.linear_proj = nn.Linear(config.query_projection_size, config.hidden_size,
                                     bias=config.add_bias_linear)
        _init_linear(self.linear_qkv, config.init_method_std)
        _init_linear(self.linear_proj, output_layer_std(config))
        self.recompute_core = config.recompute_granularity is RecomputeGranularity.SELECTIVE

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = mixed.shape
        q_per_group = self.num_heads // self.num_kv_heads
        grouped = mixed.view(b, s, self.num_kv_heads, (q_per_group + 2) * self.head_dim)
        q, k, v = torch.split(grouped, [q_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        # -> [b, heads, s, d]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        grouped = {}
        if self.num_kv_heads != self.num_heads:
            if SDPA_ENABLE_GQA:
                grouped = {"enable_gqa": True}
            else:
                repeat = self.num_heads // self.num_kv_heads
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dropout = self.config.attention_dropout if self.training else 0.0
        if attention_mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, **grouped)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout, **grouped)

    def forward(self, hidden: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]],
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        q, k, v = self._split_qkv(self.linear_qkv(hidden))
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            context = checkpoint(self._core_attention, q, k, v, attention_mask, use_reentrant=False)
        else:
            context = self._core_attention(q, k, v, attention_mask)
        b, _, s, _ = context.shape
        context = context.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.linear_proj(context)


class MLP(nn.Module):
    """SwiGLU (`--swiglu`) or GeLU feed-forward block; `--smooth-swiglu` runs the product and fc2 through
    `smooth_swiglu` (see `megatron/model/smooth_swiglu.py`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)
        _init_linear(self.linear_fc1, config.init_method_std)
        _init_linear(self.linear_fc2, output_layer_std(config))
        self.smooth_swiglu: Optional[SmoothSwiGLU] = None
        if config.smooth_swiglu is not None:
            if not config.swiglu:
                raise ValueError("--smooth-swiglu needs --swiglu (it rescales the SwiGLU product)")
            self.smooth_swiglu = SmoothSwiGLU(config.smooth_swiglu, has_bias=config.add_bias_linear)

    @property
    def fc2_weight_column_scaled(self) -> bool:
        """Whether fc2 is called with a per-micro-batch weight column scale (Smooth-SwiGLU's channel form), so
        that an FP8 fc2 makes its FP8 weight per call, never from a per-step cache."""
        return (self.smooth_swiglu is not None and self.smooth_swiglu.enabled
                and self.smooth_swiglu.granularity is SmoothSwiGLUGranularity.CHANNEL)

    def activation(self, fc1_out: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return swiglu_product(fc1_out)
        return F.gelu(fc1_out)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.smooth_swiglu is not None and self.smooth_swiglu.enabled:
            return self.smooth_swiglu(self.linear_fc1(hidden), self.linear_fc2)
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))


def _fp8_statistics_on(layer: nn.Module) -> bool:
    """Whether the block's FP8 layers record statistics this step (`Fp8LayerState.stats_enabled`, switched for the
    whole model at once; False without FP8 layers). A compiled block reads it in its own frame: statistics steps
    run the FP8 layers as graph breaks, and dynamo keeps no guard from a call it could not inline, so without this
    read the graph-broken entry of a statistics step matched every later step too (152 compiled regions per step
    of the demo model instead of 56; test_torch_compile.py, `test_nothing_compiles_after_the_startup_...`)."""
    for linear in (layer.self_attention.linear_qkv, layer.self_attention.linear_proj, layer.mlp.linear_fc1,
                   layer.mlp.linear_fc2):
        state = getattr(linear, "fp8", None)
        if state is not None:
            return state.stats_enabled
    return False


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, hidden: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]],
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        if _fp8_statistics_on(self):  # read here so that a compiled block's entry is guarded on it (its docstring)
            pass
        attn = self.self_attention(self.input_layernorm(hidden), rotary, attention_mask)
        hidden = hidden + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + F.dropout(mlp, self.hidden_dropout, self.training)
