"""Tensor parallelism (Megatron layouts) applied to a plain single-device `GPTModel` after construction.

- `tensor_parallel`: the communication as autograd functions (copy/reduce, sequence gather/scatter).
- `layout`: which parameters are sharded along which dimension; split/merge of state dicts.
- `layers`: sharded linears, vocab-parallel embedding and output head, tensor-parallel regions.
- `cross_entropy`: cross-entropy over vocabulary-sharded logits.
- `parallelize`: `parallelize_tensor(model, parallel_state)`, the entry point.
- `grads`: sequence-parallel gradient reduction and TP-aware gradient clipping.
- `checkpoint`: per-TP-rank checkpoint shards (`mp_rank_XX`) and the layout check at load.

See docs/tensor_parallel.md.
"""
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.grads import clip_grad_norm, reduce_sequence_parallel_grads
from megatron.parallel.layout import merge_state_dicts, shard_state_dict
from megatron.parallel.parallelize import parallelize_tensor

__all__ = ["clip_grad_norm", "merge_state_dicts", "parallelize_tensor", "reduce_sequence_parallel_grads",
           "shard_state_dict", "vocab_parallel_cross_entropy"]
