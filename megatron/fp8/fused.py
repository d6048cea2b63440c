"""Fused FP8 quantization: amax, scale, clamp, cast (and the GEMM operand) in compiled kernels.

Eager quantization of one tensor is a chain of separate passes over it: |x|, amax, upcast, multiply, clamp,
cast to FP8 and, for the emulated GEMM, the cast back to fp32 (slow on CPU: scalar conversion, ~5 ns per
element on a Xeon). The functions here express the same arithmetic as `quantize.py` in one traceable
function each and hand it to `torch.compile` (C++ on CPU, Triton on GPU, from this same code). Inductor then
emits one reduction (the amax) and one pointwise kernel that writes the FP8 tensor and, when asked, the
same values in fp32 for the emulated GEMM: two reads of x instead of five or six.

The eager functions in `quantize.py` stay the reference and the fallback. Whether a layer uses the functions
here is the layer's choice (`Fp8LayerState.fused_quantization`, set for a whole model by `set_fused_quantization`
from `--torch-compile`, see megatron/model/compile.py). One thing is per process: the graphs for every shape that
`warm_up_upcasts` compiles at start-up in the CPU bf16 GEMM mode, which the GEMMs' conversions and the eager layer's
casts (`known_values`) and epilogue then take, called directly where this torch can (direct.py). The wrappers call
the eager reference for inputs the compiled path does not take (empty tensors) and, with one warning, forever after a
compilation failure. Results are bitwise those of the eager path (the same fp32 operations, see
tests/unit/test_fp8_fused.py and test_cpu_fp8_eager_values.py).

Recompilation: every function is compiled with `dynamic=False` (a linear's shapes do not change between
steps) and takes step-dependent values (scales, validity flags) as 0-d tensors, never as Python numbers;
the Python constants (fp8 maximum, margin, dtypes) take a handful of values per model. Layers of the same
shape share one compiled kernel. The per-function recompile limit is raised to hold one entry per distinct
(shape, constants) of a model: Llama-style models have ~8 GEMM operand shapes per role.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

from megatron.fp8 import direct
from megatron.fp8.grid import fp8_grid, has_grid
from megatron.fp8.quantize import column_scaled, compute_scale

logger = logging.getLogger(__name__)

# Distinct operand shapes x constants of one model; dynamo's default limit (8) would drop to eager silently.
_RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Dynamo's per-code-object cache limit raised to `_RECOMPILE_LIMIT` (never lowered): beyond its limit dynamo
    runs the function eagerly, with one log line. For the fused functions here and the compiled blocks
    (megatron/model/compile.py), whose variants (training, evaluation, FP8 statistics iterations, delayed
    scaling's history turned valid) are one cache entry each on one code object."""
    from torch._dynamo import config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # renamed across torch versions
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))


class CompiledOrEager:
    """`fn` compiled on first use; `fn` itself after compiling or running the compiled code failed once (warned
    once, naming `what`; eager for the rest of the process). Compiler failures surface on the first call, before
    the compiled code has written anything, so the eager call that follows computes the same result. Shared by the
    fused quantization and Fp8AdamW's update."""

    def __init__(self, fn: Callable[..., Any], what: str = "", *, dynamic: bool | None = False,
                 fullgraph: bool = True) -> None:
        self.fn, self.what = fn, what or fn.__name__
        self.dynamic, self.fullgraph = dynamic, fullgraph
        self.compiled: Callable[..., Any] | None = None
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        # Inside a region dynamo is tracing (an FP8 layer traced into a compiled transformer block, traced.py),
        # the function is traced into the enclosing graph: no nested compilation.
        if self.failed or torch.compiler.is_compiling():
            return self.fn(*args)
        if self.compiled is None:
            raise_recompile_limit()
            # A graph whose shapes may turn dynamic is compiled once for every size, but inductor's C++ code decides
            # at compile time whether a loop runs on all threads, from the size it is compiled with (serial below
            # ~1,000 elements) and the thread count then: compiled on a small first input it ran every later call,
            # of any size, on one core (and its on-disk cache entry is not keyed on that size). `dynamic_threads`
            # makes each loop an OpenMP region whose threads are decided when it runs.
            options = None if self.dynamic is False else {"cpp.dynamic_threads": True}
            self.compiled = torch.compile(self.fn, dynamic=self.dynamic, fullgraph=self.fullgraph, options=options)
        try:
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager reference computes the same
            self.failed = True
            logger.warning("torch.compile of %s failed (%s: %s); using the eager path", self.what,
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return self.fn(*args)


_ALL: list[CompiledOrEager] = []


def _fused(fn: Callable[..., Any], dynamic: bool = False) -> CompiledOrEager:
    """A fused-quantization function: compiled on first use (eager after a compilation failure); `dynamic`: one graph
    for every shape (element-wise functions), else one per shape."""
    wrapper = CompiledOrEager(fn, f"the fused FP8 quantization ({fn.__name__})", dynamic=dynamic)
    _ALL.append(wrapper)
    return wrapper


@contextlib.contextmanager
def uncompiled() -> Iterator[None]:
    """Inside: every fused function runs its Python (the same arithmetic, op by op) instead of compiled code.
    For tensors without storage (the performance model's fake tensors, megatron/perf/extract.py), on which
    compiled kernels cannot run."""
    saved = [w.failed for w in _ALL]
    for w in _ALL:
        w.failed = True
    try:
        yield
    finally:
        for w, failed in zip(_ALL, saved):
            w.failed = failed


def failed_functions() -> list[str]:
    """The fused functions whose compilation failed in this process (they run the eager reference since): what
    the `--torch-compile` startup line reports, so that it never claims compiled code that is not running."""
    return [w.fn.__name__ for w in _ALL if w.failed]


def _values(q: torch.Tensor, values_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 values of `q`, exactly, in `values_dtype` (fp32 or bf16, both hold every FP8 value). Through fp32:
    inductor's CPU code converts FP8 to fp32 in vector instructions, FP8 to bf16 element by element (measured on
    4096 x 704 E4M3: 1.2 ms through fp32, 4.4 ms directly)."""
    return q.float().to(values_dtype)


def _cast(y: torch.Tensor, dtype: torch.dtype, values_dtype: torch.dtype | None, keep_q: bool = True):
    """(Q(y), its values in `values_dtype` or None) for fp32 `y` clamped to the format's range. Compiled on CPU, the
    values are y rounded to the FP8 grid in fp32 arithmetic (grid.py: the same numbers, in vector instructions, where
    inductor's conversion to E5M2 and back is slow); Q itself is written only where a caller keeps it (`keep_q`
    False: None in its place, for a caller that needs the values only). Not in Triton's code: it may contract a
    multiply and a subtraction into one fused multiply-add, which the rounding cannot take."""
    in_graph = torch.compiler.is_compiling() or direct.tracing()
    if values_dtype is not None and in_graph and has_grid(dtype) and y.device.type == "cpu":
        return (y.to(dtype) if keep_q else None), fp8_grid(y, dtype).to(values_dtype)
    q = y.to(dtype)
    if values_dtype is None:
        return q, None
    return (q if keep_q else None), _values(q, values_dtype)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| in fp32, traced (`quantize.amax_of`'s value: |.| and max round nothing). |x| is taken in fp32: of a bf16
    x, inductor would otherwise round |x| to bf16 and back in every element of the loop (the block's
    `emulate_precision_casts`), a conversion that changes nothing."""
    return x.float().abs().amax()


def _quantize_tensor(x: torch.Tensor, previous: torch.Tensor, valid: torch.Tensor, delayed: bool, fp8_max: float,
                     margin: int, pow2: bool, dtype: torch.dtype, values_dtype: torch.dtype | None,
                     known_valid: bool = False, keep_q: bool = True):
    """amax of x, its scale (`Fp8LayerState.scale_for`'s rule) and Q(x) (`quantize`), in one function. With
    `known_valid` (delayed scaling whose history is known to hold a scale: `valid` is True) the cast takes the
    history's scale and does not wait for x's amax, which then only feeds the history: one pass over x can
    produce both."""
    scale_known = delayed and known_valid
    amax = None if scale_known else _amax(x)
    if scale_known:
        scale = previous.float()
    else:
        current = compute_scale(amax, fp8_max, margin, pow2, previous=previous)
        scale = torch.where(valid, previous.float(), current) if delayed else current
    q, values = _cast(torch.clamp(x.float() * scale, -fp8_max, fp8_max), dtype, values_dtype, keep_q)
    if amax is None:
        # After the cast: inductor's CPU scheduler fuses a reduction into the loop of a pointwise kernel over the same
        # elements that comes before it, not into one after it (there the amax was a pass of its own).
        amax = _amax(x)
    return q, values, scale, amax


def _quantize_known(x: torch.Tensor, scale: torch.Tensor, column_scale: torch.Tensor | None, fp8_max: float,
                    dtype: torch.dtype, values_dtype: torch.dtype | None):
    """Q(x diag(column_scale)) with a given scale (no amax pass)."""
    y = x.float() if column_scale is None else column_scaled(x, column_scale)
    return _cast(torch.clamp(y * scale.float(), -fp8_max, fp8_max), dtype, values_dtype)


def _upcast(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _values(q, dtype)


def _known_values(x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                  values_dtype: torch.dtype) -> torch.Tensor:
    """The values of Q(x) with a known scale, in `values_dtype`; Q(x) itself is not written."""
    return _cast(torch.clamp(x.float() * scale.float(), -fp8_max, fp8_max), dtype, values_dtype, keep_q=False)[1]


def _known_values_amax(x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                       values_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`_known_values` and the amax of x (`quantize.amax_of`'s), from one read of x."""
    return _known_values(x, scale, fp8_max, dtype, values_dtype), _amax(x)


_quantize_tensor_c = _fused(_quantize_tensor)
_quantize_known_c = _fused(_quantize_known)
_upcast_c = _fused(_upcast)
# Element-wise: one graph per FP8 format and layout for every shape, compiled at start-up by `warm_up_upcasts` in the
# runs that take it (cpu_gemm's bf16 mode), instead of one per weight and activation shape inside the first iterations.
_upcast_any_shape = _fused(_upcast, dynamic=True)
_known_values_any_shape = _fused(_known_values, dynamic=True)
_known_values_amax_any_shape = _fused(_known_values_amax, dynamic=True)
_DIRECT = direct.DirectGraphs()  # the start-up's graphs called without torch.compile's per-call work (direct.py)
_warmed_up: set[torch.dtype] = set()  # the dtypes `warm_up_upcasts` compiled the dynamic graphs for
_eager_ready: set[torch.dtype] = set()  # ... and the eager layers' casts (`eager_layers`) for
# The input dtype of the activations and gradients `known_values` takes: the dynamic graphs are made for it.
_ACTIVATION_DTYPE = torch.bfloat16


def quantize_tensor(x: torch.Tensor, previous: torch.Tensor, valid: torch.Tensor, delayed: bool, fp8_max: float,
                    margin: int, pow2: bool, dtype: torch.dtype, values_dtype: torch.dtype | None = None,
                    known_valid: bool = False, keep_q: bool = True
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(Q(x), Q(x) in `values_dtype` or None, scale, amax) with one scale for the tensor.

    The scale: `compute_scale(amax, fp8_max, margin, pow2, previous)` under current scaling; under delayed
    scaling `previous` where `valid`, else that current scale (the first step). `previous` and `valid` are
    0-d tensors (the module's buffers), so a new step's scale never triggers a recompilation. `known_valid`:
    the caller knows `valid` is True (see `_quantize_tensor`); the result is the same. `keep_q` False (with a
    `values_dtype`): Q(x) is not made (None), for a caller that multiplies the values only.
    """
    if x.numel() == 0:
        return _eager_empty(x, previous, valid, delayed, fp8_max, margin, pow2, dtype, values_dtype)
    args = (x, previous, valid, delayed, fp8_max, margin, pow2, dtype, values_dtype, known_valid,
            keep_q or values_dtype is None)
    if not (_quantize_tensor_c.failed or torch.compiler.is_compiling()):
        # One graph for every shape of a CPU matrix (a weight: the per-step refresh of each FP8 layer), called
        # without dynamo's guards; the amax is a maximum, so its order changes nothing (bitwise the per-shape graph).
        result = _DIRECT.call_or_build(_quantize_tensor, args)
        if result is not None:
            return result
    return _quantize_tensor_c(*args)


def _eager_empty(x, previous, valid, delayed, fp8_max, margin, pow2, dtype, values_dtype):
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    current = compute_scale(amax, fp8_max, margin, pow2, previous=previous)
    scale = torch.where(valid, previous.float(), current) if delayed else current
    q = x.float().to(dtype)
    return q, (_values(q, values_dtype) if values_dtype is not None else None), scale, amax


def quantize_known(x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                   values_dtype: torch.dtype | None = None, column_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Q(x diag(column_scale)), the same in `values_dtype` or None) with a known scale: one pass."""
    return _quantize_known_c(x, scale, column_scale, fp8_max, dtype, values_dtype)


def column_maxima(w: torch.Tensor) -> torch.Tensor:
    """max_i |W_ij| per input channel j: [K] in fp32 (exact: |.| and max do not round)."""
    if w.numel() == 0:
        return torch.zeros(w.shape[-1], dtype=torch.float32, device=w.device)
    return w.abs().amax(dim=0).float()


def column_scaled_amax(maxima: torch.Tensor, column_scale: torch.Tensor) -> torch.Tensor:
    """max |W diag(c)| from W's column maxima: a [K] product instead of a pass over W. Bitwise the full pass's
    max_ij |fl(W_ij c_j)|: fl(|a| |c|) is |fl(a c)|, and rounding is monotone, so the largest |W_ij| of column j
    gives that column's largest product."""
    if maxima.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=maxima.device)
    return (maxima * column_scale.float().abs()).amax()


def upcast(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 tensor in `dtype` (exact): a vectorized compiled conversion where eager converts per element."""
    if q.numel() == 0 or q.dtype == dtype:
        return q.to(dtype)
    if dtype in _warmed_up:
        return call_as_compiled(_upcast_any_shape, q, dtype)
    return _upcast_c(q, dtype)


def call_as_compiled(graph: CompiledOrEager, *args: Any) -> Any:
    """A call of one of the start-up's graphs for every shape, in the global state they were compiled in (no
    autograd, autocast off; tensors detached, so a view's base is no part of the guards): dynamo guards on all of
    these and would compile the graph again, inside an iteration, for a call made otherwise."""
    if torch.compiler.is_compiling():  # traced into an enclosing graph (a compiled block): inlined as it is
        return graph(*args)
    if not graph.failed:  # (`uncompiled`: fake tensors, which no compiled code takes)
        result = _DIRECT.call(graph.fn, args)
        if result is not None:
            return result
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return graph(*args)
    return graph(*args)


def start_up_graph(graph: CompiledOrEager, *args: Any) -> None:
    """Make `graph` for calls like `graph(*args)` of every size: a direct graph (direct.py) where this torch has them,
    else torch.compile's, compiled by this call."""
    if not _DIRECT.build(graph.fn, *args):
        call_as_compiled(graph, *args)


def upcasts_ready(q: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `upcast(q, dtype)` takes a graph `warm_up_upcasts` made (else it would compile one for q's shape)."""
    return dtype in _warmed_up and q.device.type == "cpu"


def has_known_values(x: torch.Tensor, dtype: torch.dtype, values_dtype: torch.dtype | None) -> bool:
    """Whether `known_values` takes `x`: `warm_up_upcasts` made its graphs for this input and values dtype."""
    return (values_dtype in _eager_ready and x.dtype == _ACTIVATION_DTYPE and x.numel() > 0 and has_grid(dtype)
            and x.device.type == "cpu")


def known_values(x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                 values_dtype: torch.dtype | None) -> torch.Tensor | None:
    """For the eager layer (fused quantization off): the values of Q(x) in `values_dtype` (what the emulated GEMMs
    multiply), in one compiled pass for every shape, bitwise the values of the eager cast; Q(x) is not made. None
    where `has_known_values` says no (the caller quantizes eagerly)."""
    if not has_known_values(x, dtype, values_dtype):
        return None
    return call_as_compiled(_known_values_any_shape, x, scale, fp8_max, dtype, values_dtype)


def known_values_and_amax(x: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                          values_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`known_values` (where `has_known_values`) and x's amax in the same pass: for a scale that does not wait for
    this amax (delayed scaling's history)."""
    return call_as_compiled(_known_values_amax_any_shape, x, scale, fp8_max, dtype, values_dtype)


@torch.no_grad()  # as the GEMMs call it (inside autograd functions): grad mode is part of a graph's guards
def warm_up_upcasts(device: torch.device, dtype: torch.dtype, eager_layers: bool = True) -> float:
    """Compile `upcast` to `dtype` for every shape now, as the emulated GEMMs call it: both FP8 formats, contiguous
    operands and transposed ones (a weight's W^T), and on CPU, for `eager_layers` (FP8 layers without fused
    quantization), `known_values` (their casts of activations and gradients; their BF16 GEMMs apply the scales
    themselves, `cpu_gemm.scaled_bf16_gemm`); these functions use the graphs from now on. The seconds it took."""
    import time

    began = time.perf_counter()
    scale = torch.ones((), device=device)
    for fp8, fp8_max in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        q = torch.zeros(16, 32, device=device).to(fp8)
        start_up_graph(_upcast_any_shape, q, dtype)  # called as the functions below call them
        start_up_graph(_upcast_any_shape, q.t(), dtype)
        if eager_layers and device.type == "cpu":
            activations = torch.zeros(16, 32, dtype=_ACTIVATION_DTYPE, device=device)
            start_up_graph(_known_values_any_shape, activations, scale, fp8_max, fp8, dtype)
            start_up_graph(_known_values_amax_any_shape, activations, scale, fp8_max, fp8, dtype)
    if eager_layers and device.type == "cpu":
        _eager_ready.add(dtype)
    _warmed_up.add(dtype)
    return time.perf_counter() - began


def as_bf16(t: torch.Tensor) -> torch.Tensor:
    """A BF16 GEMM operand holding FP8 values (FP8, or exactly in fp32 / bf16) as bf16, exactly."""
    if t.dtype in (torch.bfloat16, torch.float32):
        return t.to(torch.bfloat16)
    return upcast(t, torch.bfloat16)


def _quantize_tiles(x: torch.Tensor, tile: Any, spec: Any, margin: int, pow2: bool):
    from megatron.fp8.quantize import quantize_tiles as eager_tiles

    r = eager_tiles(x, tile, spec, margin, pow2)
    return r.data, r.scale, r.amax


_quantize_tiles_c = _fused(_quantize_tiles)


def quantize_tiles(x: torch.Tensor, tile: Any, spec: Any, margin: int = 0, power_of_two: bool = False):
    """`quantize.quantize_tiles` (round to nearest) compiled: the tile amaxes, scales and casts in two kernels."""
    from megatron.fp8.quantize import TiledFp8, quantize_tiles as eager_tiles

    if x.numel() == 0:
        return eager_tiles(x, tile, spec, margin, power_of_two)
    data, scale, amax = _quantize_tiles_c(x.detach(), tile, spec, margin, power_of_two)
    return TiledFp8(data, scale, amax, tile)


def _scale_output(out: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (out.float() / (a_scale.float() * b_scale.float())).to(dtype)


_scale_output_c = _fused(_scale_output)


def scale_output(out: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, dtype: torch.dtype,
                 compiled: bool = True) -> torch.Tensor:
    """The emulated GEMM's epilogue: its fp32 accumulator (or the bf16 GEMM's output, taken to fp32 in the same
    pass) divided by both quantization scales, then rounded once to `dtype`. Eager (`compiled=False`, the
    reference), this is two passes over the output and the division was measured at ~20 ns per element on the
    2-core Xeon (the largest single cost of the emulated FP8 step, docs/performance.md); compiled, one vectorized
    pass with the same division. (The eager layer's BF16 GEMMs on CPU apply the scales themselves:
    `cpu_gemm.scaled_bf16_gemm`.)"""
    if out.numel() == 0:
        return _scale_output(out, a_scale, b_scale, dtype)
    if compiled:
        return _scale_output_c(out, a_scale, b_scale, dtype)
    return _scale_output(out, a_scale, b_scale, dtype)
