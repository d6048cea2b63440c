"""`GPTModel`: token embedding, N transformer layers, final norm, LM head, per-token loss.

A plain single-device `nn.Module`. Parallelism (DDP, DeepSpeed, tensor parallel sharding) and FP8
(module swap) are applied to it afterwards by functions that receive it, never built into it.

Construction always happens on the meta device; the parameters then get storage and their per-tensor initial
values (`megatron/model/init.py`), unless the target is meta itself: `build_model` (megatron/model/build.py)
shards and stages such a meta model before materializing only this rank's pieces, with the same values.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.config import ModelConfig, PositionEmbedding, RecomputeGranularity
from megatron.dtypes import at_least_fp32
from megatron.model.init import materialize
from megatron.model.layers import RotaryEmbedding, build_norm
from megatron.model.transformer import TransformerLayer
from megatron.partitioned import full_numel


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = None
        if config.position_embedding_type is PositionEmbedding.LEARNED_ABSOLUTE:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)
        return F.dropout(hidden, self.dropout, self.training)


class OutputHead(nn.Module):
    """Logits = hidden @ weight^T, or with `labels` the per-token FP32 cross-entropy [b, s].

    No parameters (the weight is the output layer's or the tied embedding's): a separate module only so
    that tensor parallelism can swap in its vocab-parallel version, which never gathers full logits.
    """

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = F.linear(hidden, weight)
        if labels is None:
            return logits
        b, s = labels.shape
        # Cross-entropy in at least FP32 whatever the compute dtype: BF16 logits lose too much for the loss.
        loss = F.cross_entropy(at_least_fp32(logits).view(b * s, -1), labels.reshape(b * s), reduction="none")
        return loss.view(b, s)


class TransformerBlock(nn.Module):
    """The stack of layers plus the final norm; owns full activation recompute."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config, i + 1) for i in range(config.num_layers))
        self.final_layernorm = build_norm(config)

    def _recompute_chunks(self) -> list[tuple[int, int, bool]]:
        """(start, end, checkpointed) spans of layers, following `--recompute-method/-num-layers`."""
        n, k = self.config.num_layers, self.config.recompute_num_layers
        if self.config.recompute_granularity is not RecomputeGranularity.FULL:
            return [(0, n, False)]
        if self.config.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        # "block": checkpoint each of the first k layers, run the rest normally
        return [(i, i + 1, True) for i in range(min(k, n))] + ([(k, n, False)] if k < n else [])

    def _run(self, start: int, end: int, hidden: torch.Tensor, rotary, attention_mask) -> torch.Tensor:
        for layer in self.layers[start:end]:
            hidden = layer(hidden, rotary, attention_mask)
        return hidden

    def forward(self, hidden: torch.Tensor, rotary, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        recompute = self.training and torch.is_grad_enabled()
        for start, end, ckpt in self._recompute_chunks():
            if ckpt and recompute:
                hidden = checkpoint(self._run, start, end, hidden, rotary, attention_mask, use_reentrant=False)
            else:
                hidden = self._run(start, end, hidden, rotary, attention_mask)
        return self.final_layernorm(hidden)


class GPTModel(nn.Module):
    """The whole model on `device` (default: the default device, so `with torch.device("meta")` builds shapes
    only), initialized per tensor under `seed`. `seed=None` takes `torch.initial_seed()`, the seed of the last
    `torch.manual_seed`: `torch.manual_seed(s); GPTModel(config)` is the model that `--seed s` starts from.
    Building it consumes no global random numbers."""

    def __init__(self, config: ModelConfig, seed: Optional[int] = None,
                 device: Optional[torch.device | str] = None) -> None:
        super().__init__()
        self.config = config
        target = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):  # no storage, no initialization work yet: materialize() does both once
            self.embedding = Embedding(config)
            self.rotary = None
            if config.position_embedding_type is PositionEmbedding.ROPE:
                self.rotary = RotaryEmbedding(config.kv_channels, config.max_position_embeddings,
                                              config.rotary_base)
            self.decoder = TransformerBlock(config)
            self.output_layer: Optional[nn.Linear] = None
            if config.untie_embeddings_and_output_weights:
                self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
            self.output_head = OutputHead()
        if target.type != "meta":
            materialize(self, target, torch.initial_seed() if seed is None else seed)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [b, s, vocab], or the per-token FP32 loss [b, s] when `labels` are given.

        `attention_mask` is None for plain causal attention, else a boolean [b, 1, s, s] mask where
        True means "may attend" (used by `--reset-attention-mask`).
        """
        b, s = tokens.shape
        if s > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {s} tokens exceeds --max-position-embeddings "
                             f"{self.config.max_position_embeddings}")
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        hidden = self.embedding(tokens, position_ids)
        rotary = self.rotary(position_ids) if self.rotary is not None else None
        hidden = self.decoder(hidden, rotary, attention_mask)
        weight = self.output_layer.weight if self.output_layer is not None else self.embedding.word_embeddings.weight
        return self.output_head(hidden, weight, labels)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        # full_numel: a parameter built partitioned under ZeRO-3 holds an empty placeholder (megatron/model/build.py)
        total = sum(full_numel(p) for p in self.parameters())
        if exclude_embeddings:
            total -= full_numel(self.embedding.word_embeddings.weight)
        return total
