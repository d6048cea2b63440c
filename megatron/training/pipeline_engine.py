"""Pipeline parallelism: our GPT cut into DeepSpeed `PipelineModule` stages, run by DeepSpeed's PipelineEngine.

`--pipeline-model-parallel-size P` (with `--deepspeed`, ZeRO 0 or 1, any TP size) splits the model into

    EmbeddingStage | TransformerLayerStage x num_layers | OutputStage (final norm + LM head)

and DeepSpeed partitions it so every stage gets num_layers / P transformer layers (the embedding joins
the first stage, the head the last). Stages exchange one tensor, the hidden state [b, s, h]: positions
are the plain 0..s-1 (so `--reset-position-ids`/`--reset-attention-mask` are refused with PP) and each
layer stage recomputes its rotary table from them. The loss, the same token-weighted mean per
micro-batch as `Trainer._forward_loss`, is `pipeline_loss` on the last stage, where `HeadLoss` (the only
place the labels reach) computes the cross-entropy of the head's logits: under tensor parallelism the
vocab-parallel one, which never gathers the [b, s, vocab] logits.

Tensor parallelism: the model is sharded before it is cut, and DeepSpeed gets the topology
`PipeModelDataParallelTopology(P, num_mp=tp, dp)`, the rank layout of `megatron.parallel_state` (checked at
build). DeepSpeed's grid then reduces gradients over the data-parallel group, sends each TP rank's activations
to the same TP rank of the next stage, and ZeRO's norm counts TP shards (`model_parallel`) on every TP rank and
replicated parameters on TP rank 0 of each stage. Under sequence parallelism the hidden state between stages is
[b, s/tp, h] (so layer stages build the rotary table for tp times its length) and DeepSpeed's partitioning of
activations over the TP ranks, which assumes identical copies, is off (`deepspeed_config.py`). FP8 amaxes are
reduced over the stage's TP x DP ranks.

No rank builds the whole model: `pipeline_stage` tells `build_model` (megatron/model/build.py) which parts
this rank's stage holds, using DeepSpeed's own partitioning function, and only those get storage (the same
per-tensor initial values as at PP = 1); the others stay on the meta device through the FP8 swap and are
dropped here.

`train_batch(iteration, batches)` runs DeepSpeed's schedule (forward/backward of every micro-batch, the
pipelined sends, the data-parallel reduction and the ZeRO 0/1 step) and reports (loss, grad norm, stepped).
Non-finite steps change nothing: a non-finite loss multiplies itself by NaN, so its gradients become
non-finite on every stage; ZeRO-1's overflow check (reduced over data and pipeline ranks) skips the step,
and without ZeRO `_guard_non_finite_steps` does the same (and the clipping) around our optimizer.
Checkpoints use DeepSpeed's pipeline layout inside our atomic folders: one `layer_XX-model_<t>-model_states.pt`
per layer and TP rank t, and one `mp_rank_YY_model_states.pt` per stage s and TP rank (YY = s x tp + t) with
our scheduler/RNG/FP8 state.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megatron import comm
from megatron.config import RecomputeGranularity
from megatron.data.provider import Batch
from megatron.model.build import PipelineStage
from megatron.optimizer.lr_scheduler import LrScheduler
from megatron.parallel import clip_grad_norm, vocab_parallel_cross_entropy
from megatron.parallel.tensor_parallel import enter_tensor_parallel_region
from megatron.parallel_state import ParallelState
from megatron.training.deepspeed_engine import DeepSpeedBase
from megatron.training.deepspeed_shm import release_deepspeed_shm
from megatron.training.engine import Engine, check_skipped, nan_unless

logger = logging.getLogger("megatron")


def _positions(x: torch.Tensor, sequence_shards: int = 1) -> torch.Tensor:
    """Positions 0..s-1 of the whole sequence, of which `x` [b, s / sequence_shards, ...] may hold one part."""
    b, s = x.shape[0], x.shape[1] * sequence_shards
    return torch.arange(s, device=x.device).unsqueeze(0).expand(b, s)


class EmbeddingStage(nn.Module):
    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens, _positions(tokens))


class TransformerLayerStage(nn.Module):
    def __init__(self, layer: nn.Module, rotary: Optional[nn.Module], sequence_shards: int = 1) -> None:
        super().__init__()
        self.layer = layer
        # Shared by every layer stage and parameter-free (its tables are non-persistent buffers): kept out of
        # the module tree so that no stage's state dict or parameter list repeats it.
        self.__dict__["rotary"] = rotary
        # Sequence parallel: the hidden state holds 1/tp of the sequence, but attention runs on all of it
        # (gathered inside the layer's TP region), so the rotary table covers the whole sequence.
        self.sequence_shards = sequence_shards

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rotary = self.rotary(_positions(hidden, self.sequence_shards)) if self.rotary is not None else None
        return self.layer(hidden, rotary, None)


class OutputStage(nn.Module):
    """Final norm and the LM head's matmul: logits [b, s, vocab], under tensor parallelism this rank's vocabulary
    shard [b, s, vocab / tp] (`VocabParallelOutputHead`'s layout; sequence-parallel hidden states are gathered
    first). The cross-entropy is computed by the loss (`HeadLoss`), the only place the labels reach."""

    def __init__(self, final_layernorm: nn.Module, output_layer: nn.Linear, tp_group=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.final_layernorm = final_layernorm
        self.output_layer = output_layer
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = enter_tensor_parallel_region(self.final_layernorm(hidden), self.tp_group, self.sequence_parallel)
        return F.linear(hidden, self.output_layer.weight)


class HeadLoss:
    """The PipelineModule's `loss_fn`: the per-token FP32 cross-entropy of `OutputStage`'s logits (vocab-parallel
    under TP: the [b, s, vocab] logits are never gathered), then `pipeline_loss`.

    Called by DeepSpeed outside the engine's autocast: the logits' matmul stays in the stage, under it, as in the
    model's own head."""

    def __init__(self, tp_group=None) -> None:
        self.tp_group = tp_group

    def __call__(self, logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        labels = target[0]
        if self.tp_group is not None:
            per_token = vocab_parallel_cross_entropy(logits, labels, self.tp_group)
        else:
            per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return pipeline_loss(per_token.view_as(labels), target)


def pipeline_loss(per_token: torch.Tensor, target: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Token-weighted mean of one micro-batch's per-token losses [b, s]; NaN-poisoned when not finite. A target
    of (labels, loss mask, weight) gives the masked sum times `weight` instead (`PipelineEngine.evaluate`)."""
    loss_mask = target[1]
    masked = (per_token * loss_mask).sum()
    loss = masked * target[2] if len(target) > 2 else masked / loss_mask.sum().clamp(min=1.0)
    # A non-finite token masked out of the loss leaves finite gradients; multiplying by NaN (or exactly 1.0)
    # makes every gradient non-finite instead, so the step is skipped on all stages.
    return nan_unless(torch.isfinite(loss.detach()), loss)


def build_pipeline_module(model: nn.Module, parallel: ParallelState) -> nn.Module:
    """This rank's stage of `model` as a DeepSpeed PipelineModule. `model` is a `GPTModel` from
    `build_model(..., stage=pipeline_stage(...))` (the other stages' parts on meta), already FP8-converted."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts our process group (before initialize)
    release_deepspeed_shm()

    if model.output_layer is None:
        raise ValueError("pipeline parallelism needs --untie-embeddings-and-output-weights")
    topology = PipeModelDataParallelTopology(num_pp=parallel.pipeline_parallel_size,
                                             num_mp=parallel.tensor_parallel_size, num_dp=parallel.data_parallel_size)
    # Tensor-parallel heads carry the model's sequence-parallel flag (the plain head is TP = 1).
    sequence_shards = parallel.tensor_parallel_size if getattr(model.output_head, "sequence_parallel", False) else 1
    output = OutputStage(model.decoder.final_layernorm, model.output_layer, parallel.tensor_parallel_group,
                         sequence_shards > 1)
    layers = [EmbeddingStage(model.embedding),
              *(TransformerLayerStage(layer, model.rotary, sequence_shards) for layer in model.decoder.layers),
              output]
    try:  # the constructor moves its stage's modules to the device: a meta one cannot move
        pipe = PipelineModule(layers=layers, loss_fn=HeadLoss(parallel.tensor_parallel_group), topology=topology,
                              partition_method="type:TransformerLayerStage", **_full_recompute(model.config))
    except NotImplementedError as exc:
        raise RuntimeError("DeepSpeed's pipeline partition holds a layer that build_model left on the meta "
                           "device: it no longer agrees with pipeline_stage()") from exc
    unbuilt = [n for n, t in (*pipe.named_parameters(), *pipe.named_buffers()) if t.is_meta]
    if unbuilt:
        raise RuntimeError(f"pipeline stage holds unmaterialized tensors {unbuilt[:4]}: DeepSpeed's partition "
                           f"no longer agrees with pipeline_stage()")
    _check_grid(pipe.mpu(), parallel)
    local = [i for i, f in enumerate(layers) if any(f is g for g in pipe.forward_funcs)]
    logger.info("pipeline stage %d of %d: layers %d..%d of %d (embedding = 0, transformer layers 1..%d, head = %d)",
                parallel.pipeline_parallel_rank, parallel.pipeline_parallel_size, local[0], local[-1],
                len(layers) - 1, len(layers) - 2, len(layers) - 1)
    return pipe


def _full_recompute(config) -> dict:
    """`--recompute-granularity full --recompute-method uniform` on a stage: DeepSpeed checkpoints every
    `--recompute-num-layers` of the stage's transformer layers (only chunks made of transformer layers: the
    embedding and the head are never recomputed), with torch's non-reentrant checkpoint as the single-stage
    model does (megatron/model/gpt.py)."""
    if config.recompute_granularity is not RecomputeGranularity.FULL:
        return {}
    logger.info("pipeline: full activation recompute of every %d transformer layer(s) of the stage",
                config.recompute_num_layers)
    return dict(activation_checkpoint_interval=config.recompute_num_layers,
                activation_checkpoint_func=functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
                checkpointable_layers=["TransformerLayerStage"])


def pipeline_stage(num_layers: int, parallel: ParallelState) -> PipelineStage:
    """The parts of the model this rank's stage holds, before any of it is built.

    `build_pipeline_module` lets DeepSpeed partition [embedding | num_layers x TransformerLayerStage | head]
    with `partition_method="type:TransformerLayerStage"`: `partition_balanced` over weights 1 for the layer
    stages, 0 for the others. The same call here gives the same split (checked there).
    """
    from deepspeed.runtime.utils import partition_balanced

    parts = partition_balanced(weights=[0] + [1] * num_layers + [0], num_parts=parallel.pipeline_parallel_size)
    start, stop = parts[parallel.pipeline_parallel_rank], parts[parallel.pipeline_parallel_rank + 1]
    # Pipeline index 0 is the embedding, 1..num_layers the transformer layers, num_layers + 1 the head.
    return PipelineStage(layers=range(max(start - 1, 0), min(stop - 1, num_layers)), embedding=start == 0,
                         head=stop == num_layers + 2)


def _check_grid(grid, parallel: ParallelState) -> None:
    """DeepSpeed's grid (its own process groups) must place this rank where `megatron.parallel_state` did: our TP
    and amax groups and its data-parallel reduction then cover the same ranks."""
    ours = (parallel.pipeline_parallel_rank, parallel.data_parallel_rank, parallel.tensor_parallel_rank)
    theirs = (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_slice_parallel_rank())
    if ours != theirs:
        raise RuntimeError(f"rank {parallel.rank}: megatron.parallel_state places it at (stage, replica, TP rank) "
                           f"{ours}, DeepSpeed's PipeModelDataParallelTopology at {theirs}")


class _StageLayers:
    """`.decoder.layers` over this stage's transformer layers: what the SwiGLU hooks walk."""

    def __init__(self, pipe: nn.Module) -> None:
        layers = [f.layer for f in pipe.forward_funcs if isinstance(f, TransformerLayerStage)]
        self.decoder = type("StageDecoder", (), {"layers": layers})()


def stage_layers_view(pipe: nn.Module) -> _StageLayers:
    return _StageLayers(pipe)


def _guard_non_finite_steps(optimizer: torch.optim.Optimizer, clip_grad: float, data_parallel_size: int,
                            tp_group=None) -> None:
    """ZeRO-0 pipelines: make `optimizer.step()` clip by the global norm and skip when it is not finite.

    DeepSpeed's pipeline calls `optimizer.step()` once per batch on every rank, after the data-parallel
    gradient reduction, then reads `optimizer.overflow` (a skipped step: `was_step_applied()` is False) and
    `optimizer._global_grad_norm` (`get_global_grad_norm()`). The norm is `grads.clip_grad_norm`'s, the other
    engines' clipping, summed over all ranks: every stage contributes its layers, each TP rank its shards
    (replicated parameters count on TP rank 0 only), and the DP replicas, which hold the same reduced gradients,
    are divided out.
    """

    real_step = optimizer.step
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def step(closure=None):
        norm = float(clip_grad_norm(params, clip_grad, tp_group, norm_group=comm.world_group(),
                                    replicas=data_parallel_size))
        optimizer._global_grad_norm = norm  # host read: the skip decision needs it
        optimizer.overflow = not math.isfinite(norm)
        return None if optimizer.overflow else real_step(closure)

    optimizer.step = step


class PipelineEngine(DeepSpeedBase, Engine):
    """The loop's engine for pipeline runs: DeepSpeed's `train_batch` / `eval_batch` take the micro-batches whole."""

    def __init__(self, config, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LrScheduler,
                 parallel: ParallelState) -> None:
        import deepspeed

        self._initialize(config, model, optimizer, scheduler, parallel, (0, 1), "--pipeline-model-parallel-size")
        if self.zero_stage == 0:
            # Without ZeRO, DeepSpeed's pipeline clips and steps whatever the gradients hold: the guard does both.
            _guard_non_finite_steps(optimizer, self.ds_config.get("gradient_clipping", 0.0),
                                    parallel.data_parallel_size, parallel.tensor_parallel_group)
            self.ds_config = {**self.ds_config, "gradient_clipping": 0.0}
        self._wrap(model, optimizer)
        logger.info("DeepSpeed %s pipeline: %d stages x %d data-parallel x %d tensor-parallel, ZeRO stage %d, %s, "
                    "optimizer %s", deepspeed.__version__, parallel.pipeline_parallel_size, parallel.data_parallel_size,
                    parallel.tensor_parallel_size, self.zero_stage,
                    "BF16 autocast" if config.training.bf16 else "FP32", type(optimizer).__name__)

    @staticmethod
    def _pipeline_inputs(batches: Sequence[Batch]) -> Iterator:
        """Micro-batches as DeepSpeed's pipeline takes them: (inputs, (labels, loss mask))."""
        return iter([(b.tokens, (b.labels, b.loss_mask)) for b in batches])

    def train_batch(self, iteration: int, batches: Sequence[Batch], loss_fn=None) -> tuple[float, float, bool]:
        """One optimizer step over the global batch's micro-batches: (loss, grad norm, stepped). The loss is
        computed by the last stage (`pipeline_loss`), so `loss_fn` is not used."""
        previous_lrs = self._apply_lr_and_remember(iteration)
        # Averaged over micro-batches and replicas, on every stage (DeepSpeed's API reads it to the host).
        loss = float(self.engine.train_batch(self._pipeline_inputs(batches)))
        stepped = bool(self.engine.was_step_applied())
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        if not stepped:
            self._restore_lr(previous_lrs)
            if grad_norm < 0:
                grad_norm = float("nan")  # DeepSpeed reports a non-finite norm as -1
        check_skipped(stepped, math.isfinite(loss), "DeepSpeed's pipeline")
        return loss, grad_norm, stepped

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch], loss_fn=None, progress=None) -> float:
        """Token-weighted mean loss over `batches` and the data-parallel replicas, the statistic of every engine.
        `batches` holds whole global batches of this rank's micro-batches, in order. Each micro-batch's loss is its
        masked sum weighted by n x DP / (all the tokens counted, on every replica), so that DeepSpeed's average of
        one `eval_batch` over its n micro-batches and the replicas is that batch's share of the mean."""
        n = self.ds_config["gradient_accumulation_steps"]
        total = torch.stack([b.loss_mask.sum().double() for b in batches]).sum().reshape(1) if batches else (
            torch.zeros(1, dtype=torch.float64))
        comm.all_reduce(total, self.parallel.data_parallel_group)  # comm moves it to the backend's device
        weight = torch.tensor(n * self.parallel.data_parallel_size / max(float(total), 1.0), dtype=torch.float32)
        loss = 0.0
        for i in range(0, len(batches), n):
            inputs = iter([(b.tokens, (b.labels, b.loss_mask, weight)) for b in batches[i:i + n]])
            loss += float(self.engine.eval_batch(inputs))
            if progress is not None:
                progress(i + n)
        return loss
