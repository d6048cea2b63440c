"""DeepSpeed's view of our process groups: the `mpu` adapter, the marks its norms read, the sequence-parallel
gradient sum, and the process group it needs even for one process.

Tensor parallelism (`--tensor-model-parallel-size`, ZeRO 0-2): DeepSpeed gets `ModelParallelUnit` as its `mpu`, so
it sizes the batch, broadcasts the initial weights, reduces gradients and partitions the optimizer over the
data-parallel group only, and names its files per TP rank (mp_rank_<tp>_model_states.pt,
zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt). ZeRO's gradient norm sums over the TP group, counting a
parameter on every TP rank when it is marked `model_parallel` (our TP shards: `mark_model_parallel_params`) and
on TP rank 0 only otherwise (the replicated norms). Under sequence parallelism each replicated parameter's
gradient of a micro-batch covers only this rank's part of the sequence: `sum_sequence_parallel_grads_in_backward`
sums it over the TP group as backward produces it, before DeepSpeed accumulates, reduces or partitions it.
ZeRO-3 is refused with TP (`deepspeed_config.py` says why).
"""
from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from megatron.parallel.layers import SEQUENCE_PARALLEL_GRAD, TP_SHARD_DIM
from megatron.parallel.tensor_parallel import all_reduce_sum
from megatron.parallel_state import ParallelState


class ModelParallelUnit:
    """Our tensor-parallel and data-parallel groups under the getter names of DeepSpeed's `mpu` (Megatron's).

    For `deepspeed.initialize(mpu=...)` without pipeline parallelism (the pipeline engine builds the equivalent,
    its grid, from `PipeModelDataParallelTopology`). "Model parallel" is tensor parallel here.
    """

    def __init__(self, parallel: ParallelState) -> None:
        if parallel.pipeline_parallel_size != 1 or parallel.tensor_parallel_group is None:
            raise ValueError("ModelParallelUnit is for tensor parallelism without pipeline parallelism")
        self._parallel = parallel

    def get_model_parallel_rank(self) -> int:
        return self._parallel.tensor_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return self._parallel.tensor_parallel_size

    def get_model_parallel_group(self):
        return self._parallel.tensor_parallel_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self._parallel.data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return self._parallel.data_parallel_size

    def get_data_parallel_group(self):
        return self._parallel.data_parallel_group


def mark_model_parallel_params(model: nn.Module) -> None:
    """Set DeepSpeed's `model_parallel` on our TP shards (`tensor_parallel_dim`): its norms count them on every TP
    rank (each holds a different piece) and the unmarked, replicated parameters on TP rank 0 only."""
    for param in model.parameters():
        if hasattr(param, TP_SHARD_DIM):
            param.model_parallel = True


def sum_sequence_parallel_grads_in_backward(model: nn.Module, tp_group) -> None:
    """Sum each micro-batch's gradient of the sequence-parallel replicated parameters over the TP group.

    TorchEngine does it once per step on the accumulated gradients (`reduce_sequence_parallel_grads`). Under
    DeepSpeed the gradients leave `.grad` during backward (ZeRO reduces or partitions them as they become ready,
    the pipeline reduces them in its schedule), so the sum happens earlier: a tensor hook sees the gradient of
    this backward before it is accumulated, and sums are linear, so the result is the same up to rounding. It costs
    one small all-reduce per replicated parameter (the norms: 2 per layer + 1) per micro-batch.
    """
    for param in model.parameters():
        if getattr(param, SEQUENCE_PARALLEL_GRAD, False) and param.requires_grad:
            param.register_hook(lambda grad: all_reduce_sum(grad.clone(), tp_group))


def ensure_process_group(parallel: ParallelState) -> None:
    """DeepSpeed needs torch.distributed and LOCAL_RANK even for one process: give it a 1-rank group."""
    if parallel.is_distributed or dist.is_initialized():
        return
    os.environ.setdefault("LOCAL_RANK", "0")
    # A HashStore lives in this process: no port to pick, nothing to collide with a concurrent run.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
