"""SwiGLU outlier and weight-alignment diagnostics: find the layer that is about to overflow FP8.

Two signals from the paper, per transformer layer:
- Activation outliers: max |h| of the SwiGLU product h = Swish(x W2) * (x W1) (fc2's input in a plain
  model; the *unscaled* product in a Smooth-SwiGLU model, whose fc2 input is normalised by construction),
  and the outlier ratio = that max / the median over channels of the per-channel max.
- Weight alignment: for each FFN channel i, |cos(w1_i, w2_i)| between its up (linear) row and gate (Swish)
  row of `linear_fc1`. The absolute value because w1 -> +w2 and w1 -> -w2 both make the channel quadratic.
  Summarised as max, 99th percentile and the number of channels above 0.5.

Cost model: nothing runs between log intervals. `ActivationRecorder.arm()` registers a forward hook on
every `mlp.linear_fc1` for one training step; the hook recomputes the product from fc1's output (one
elementwise op and one max over tokens per layer and micro-batch) and `collect()` removes the hooks. The
alignment is computed from the weights at log time (one [2F, H] pass per layer, no activations).

`JumpDetector` turns the logged series into warnings: a value "jumps" when it exceeds `factor` (2x) times
the median of its last `window` (32) log points, once at least `min_points` (3) of them exist. Its history is
plain data (`state_dict`), saved in checkpoints by the training loop, so a resumed run warns at its first log
point instead of needing `min_points` new ones (by which time a high value is the new normal).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.smooth_swiglu import swiglu_channel_maxima
from megatron.partitioned import gathered

ALIGNMENT_THRESHOLD = 0.5


def up_gate_alignment(fc1_weight: torch.Tensor) -> torch.Tensor:
    """|cos| between row i of up (w1) and row i of gate (w2) for every channel: fp32 [F].

    `fc1_weight` is `linear_fc1.weight` laid out [gate | up] ([2F, H]). A zero row gives 0. A sharded weight
    (FSDP2's DTensor, ZeRO-3's partitions) is gathered whole first: a collective, so every rank holding a part of
    it calls this.
    """
    with gathered(fc1_weight) as weight:  # read inside: the gathered storage is released after the block
        gate, up = weight.float().chunk(2, dim=0)
        return F.cosine_similarity(up, gate, dim=-1, eps=1e-12).abs()


def alignment_summary(cosines: torch.Tensor) -> dict[str, float]:
    """max, p99 and the number of channels above `ALIGNMENT_THRESHOLD` of |cos| per channel."""
    return {"align_max": float(cosines.max()),
            "align_p99": float(torch.quantile(cosines, 0.99)),
            "align_count_gt_0.5": float((cosines > ALIGNMENT_THRESHOLD).sum())}


def outlier_summary(channel_max: torch.Tensor) -> dict[str, float]:
    """max |h| and its ratio to the median channel max (inf-safe: a zero median gives ratio 0)."""
    top = float(channel_max.max())
    median = float(channel_max.median())
    return {"act_max": top, "outlier_ratio": top / median if median > 0 else 0.0}


def _swiglu_mlps(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        return []
    return [layer.mlp for layer in layers if getattr(layer.mlp, "swiglu", False)]


class ActivationRecorder:
    """Per-channel running max of the SwiGLU product of every layer, only while armed."""

    def __init__(self, model: nn.Module) -> None:
        self.mlps = _swiglu_mlps(model)
        self._handles: list[Any] = []
        self._maxima: list[Optional[torch.Tensor]] = [None] * len(self.mlps)
        self._index: dict[int, int] = {}

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    # Outside any compiled graph (a graph break in a compiled block, on the armed iterations only): traced, this
    # hook's per-layer bookkeeping (which list slot, whether it is empty) would make dynamo compile the block once
    # more per layer. One bound method for every layer, the layer found by its fc1.
    @torch.compiler.disable
    def _record(self, fc1: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        index = self._index[id(fc1)]
        cmax = swiglu_channel_maxima(out)
        prev = self._maxima[index]
        self._maxima[index] = cmax if prev is None else torch.maximum(prev, cmax)

    def arm(self) -> None:
        """Record from the next forward passes on (idempotent)."""
        if self.armed:
            return
        self._maxima = [None] * len(self.mlps)
        self._index = {id(mlp.linear_fc1): i for i, mlp in enumerate(self.mlps)}  # the fc1s of now (FP8 swaps them)
        self._handles = [mlp.linear_fc1.register_forward_hook(self._record) for mlp in self.mlps]

    def collect(self) -> list[Optional[torch.Tensor]]:
        """Per layer the per-channel max recorded since `arm()` (None if no forward ran); disarms."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        maxima, self._maxima = self._maxima, [None] * len(self.mlps)
        return maxima


class JumpDetector:
    """Flags values above `factor` x the median of the same series' last `window` log points.

    Why a window of 32 log points by default: the median of W points only moves past a plateau when more than
    W/2 of them are off it, so up to 15 spikes in a window (a single spike certainly) leave the reference where
    it was and the next spike still warns. And the reference is never older than W/2 log points: a value that
    drifts up by r per log point sits r^(W/2) above its median, so a drift slower than 2^(1/16) = +4.4% per log
    point is followed without a warning, one that doubles within 16 log points is called a jump. Over the whole
    run (the previous behaviour) the median lags by half the run: after a long slow rise every log point warns,
    and the history grows without bound. Memory is W floats per series.

    Non-finite values are judged (inf is a jump) but not kept: one NaN would make every later median
    meaningless. `state_dict()` is plain data ({"history": {key: [float, ...]}}, JSON- and pickle-safe).
    """

    def __init__(self, factor: float = 2.0, min_points: int = 3, window: int = 32) -> None:
        if not factor > 1.0:
            raise ValueError(f"JumpDetector factor must be > 1, got {factor}")
        if not 1 <= min_points <= window:
            raise ValueError(f"JumpDetector needs 1 <= min_points <= window, got min_points {min_points}, "
                             f"window {window}")
        self.factor = factor
        self.min_points = min_points
        self.window = window
        self.history: dict[str, deque[float]] = {}

    def update(self, key: str, value: float) -> Optional[float]:
        """Judge `value` against the window, then append it; return the window's median when this is a jump."""
        past = self.history.setdefault(key, deque(maxlen=self.window))
        jump = None
        if len(past) >= self.min_points:
            median = statistics.median(past)
            if median > 0 and value > self.factor * median:
                jump = median
        if math.isfinite(value):
            past.append(float(value))
        return jump

    def state_dict(self) -> dict:
        return {"history": {key: list(values) for key, values in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Replace the history with `state`'s (its last `window` points per series, when it holds more).

        Raises ValueError on anything but {"history": {str: [finite numbers]}}.
        """
        history = state.get("history") if isinstance(state, dict) else None
        if not isinstance(history, dict):
            raise ValueError(f"jump-detector state must be {{'history': {{key: [floats]}}}}, got {type(state).__name__}"
                             f" with keys {list(state)[:5] if isinstance(state, dict) else '-'}")
        loaded: dict[str, deque[float]] = {}
        for key, values in history.items():
            if not isinstance(key, str) or not isinstance(values, (list, tuple)) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
                raise ValueError(f"jump-detector state: series {key!r} is not a list of finite numbers")
            loaded[key] = deque((float(v) for v in values), maxlen=self.window)
        self.history = loaded


def layer_diagnostics(model: nn.Module, channel_maxima: Optional[list[Optional[torch.Tensor]]] = None,
                      whole: Optional[Callable[[torch.Tensor, bool], torch.Tensor]] = None
                      ) -> dict[int, dict[str, float]]:
    """{layer index: {align_max, align_p99, align_count_gt_0.5[, act_max, outlier_ratio]}}.

    `whole(per_channel, is_activation)` turns this rank's per-channel values into the layer's (under tensor
    parallelism each rank holds a slice of the channels, under data parallelism a share of the batch); it is a
    collective, called in the same order on every rank of the groups it spans."""
    whole = whole or (lambda values, _: values)
    out: dict[int, dict[str, float]] = {}
    for i, mlp in enumerate(_swiglu_mlps(model)):
        values = alignment_summary(whole(up_gate_alignment(mlp.linear_fc1.weight), False))
        if channel_maxima is not None and channel_maxima[i] is not None:
            values.update(outlier_summary(whole(channel_maxima[i], True)))
        out[i] = values
    return out
