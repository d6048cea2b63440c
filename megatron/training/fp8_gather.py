"""`--fp8-param-gather` under FSDP2: each FP8 linear's weight cast to FP8 on its shard and all-gathered as 1 byte per
element, through FSDP2's documented extension point (`fsdp_pre_all_gather` / `fsdp_post_all_gather` on the
sharded parameter's local tensor).

Two tensor subclasses:
- `Fp8ShardWeight` is the high-precision shard (FP32 master, in the optimizer) with the extension methods. Every
  other op runs on the plain tensor inside it (the optimizer's updates, the checkpoint's reads and writes);
  the ops FSDP2 uses to cut and pad the shard keep the subclass.
- `Fp8GatheredWeight` is what FSDP2 hands the module after the gather: the whole FP8 weight, its scale and amax,
  standing for a weight of the gathering dtype (BF16 under `--bf16`). `Fp8Linear` takes its FP8 bytes and scale
  as the GEMM operand (`Fp8LayerState.quantized_weight`) and returns dW in that dtype, which FSDP2
  reduce-scatters into the master's gradient as usual. Any other op on it (a layer the FP8 controller put in
  high precision) sees the dequantized weight.

The scale every rank casts its shard with must be one scale, the scale the whole weight would get: the FP8 bytes
then equal a gather in high precision followed by the cast (tests/e2e/test_fsdp2_fp8_gather.py compares them
bitwise). `GatherScales.prepare` sets it before the forward (a pre-hook on the root module), once per optimizer
step: a layer cast with its delayed-scaling history scale needs no collective (its shard's amax joins the step's
amax, max-reduced over the data-parallel ranks at the step's end as always); a layer cast with a current scale
(tensorwise, or delayed before its history holds a valid scale) needs the whole weight's amax, which one all-reduce
(MAX) of all those layers' shard amaxes together gives.

The shard is cast in the gathering dtype (rounded to BF16 first under `--bf16`), as the high-precision gather would
cast it. The weight's quantization statistics are each rank's shard's (the FP8 controller max-reduces them over
the ranks). Layers that scale W's columns per call (Smooth-SwiGLU's fc2) need W itself and gather it in high
precision.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from megatron import comm
from megatron.fp8.gathered import Fp8GatheredWeight
from megatron.fp8.quantize import amax_of
from megatron.fp8.scaling import Fp8Role

_aten = torch.ops.aten
# Ops FSDP2 uses to cut, pad, copy and wrap a shard: their results stay shards (the others return plain tensors).
_SHARD_OPS = {_aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
              _aten.view.default, _aten.as_strided.default, _aten.split.Tensor, _aten.detach.default,
              _aten.alias.default, _aten.chunk.default}


@dataclasses.dataclass
class GatherSlot:
    """What one layer's shard is cast with, shared by every tensor cut from the same parameter: the layer's FP8
    state, and the scale and amax `GatherScales.prepare` set for this step (with the step they belong to)."""

    state: Any  # Fp8LayerState
    scale: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None
    key: Any = None
    gathers: int = 0  # FP8 gathers of this weight (tests read it)


class Fp8ShardWeight(torch.Tensor):
    """A high-precision shard of an FP8 linear's weight that FSDP2 gathers in FP8 (module docstring)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, slot: GatherSlot) -> "Fp8ShardWeight":
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   layout=tensor.layout, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, slot: GatherSlot) -> None:
        self._tensor = tensor
        self._slot = slot

    def __repr__(self) -> str:
        return f"Fp8ShardWeight({self._tensor})"

    @property
    def plain(self) -> torch.Tensor:
        """The high-precision tensor inside (the same storage): what an optimizer steps in place."""
        return self._tensor

    def __tensor_flatten__(self) -> tuple[list[str], GatherSlot]:
        return ["_tensor"], self._slot

    @staticmethod
    def __tensor_unflatten__(inner: dict, slot: GatherSlot, outer_size: Any, outer_stride: Any) -> "Fp8ShardWeight":
        return Fp8ShardWeight(inner["_tensor"], slot)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        slots = []

        def unwrap(t: "Fp8ShardWeight") -> torch.Tensor:
            slots.append(t._slot)
            return t._tensor

        args, kwargs = tree_map_only(Fp8ShardWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _SHARD_OPS:
            return out
        return tree_map_only(torch.Tensor, lambda t: Fp8ShardWeight(t, slots[0]), out)

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple, module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The FP8 bytes of this shard (uint8, padded to FSDP2's shard size) and, as metadata, the scale and amax."""
        slot = self._slot
        if slot.scale is None:
            raise RuntimeError("--fp8-param-gather: a weight was gathered before its scale was set "
                               "(GatherScales.prepare runs before the root module's forward)")
        dtype = mp_policy.param_dtype or self._tensor.dtype
        state = slot.state
        backend = state.backend(self._tensor.device)
        spec = state.specs(backend)[Fp8Role.WEIGHT]
        with torch.no_grad():
            high = self._tensor.to(dtype)
            q = backend.quantize(high, slot.scale, spec)
            # This shard's statistics (--log-fp8-stats); the FP8 controller max-reduces them over the ranks.
            state.record_stats(Fp8Role.WEIGHT, high, q, slot.scale, spec)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every shard to ceil(rows / ranks) rows
        if q.size(0) < rows:
            q = torch.cat([q, q.new_zeros((rows - q.size(0), *q.shape[1:]))])
        slot.gathers += 1
        return (q.view(torch.uint8),), (slot.scale, slot.amax, q.dtype)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, tuple]]:
        """The gathered FP8 weight (a view of FSDP2's buffer), or the scale of this gather written into `out`."""
        scale, amax, fp8_dtype = metadata
        data = outputs[0].view(fp8_dtype)
        if out is not None:  # FSDP2 refilled the same buffer; the scale is this gather's
            out._scale, out._amax = scale, amax
            return None
        return Fp8GatheredWeight(data, scale, amax, param_dtype), (data,)


def plain_tensor(t: Any) -> Any:
    """`t`, or the plain tensor inside an `Fp8ShardWeight` (what a checkpoint stores)."""
    return t._tensor if isinstance(t, Fp8ShardWeight) else t


def plain_dtensor(t: Any) -> Any:
    """A DTensor whose local tensor is an `Fp8ShardWeight` as one around the plain tensor inside (the same storage:
    what DCP writes, and loads into); anything else as it is."""
    local = getattr(t, "_local_tensor", None)
    if not isinstance(local, Fp8ShardWeight):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local._tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def eligible_layers(model: nn.Module) -> list[nn.Module]:
    """The FP8 linears whose weight can travel in FP8: per-tensor recipes, and not a column-scaled weight
    (Smooth-SwiGLU's fc2, which needs W itself)."""
    from megatron.fp8 import Fp8Linear
    from megatron.model.transformer import MLP

    column_scaled = {id(m.linear_fc2) for m in model.modules() if isinstance(m, MLP) and m.fc2_weight_column_scaled}
    return [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fp8.recipe.tiles is None
            and id(m) not in column_scaled]


def wrap_weights(layers: list[nn.Module]) -> list[GatherSlot]:
    """Before `fully_shard`: each layer's weight becomes an `Fp8ShardWeight` parameter (the same values)."""
    slots = []
    for layer in layers:
        slot = GatherSlot(layer.fp8)
        weight = layer.weight
        layer.weight = nn.Parameter(Fp8ShardWeight(weight.data, slot), requires_grad=weight.requires_grad)
        slots.append(slot)
    return slots


class GatherScales:
    """Sets each FP8-gathered weight's scale before the forward, once per optimizer step (module docstring)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], group: Any, param_dtype: torch.dtype | None):
        """After `fully_shard`: `layers`' weights are the sharded parameters, which FSDP2 keeps as they are (the
        module attribute turns into the gathered weight between forward and backward)."""
        self.params = [layer.weight for layer in layers]
        self.group, self.param_dtype = group, param_dtype
        self.collectives = 0  # all-reduces made (tests read it)
        for name, shard in zip((type(layer).__name__ for layer in layers), self._shards()):
            if not isinstance(shard, Fp8ShardWeight):
                raise RuntimeError(f"--fp8-param-gather: a {name} weight is not an FP8-gathered shard after "
                                   f"fully_shard ({type(shard).__name__})")
        model.register_forward_pre_hook(lambda module, args: self.prepare(), prepend=True)

    def _shards(self) -> list[Fp8ShardWeight]:
        return [getattr(p, "_local_tensor", p) for p in self.params]

    def forget(self) -> None:
        """The shards were written from outside (a checkpoint's load): make every scale again."""
        for shard in self._shards():
            shard._slot.key = None

    def prepare(self) -> None:
        """The scale and amax of every FP8-gathered weight for this step (unchanged since the last call: nothing)."""
        shards = self._shards()
        # The weights and how they are cast change only where the layer forgets its FP8 weight (each optimizer step,
        # a setting the FP8 controller changes), on every rank alike. A version counter would not tell: the
        # optimizer updates the plain tensor inside the shard, below autograd, where no counter is bumped.
        keys = [(s._slot.state.weight_generation, s._tensor.data_ptr()) for s in shards]
        stale = [(s, k) for s, k in zip(shards, keys) if s._slot.key != k]
        if not stale:
            return
        with torch.no_grad():
            amaxes = torch.stack([amax_of(s._tensor.to(self.param_dtype or s._tensor.dtype)) for s, _ in stale])
            if any(not _history_scaled(s._slot.state) for s, _ in stale):
                comm.all_reduce(amaxes, self.group, comm.ReduceOp.MAX)
                self.collectives += 1
            for (shard, key), amax in zip(stale, amaxes):
                slot = shard._slot
                state = slot.state
                spec = state.specs(state.backend(shard._tensor.device))[Fp8Role.WEIGHT]
                slot.scale = state.scale_for(Fp8Role.WEIGHT, amax, spec, record=False).clone()
                slot.amax, slot.key = amax, key


def _history_scaled(state: Any) -> bool:
    """The weight is cast with its delayed-scaling history scale, which every rank holds alike."""
    return state.role_delayed(Fp8Role.WEIGHT) and state.known_valid[int(Fp8Role.WEIGHT)]
