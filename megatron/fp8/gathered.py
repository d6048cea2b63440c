"""`Fp8GatheredWeight`: a whole FP8 weight (its FP8 bytes, scale and amax) standing for a weight of a high-precision
dtype, as FSDP2 hands it to an `Fp8Linear` under `--fp8-param-gather` (megatron/training/fp8_gather.py, which
casts each shard and gathers the bytes).

`Fp8LayerState.quantized_weight` takes its bytes and scale as the GEMM's FP8 weight (no cast); autograd sees a
weight of `dtype`, so dW comes back in that dtype. Any other op on it (a layer the FP8 controller put in high
precision) runs on the dequantized weight, Q(W) / scale.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map_only

_aten = torch.ops.aten
# Ops that only re-view the weight (FSDP2's as_strided, nn.Parameter's detach): their results stay FP8.
_VIEW_OPS = {_aten.as_strided.default, _aten.detach.default, _aten.alias.default, _aten.view.default}


class Fp8GatheredWeight(torch.Tensor):
    """The gathered FP8 weight standing for a weight of `dtype` (module docstring)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                dtype: torch.dtype) -> "Fp8GatheredWeight":
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale, self._amax = data, scale, amax

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight({self._data.dtype}, shape={tuple(self._data.shape)}, as {self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_data", "_scale", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype: torch.dtype, outer_size: Any,
                             outer_stride: Any) -> "Fp8GatheredWeight":
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], inner["_amax"], dtype)

    def dequantized(self) -> torch.Tensor:
        """The FP8 weight's values, Q(W) / scale, in the dtype it stands for."""
        return (self._data.float() / self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _VIEW_OPS:
            me = args[0]
            data = func(me._data, *args[1:], **kwargs)
            return Fp8GatheredWeight(data, me._scale, me._amax, me.dtype)
        args, kwargs = tree_map_only(Fp8GatheredWeight, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)


def gathered_in_fp8(weight: torch.Tensor) -> bool:
    return isinstance(weight, Fp8GatheredWeight)
