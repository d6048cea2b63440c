"""`Fp8Linear` traced into a compiled transformer block: one graph per block, no graph break per linear.

A compiled block (`--torch-compile`, megatron/model/compile.py) used to run each `Fp8Linear` eagerly (a graph
break): dynamo cannot trace the eager autograd function, which keeps the layer's state and a Python-side FP8 weight
cache on its context. A block with four linears was then five graphs, and inductor could not fuse an FP8 cast
into the op that produced its operand (the RMSNorm before qkv and fc1, the SwiGLU product before fc2): the
fusion Transformer Engine writes by hand (its LayerNormLinear) and torchao gets from a traced Float8Linear.

Here the layer is expressed in what dynamo traces: the quantization of x and W is ordinary code of the block
(the functions of fused.py, inlined into the block's graph), and `per_tensor.Fp8Gemms`, the autograd function of
the eager layer too, whose forward and backward take tensors and Python constants only, runs the three GEMMs; its
backward quantizes dy and updates the grad role's scaling buffers in place (AOTAutograd keeps a backward graph's
mutation of a forward input). The arithmetic is the eager path's, operation for operation (the same fused.py
functions, the same `gemm_nt`); inductor may fuse the output's rounding to bf16 into the next op (as in any
compiled block), so a traced block agrees with an eager one within rounding noise, and per operation bitwise
(tests/unit/test_fp8_traced.py).

The FP8 weight: a cache keyed on the weight's storage and version cannot live in a graph, so the compiled
block's pre-hook (`register_fp8_weight_refresh` in megatron/model/compile.py, run eagerly before the graph)
takes this step's FP8 weight from the eager layer's per-step cache (`Fp8Linear.refresh_step_weight`) and the
graph reads it as an input: W is cast once per optimizer step, as in the eager layer (Transformer Engine caches
it across micro-batches too; torchao's Float8Linear casts per call). So is dgrad's row-major W^T for backends
that want one (`_scaled_mm`): made with the step's weight, an input of the backward graph (tests/unit/
test_fp8_traced_graph.py), not a transpose per micro-batch. Without the hook (a module compiled by
hand) and for a Smooth-SwiGLU fc2 (W diag(c) changes every micro-batch) the graph casts W itself, per call, with
the same bits; such in-graph casts are not counted in `Fp8LayerState.weight_quantizations`. Either way the forward's FP8
weight is what backward uses.

Delayed scaling: the casts of x, dy (and an in-graph W) use the history's scale once it is valid; before that,
the tensor's own amax (the first step). In the graph that choice is a `where` on the validity buffer, which makes
every cast wait for its tensor's amax reduction: two passes over the tensor. The pre-hook also reads which roles
are valid (`Fp8LayerState.refresh_scale_validity`: a host read in the first steps only, validity never turns back),
and the graph traced after that casts with the history's scale alone; the amax, still computed for the
history, no longer precedes the cast (tests/unit/test_fp8_traced_graph.py). The result is the same bits.

Configurations dynamo would not see through stay on the eager path (a graph break, as before): the tiled
recipes, stochastic rounding of gradients (its noise comes from the eager generator stream), statistics
iterations (`Fp8LayerState.stats_enabled`), a Smooth-SwiGLU column scale reduced over a TP group (a collective in
the block), the Gaudi backend and unfused quantization.
`traceable` is the list.

Where it has run: the torch engine (DDP), DeepSpeed ZeRO 0-2, tensor parallelism with sequence parallelism,
full activation recompute, Smooth-SwiGLU (tests/e2e/test_torch_compile_launch.py, slow). Not with pipeline
parallelism or ZeRO-3, whose blocks stay eager (megatron/model/compile.py): a pipeline schedule runs several
micro-batches' forwards before their backwards, and `Fp8Gemms` saves the layer's scaling buffers for its backward,
which autograd's in-place checks have not been tried against.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from megatron.fp8 import fused
from megatron.fp8.backends import STATELESS_BACKENDS, select_backend
from megatron.fp8.layer_state import Fp8LayerState
from megatron.fp8.per_tensor import ROLE_INPUT, ROLE_WEIGHT, Fp8Gemms, gemm_constants
from megatron.fp8.quantize import nonfinite_guard
# The emulated backend (the CPU's) is traced only from this torch on: with torch 2.11's inductor (C++ code) the
# traced dgrad of an FP8 linear comes out zero (tests/unit/test_fp8_traced.py, bitwise against eager, fails there);
# the scaled_mm backend traces bit for bit on both. Older torch runs those layers eagerly (a graph break).
EMULATED_TRACE_MIN_TORCH = (2, 13)
logger = logging.getLogger(__name__)


@torch._dynamo.assume_constant_result
def _emulated_traceable() -> bool:
    """Whether this torch traces the emulated backend's layers (evaluated in Python when the graph is traced)."""
    if torch.torch_version.TorchVersion(torch.__version__) >= EMULATED_TRACE_MIN_TORCH:
        return True
    _log_emulated_untraced(torch.__version__)
    return False


@functools.lru_cache(maxsize=None)
def _log_emulated_untraced(version: str) -> None:
    logger.warning("FP8 layers on the emulated backend run eagerly inside compiled blocks with torch %s (traced into "
                   "the graph from torch %d.%d on: older inductor computes their backward wrongly)", version,
                   *EMULATED_TRACE_MIN_TORCH)


@torch._dynamo.assume_constant_result
def _backend_name(choice: str, device: torch.device, scaling: str) -> str:
    """The backend's name, evaluated when the graph is traced (selection reads the device's capabilities)."""
    return select_backend(choice, device, scaling).name


def traceable(state: Fp8LayerState, x: torch.Tensor, column_scale_group: Any) -> bool:
    """Whether this call can be traced into the enclosing compiled graph (module docstring); evaluated while
    tracing, so dynamo guards on what it reads and a change (statistics switched on) retraces."""
    if not state.takes_traced_path() or state.stats_enabled or column_scale_group is not None:
        return False
    recipe = state.recipe
    name = _backend_name(recipe.backend.value, x.device, recipe.scaling.value)
    if name == "emulated" and not _emulated_traceable():
        return False
    return name in STATELESS_BACKENDS


def forward(state: Fp8LayerState, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype, training: bool, column_scale: torch.Tensor | None,
            input_amax: torch.Tensor | None) -> torch.Tensor:
    """y = Q(x) Q(W)^T + b (W diag(c) with `column_scale`), traceable; records amaxes as the eager layer does."""
    recipe = state.recipe
    backend = STATELESS_BACKENDS[_backend_name(recipe.backend.value, x.device, recipe.scaling.value)]
    specs = state.specs(backend)
    x2d = x.reshape(-1, x.shape[-1])
    values_dtype = state.values_dtype(backend)
    w_spec = specs[ROLE_WEIGHT]
    known_valid = state.known_valid  # read while tracing: a change retraces (once per run)
    with torch.autocast(x.device.type, enabled=False), torch.no_grad():
        q_x, v_x, s_x, x_amax = state.quantize_input(backend, specs[ROLE_INPUT], x2d.detach(), input_amax,
                                                     values_dtype, training, known_valid[ROLE_INPUT])
        w_t = None  # dgrad's row-major W^T (backends that want one): from the step's cache, else made in backward
        if column_scale is None and state.step_weight is not None:  # made once per step, outside the graph
            (q_w, s_w, w_amax, w_t), v_w = state.step_weight, None
        elif column_scale is None:
            q_w, v_w, s_w, w_amax = state.fused_quantize(ROLE_WEIGHT, weight.detach(), w_spec,
                                                         state.weight_values_dtype(backend), False,
                                                         known_valid=known_valid[ROLE_WEIGHT])
        else:  # W diag(c): the amax from the step's column maxima (the pre-hook's), else reduced here
            maxima = state.step_column_maxima
            if maxima is None:
                maxima = fused.column_maxima(weight.detach())
            q_w, v_w, s_w, w_amax = state.column_scaled_weight(weight, backend, w_spec, column_scale, None, maxima)
        state.note_weight_use(s_w, w_amax, training)
        s_x = nonfinite_guard(s_x, x_amax)
        s_w = nonfinite_guard(s_w, w_amax)
    consts = gemm_constants(state, backend, out_dtype, x.dtype, weight.dtype, training, values_dtype, False)
    # What wgrad reads: Q(x) (1 byte per element), or x itself for a high-precision wgrad. None: the GEMM operand
    # itself (dynamo refuses one tensor passed twice).
    saved_x = (None if v_x is None else q_x) if recipe.fp8_wgrad else x2d.detach()
    y2d = Fp8Gemms.apply(x2d, weight, bias, q_x if v_x is None else v_x, s_x, q_w if v_w is None else v_w, s_w, w_t,
                         saved_x, column_scale, state.scale, state.scale_valid, state.step_amax, consts, None)
    return y2d.reshape(*x.shape[:-1], y2d.shape[-1])

