"""`parallelize_tensor`: shard a single-device `GPTModel` in place for tensor parallelism.

Each rank keeps its piece of every sharded parameter (`layout.py`) and the parents of the sharded linears
become tensor-parallel regions (`layers.py`). Training shards a model built on the meta device, before any
storage exists (`megatron/model/build.py`): the pieces are then materialized with the per-tensor initial
values, equal to the slices of the TP=1 model's (`megatron/model/init.py`). A model with real weights is cut
the same way (tests, tools). Call it before `convert_to_fp8` (so the FP8 swap sees the sharded linears) and
before building the optimizer and DDP (which must see the new parameters).

Per transformer layer:
    input_layernorm        replicated (sequence parallel: on this rank's sequence shard)
    self_attention         region: enter -> linear_qkv (column) -> attention on H/tp heads, G/tp KV groups
                           -> linear_proj (row) -> leave
    pre_mlp_layernorm      replicated (as above)
    mlp                    region: enter -> linear_fc1 (column, [gate_r | up_r]) -> SwiGLU on F/tp channels
                           -> linear_fc2 (row) -> leave
and around them: the vocab-parallel word embedding, the final norm, the vocab-parallel output head.
Under sequence parallel, the hidden state between regions is [b, s/tp, h] on each rank.

Smooth-SwiGLU uses `mlp.smooth_swiglu.tp_group`, set here: the TOKEN form reduces its per-token maxima
over it; the CHANNEL form's scales need none (each rank owns whole channels and sees every token of the
micro-batch inside the region), only the amax of fc2's folded weight shard is max-reduced over it.
"""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

from megatron.parallel.layers import (
    SEQUENCE_PARALLEL_GRAD,
    TP_SHARD_DIM,
    SequenceShardedEmbedding,
    VocabParallelEmbedding,
    VocabParallelOutputHead,
    make_tensor_parallel_region,
    shard_column_parallel,
    shard_row_parallel,
)
from megatron.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def _check_divisible(model: nn.Module, tp: int, sequence_parallel: bool) -> None:
    c = model.config
    checks = [("--num-attention-heads", c.num_attention_heads), ("--num-key-value-heads", c.num_key_value_heads),
              ("--ffn-hidden-size", c.ffn_hidden_size), ("padded vocabulary size", c.padded_vocab_size)]
    if sequence_parallel:
        checks.append(("--seq-length", c.seq_length))
    for flag, value in checks:
        if value % tp:
            raise ValueError(f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}")


def _parallelize_attention(attention: nn.Module, group: Any, rank: int, tp: int, sequence_parallel: bool) -> None:
    shard_column_parallel(attention.linear_qkv, rank, tp)
    shard_row_parallel(attention.linear_proj, rank, tp)
    attention.num_heads //= tp
    attention.num_kv_heads //= tp
    make_tensor_parallel_region(attention, group, sequence_parallel)


def _parallelize_mlp(mlp: nn.Module, group: Any, rank: int, tp: int, sequence_parallel: bool) -> None:
    shard_column_parallel(mlp.linear_fc1, rank, tp, chunks=2 if mlp.swiglu else 1)
    shard_row_parallel(mlp.linear_fc2, rank, tp)
    smooth = getattr(mlp, "smooth_swiglu", None)
    if smooth is not None:
        smooth.tp_group = group
    make_tensor_parallel_region(mlp, group, sequence_parallel)


def parallelize_tensor(model: nn.Module, parallel: ParallelState, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` (a `GPTModel`) over `parallel.tensor_parallel_group` in place; returns it.

    A no-op at tensor-parallel size 1. Sharded parameters carry the attribute `tensor_parallel_dim`;
    under sequence parallel, the replicated ones carry `sequence_parallel_grad` (their gradients are
    summed over the TP group by `reduce_sequence_parallel_grads` before the optimizer step).
    """
    tp, rank, group = parallel.tensor_parallel_size, parallel.tensor_parallel_rank, parallel.tensor_parallel_group
    if tp == 1:
        return model
    _check_divisible(model, tp, sequence_parallel)

    embedding = model.embedding
    embedding.word_embeddings = VocabParallelEmbedding.from_embedding(embedding.word_embeddings, group, rank, tp,
                                                                      sequence_parallel)
    if sequence_parallel and embedding.position_embeddings is not None:
        embedding.position_embeddings = SequenceShardedEmbedding.from_embedding(embedding.position_embeddings, group)
    for layer in model.decoder.layers:
        _parallelize_attention(layer.self_attention, group, rank, tp, sequence_parallel)
        _parallelize_mlp(layer.mlp, group, rank, tp, sequence_parallel)
    if model.output_layer is not None:
        shard_column_parallel(model.output_layer, rank, tp)
    model.output_head = VocabParallelOutputHead(group, sequence_parallel)

    if sequence_parallel:
        for param in model.parameters():
            if not hasattr(param, TP_SHARD_DIM):
                setattr(param, SEQUENCE_PARALLEL_GRAD, True)
    logger.info("tensor parallel: rank %d of %d holds %d parameters%s", rank, tp,
                sum(p.numel() for p in model.parameters()), " (sequence parallel)" if sequence_parallel else "")
    return model
