"""The steps the two FP8 autograd functions share: per-tensor scaling (`per_tensor.Fp8Gemms`, eager and traced) and
tile scaling (`tiled.TiledFp8LinearFunction`) differ in how they quantize and multiply, not in what surrounds that.

Forward: the layer's backend and formats, the input flattened to [tokens, K]; after the GEMM, the bias and the
input's leading dims restored; what backward needs about the call kept on `ctx`. Backward: the high-precision
weight gradient (`recipe.fp8_wgrad=False`), Smooth-SwiGLU's column scale applied to dW (d/dW of W diag(c)), dW
in the weight's dtype, and the bias gradient.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.fp8.backends import Backend
    from megatron.fp8.formats import Fp8FormatSpec
    from megatron.fp8.layer_state import Fp8LayerState


def begin(state: "Fp8LayerState", x: torch.Tensor) -> tuple["Backend", tuple["Fp8FormatSpec", ...], torch.Tensor]:
    """(backend, the role formats, x as [tokens, K])."""
    backend = state.backend(x.device)
    return backend, state.specs(backend), x.reshape(-1, x.shape[-1])


def add_bias(y: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return y if bias is None else y + bias.to(out_dtype)


def finish_forward(ctx: Any, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   state: "Fp8LayerState", backend: "Backend", specs: tuple, weight_fp8: Any,
                   training: bool) -> torch.Tensor:
    """Keep on `ctx` what backward needs besides the saved tensors; y with x's leading dims. The FP8 weight is
    kept unless it is made per call (ZeRO-3: backward makes it again from `ctx.weight`, the weight object, which
    DeepSpeed re-gathers)."""
    ctx.state, ctx.backend, ctx.specs = state, backend, specs
    ctx.weight_fp8 = None if state.weight_per_call else weight_fp8
    ctx.weight, ctx.training = weight, training
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.shape, x.dtype, weight.dtype, bias is not None
    return y.reshape(*x.shape[:-1], y.shape[-1])


def high_precision_wgrad(dy2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """dW = dy^T x in fp32 from the unquantized operands (`recipe.fp8_wgrad=False`)."""
    return dy2d.float().t() @ x2d.float()


def finish_weight_grad(ctx: Any, dw: torch.Tensor, column_scale: torch.Tensor | None) -> torch.Tensor:
    """dW of the layer's weight: the GEMM computed d/d(W diag(c)), so scale its columns back by c."""
    if column_scale is not None:
        dw = dw * column_scale.float()
    return dw.to(ctx.w_dtype)


def bias_grad(ctx: Any, dy2d: torch.Tensor) -> torch.Tensor | None:
    if not (ctx.has_bias and ctx.needs_input_grad[2]):
        return None
    return dy2d.float().sum(dim=0).to(ctx.w_dtype)
