"""The training loop's view of SwiGLU: Smooth-SwiGLU placement and the outlier/alignment diagnostics.

Built after `convert_to_fp8` (it must see which fc2 layers became FP8):
- Smooth-SwiGLU protects the FP8 cast of fc2's input. A layer whose fc2 stayed in high precision
  (`--fp8-mlp-fc2-bf16`, or the layers kept by `--fp8-first-last-layers-bf16`) has no such cast, so its
  smoothing is switched off (a no-op, said once in the log) instead of rejecting the flag combination:
  the result is the same function, without the extra reduction and the uncached fc2 weight.
- Diagnostics (on unless `--no-swiglu-diagnostics`): `before_step(iteration)` arms the activation
  recorder for the forward passes of a logging step only; `log_values` returns the TensorBoard scalars
  `swiglu/layer{i}/{act_max,outlier_ratio,align_max,align_p99,align_count_gt_0.5}` and a log-line
  fragment, and logs a warning when a layer's outlier ratio or max alignment jumps (> 2x the median of
  its last 32 log points, `JumpDetector`).
- The jump history survives a resume: `state()` goes into the checkpoint beside the FP8 scaling state
  (key `swiglu_diagnostics` of the loop's extras) and `load_state` restores it. Only the logging rank (rank 0)
  runs the diagnostics, so only its extras carry the key, and rank 0 reads its own file back (mp_rank_00, or
  pipeline stage 0 / TP rank 0's client state; a resharded load hands rank 0's extras to every rank). Series
  are keyed by layer index (`"{layer}/{name}"`); rank 0 watches the layers of pipeline stage 0, whose local
  indices are the global ones, so a checkpoint of one TP/PP/DP layout resumes in another: series of layers
  this rank does not watch are dropped at load. A checkpoint without the key (older, or saved with
  `--no-swiglu-diagnostics`) gives an empty history, as before.
- Under tensor or data parallelism every rank of pipeline stage 0 records: each holds a slice of fc1's channels
  (TP) and sees a share of the batch (DP), so the per-channel maxima are reduced (max) over the data-parallel group
  and the per-channel values gathered over the tensor-parallel group before the logging rank summarizes: the
  statistics of the whole layer and the whole batch, whatever the layout.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from megatron import comm
from megatron.checkpoint.store import CheckpointError
from megatron.config import ModelConfig
from megatron.model.swiglu_diagnostics import ActivationRecorder, JumpDetector, layer_diagnostics

logger = logging.getLogger("megatron")

WATCHED = ("outlier_ratio", "align_max")
STATE_KEY = "swiglu_diagnostics"  # the checkpoint extras' key of `SwiGLUHooks.state()`


def disable_smoothing_without_fp8_fc2(model: nn.Module) -> list[int]:
    """Switch Smooth-SwiGLU off in layers whose `linear_fc2` is not an `Fp8Linear`; return their indices."""
    from megatron.fp8.linear import Fp8Linear

    disabled = []
    for i, layer in enumerate(model.decoder.layers):
        smooth = getattr(layer.mlp, "smooth_swiglu", None)
        if smooth is not None and not isinstance(layer.mlp.linear_fc2, Fp8Linear):
            smooth.enabled = False
            disabled.append(i)
    return disabled


class SwiGLUHooks:
    """Smooth-SwiGLU placement at build time, diagnostics and jump warnings every log interval (module docstring)."""

    def __init__(self, model: nn.Module, config: ModelConfig, diagnostics: bool, logs: bool = True,
                 data_parallel_group=None, tensor_parallel_group=None) -> None:
        """`logs`: this rank summarizes and warns (the logging rank); the others only take part in the reductions
        over `data_parallel_group` and `tensor_parallel_group` (module docstring)."""
        self.model = model
        self.logs = logs
        self.groups = (data_parallel_group, tensor_parallel_group)
        if config.smooth_swiglu is not None:
            disabled = disable_smoothing_without_fp8_fc2(model)
            if disabled:
                logger.info("smooth-swiglu: off in layers %s, whose fc2 is not FP8 (nothing to protect)", disabled)
            logger.info("smooth-swiglu: %s scaling in %d/%d layers", config.smooth_swiglu.value,
                        config.num_layers - len(disabled), config.num_layers)
        self.recorder: Optional[ActivationRecorder] = None
        if diagnostics and config.swiglu:
            self.recorder = ActivationRecorder(model)
        self.jumps = JumpDetector()

    def before_step(self, iteration: int, log_interval: int) -> None:
        """Called before running `iteration` (1-based): arm the recorder if it will be logged."""
        if self.recorder is not None and iteration % log_interval == 0:
            self.recorder.arm()

    def state(self) -> Optional[dict]:
        """The jump detector's history for the checkpoint (None where diagnostics are off: other ranks, the flag)."""
        return None if self.recorder is None or not self.logs else self.jumps.state_dict()

    def load_state(self, state: Optional[dict], source) -> None:
        """Restore the history saved by `state()` (absent: start empty). Raises CheckpointError naming `source`."""
        if self.recorder is None or not self.logs:
            return
        if state is None:
            logger.info("checkpoint %s has no SwiGLU diagnostics history: jump warnings start after %d log points",
                        source, self.jumps.min_points)
            return
        try:
            self.jumps.load_state_dict(state)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {source}: its '{STATE_KEY}' entry is damaged ({exc}); resume from "
                                  "another checkpoint, or delete that entry to start the jump history afresh") from None
        watched = len(self.recorder.mlps)
        dropped = [k for k in self.jumps.history if _layer_of(k) is None or _layer_of(k) >= watched]
        for key in dropped:
            del self.jumps.history[key]
        if dropped:
            logger.info("SwiGLU diagnostics: dropped the saved history of %d series of layers this rank does not "
                        "watch (another pipeline layout)", len(dropped))

    def log_values(self, iteration: int, log_interval: int) -> tuple[dict, str]:
        """TensorBoard scalars and a log-line fragment every log interval; warnings on jumps."""
        if self.recorder is None or iteration % log_interval != 0:
            return {}, ""
        per_layer = layer_diagnostics(self.model, self._over_replicas(self.recorder.collect()), self._whole)
        if not self.logs:
            return {}, ""
        values: dict[str, float] = {}
        worst: Optional[tuple[int, float]] = None
        for layer, stats in per_layer.items():
            for key, value in stats.items():
                values[f"swiglu/layer{layer}/{key}"] = value
            for key in WATCHED:
                if key not in stats:
                    continue
                previous = self.jumps.update(f"{layer}/{key}", stats[key])
                if previous is not None:
                    logger.warning("iteration %d: SwiGLU %s of layer %d jumped to %.3g (median of earlier log "
                                   "points %.3g): an FP8 outlier may be forming", iteration, key, layer,
                                   stats[key], previous)
            ratio = stats.get("outlier_ratio")
            if ratio is not None and (worst is None or ratio > worst[1]):
                worst = (layer, ratio)
        text = f" swiglu max outlier ratio: layer {worst[0]} {worst[1]:.1f} |" if worst else ""
        return values, text


    def _over_replicas(self, maxima: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """Every layer's channel maxima over the data-parallel replicas' batches, in one all-reduce for all layers."""
        present = [m for m in maxima if m is not None]
        if not present:
            return maxima
        flat = torch.cat([m.detach().float().reshape(-1) for m in present])
        comm.all_reduce(flat, self.groups[0], comm.ReduceOp.MAX)
        pieces = iter(flat.split([m.numel() for m in present]))
        return [None if m is None else next(pieces).view(m.shape) for m in maxima]

    def _whole(self, per_channel: torch.Tensor, is_activation: bool) -> torch.Tensor:
        """The layer's per-channel values from this rank's (activation maxima already over the data-parallel
        replicas, `_over_replicas`): the channels of every tensor-parallel rank in rank order (fc1's column-parallel
        layout)."""
        return torch.cat(comm.all_gather(per_channel.detach().float().contiguous(), self.groups[1]))


def _layer_of(key: str) -> Optional[int]:
    """The layer index of a series key "{layer}/{name}"; None for any other key."""
    head = key.split("/", 1)[0]
    return int(head) if head.isdigit() else None
