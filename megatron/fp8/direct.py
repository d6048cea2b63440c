"""Compiled graphs for every shape, called without torch.compile's per-call machinery: fused.py's start-up graphs, the
per-step weight casts and Fp8AdamW's one-call update on CPU.

A torch.compile'd function runs dynamo's frame evaluation and guards and AOTAutograd's runtime wrappers on every
call. For the activations of a small model that costs more than the kernel (docs/performance.md), and the eager FP8
layer makes two such calls per linear and micro-batch (the casts of x and dy). Here a function is traced
once with symbolic sizes (`make_fx`) and compiled by inductor (`torch._inductor.standalone_compile`, torch 2.8 and
later): the same compiler, decompositions and C++ as torch.compile (results bitwise the same), called directly.

Nothing guards a direct call, so `DirectGraphs.call` checks what dynamo's guards would: plain CPU tensors (no
subclass) first, then the Python constants, each tensor's dtype and layout (0-d; 1-D contiguous, or of one element;
2-D row- or column-major with both sizes at least 2: the symbolic trace assumes sizes other than 0 and 1 and keeps
sizes that are equal in the traced call apart). It returns None for any other call, which the caller then runs
through torch.compile as before. A torch without `standalone_compile`, or a graph it cannot compile, keeps that path;
`MEGATRON_FP8_DIRECT_CALLS=off` makes every call take it.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Mapping

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "MEGATRON_FP8_DIRECT_CALLS"
_CHOICES = ("on", "off")
_TRACING = False


class DirectCallsConfigError(ValueError):
    """`MEGATRON_FP8_DIRECT_CALLS` holds a value we do not know."""


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether direct graphs are made: `MEGATRON_FP8_DIRECT_CALLS` on (or unset) or off; raises on any other value."""
    choice = environ.get(ENV_VAR, "").strip().lower() or "on"
    if choice not in _CHOICES:
        raise DirectCallsConfigError(f"{ENV_VAR}={environ[ENV_VAR]!r} is not one of on, off: unset it (the start-up's "
                                     "graphs are called directly) or set off (every call through torch.compile)")
    return choice == "on"


def tracing() -> bool:
    """True while `DirectGraphs.build` traces a function: code that takes another path inside compiled graphs
    (`torch.compiler.is_compiling()`) takes it then too."""
    return _TRACING


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    global _TRACING
    _TRACING = True
    try:
        yield
    finally:
        _TRACING = False


def _layout(t: torch.Tensor) -> str | None:
    """'scalar', 'one' (one element in one dimension), 'flat' (contiguous, one dimension of at least 2), 'rows'
    (row-major) or 'cols' (column-major: a transposed row-major matrix) for the tensors a graph here takes; None for
    any other."""
    if t.dim() == 0:
        return "scalar"
    if t.dim() == 1:
        return "one" if t.shape[0] == 1 else "flat" if t.shape[0] >= 2 and t.stride() == (1,) else None
    if t.dim() != 2 or t.shape[0] < 2 or t.shape[1] < 2:
        return None
    if t.stride() == (t.shape[1], 1):
        return "rows"
    return "cols" if t.stride() == (1, t.shape[0]) else None


def _split(args: tuple) -> tuple[tuple, tuple] | None:
    """(tensors, constants) of a call whose tensors all come first; None otherwise."""
    n = 0
    while n < len(args) and isinstance(args[n], torch.Tensor):
        n += 1
    tensors, consts = args[:n], args[n:]
    if any(isinstance(c, torch.Tensor) for c in consts):
        return None
    return tensors, consts


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _key(fn: Callable[..., Any], args: tuple) -> tuple | None:
    split = _split(args)
    if split is None:
        return None
    tensors, consts = split
    # Plain CPU tensors (parameters too); a subclass (DTensor, FP8 wrapper tensors) dispatches on its own
    if not tensors or any(t.device.type != "cpu" or type(t) not in _PLAIN for t in tensors):
        return None
    layouts = tuple(_layout(t) for t in tensors)
    if None in layouts:
        return None
    return fn, consts, tuple(t.dtype for t in tensors), layouts


def _bound(fn: Callable[..., Any], consts: tuple) -> Callable[..., Any]:
    def with_constants(*tensors: torch.Tensor) -> Any:
        return fn(*tensors, *consts)
    return with_constants


def _compile(fn: Callable[..., Any], tensors: tuple, consts: tuple) -> tuple[Callable[..., Any], bool]:
    """(the compiled graph, whether `fn` returns one tensor rather than a tuple: read from the trace)."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx

    # Without duck shaping (tracing and compiling): sizes equal in this call get symbols of their own unless an
    # operation relates them (a square weight's graph would otherwise take every weight as square).
    with fx_config.patch(use_duck_shape=False):
        with _tracing(), torch.no_grad():
            graph = make_fx(_bound(fn, consts), tracing_mode="symbolic")(*tensors)
        single = isinstance(graph.graph.output_node().args[0], torch.fx.Node)
        # Each loop an OpenMP region whose threads are decided when it runs (fused.CompiledOrEager says why).
        with inductor_config.patch({"cpp.dynamic_threads": True}):
            return torch._inductor.standalone_compile(graph, list(tensors), dynamic_shapes="from_graph"), single


class DirectGraphs:
    """The direct graphs of a process, by function, Python constants, and the dtypes and layouts of the tensors."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, tuple[Callable[..., Any], bool]] = {}
        self._refused: set[tuple] = set()  # keys `call_or_build` could not compile: not tried again

    def build(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Compile `fn` for calls like `fn(*args)` (tensors first, then constants) of every size; whether it did.
        A failure is logged once per function, and its calls keep the torch.compile path."""
        import torch._inductor

        key = _key(fn, args)
        if key is None or getattr(torch._inductor, "standalone_compile", None) is None or not requested():
            return False
        if key in self._graphs:
            return True
        tensors, consts = _split(args)
        tensors = tuple(t.detach() for t in tensors)
        try:
            graph, single = _compile(fn, tensors, consts)
        except Exception as exc:  # noqa: BLE001 - torch.compile's path computes the same
            logger.info("direct call of %s not compiled (%s: %s); it runs through torch.compile", fn.__name__,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        self._graphs[key] = (graph, single)
        return True

    def call(self, fn: Callable[..., Any], args: tuple) -> Any:
        """`fn(*args)` through its direct graph, or None where there is none for this kind of call."""
        key = _key(fn, args)
        found = None if key is None else self._graphs.get(key)
        if found is None:
            return None
        graph, single = found
        try:
            out = graph(*(a.detach() for a in args[:len(key[2])]))
        except Exception as exc:  # noqa: BLE001 - it wrote nothing the caller sees; torch.compile's path computes it
            del self._graphs[key]
            self._refused.add(key)
            logger.warning("direct call of %s failed (%s: %s); it runs through torch.compile from now on",
                           fn.__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        if isinstance(out, torch.Tensor):
            return out
        return out[0] if single else tuple(out)

    def call_or_build(self, fn: Callable[..., Any], args: tuple) -> Any:
        """`call`, compiling the direct graph for this kind of call first where there is none yet (once: a kind that
        does not compile is not tried again). For functions whose first calls come in the start-up's warm-up."""
        key = _key(fn, args)
        if key is None or key in self._refused:
            return None
        if key not in self._graphs and not self.build(fn, *args):
            self._refused.add(key)
            return None
        return self.call(fn, args)

    def __contains__(self, fn: Callable[..., Any]) -> bool:
        return any(key[0] is fn for key in self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._refused.clear()
