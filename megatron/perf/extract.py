"""The kernels of one compiled transformer block, forward and backward, read from inductor's scheduler.

How: the block is built at the run's real shapes under `FakeTensorMode` (tensors with shapes, dtypes and devices
and no storage), compiled as `--torch-compile` compiles it (`block_inductor_options`: the joint-graph pass that
keeps the forward's FP8 casts for backward, BF16 round trips kept; FP8 layers traced into the graph, the FP8
weights of the step as graph inputs, delayed scaling in its steady state where the history holds a scale), and run
forward and backward once. Inductor lowers the forward
and the backward graph (the backward eagerly: `force_non_lazy_backward_lowering`), fuses, and hands its scheduled
nodes to `_post_fusion_custom_pass`; the pass here turns each node into a `Kernel` and stops the compilation
before any code is generated. The compiled function then returns uninitialised outputs of the right shapes:
nothing runs at the real size, and a Llama2-7B block takes seconds on a 2-core CPU.

Each scheduled node is one kernel:
- an extern GEMM (`mm`, `addmm`, `bmm`, `_scaled_mm`): inductor's FLOP count; FP8 when it is `_scaled_mm`;
- fused attention (`scaled_dot_product_*`): 4 b h s_q s_k d FLOPs forward, halved when causal (the kernels skip
  the masked half), and 2.5x that backward (five matmuls against two). The block is traced without attention
  dropout, which would send CPU SDPA to its unfused math path where a GPU's flash attention takes it;
- every other node (a fused pointwise or reduction kernel, or a fallback op): memory-bound, its bytes being
  inductor's count of what it must read and write (`get_read_write_buffer_accesses`: each buffer once, no
  intermediate that the fusion keeps in registers). It is FP8 quantization when it reads or writes an FP8 buffer
  or when every line that produced it is in megatron/fp8 (or torchao's float8): amaxes and scales; a norm fused
  with its output's FP8 cast is a quantization kernel as a whole.

CPU and Triton fusion differ, and the rule here: the CPU scheduler (the only one that runs without a GPU) decides
the fusions, except its outer-loop fusion (several kernels sharing an outer loop, a C++-only transformation),
which is split back into its parts, as Triton would emit them. Then Triton's horizontal fusion is applied
(`_triton_groups`): pointwise kernels of one iteration size that read a common buffer and do not depend on each
other become one kernel reading that buffer once, as inductor's `SIMDScheduling.can_fuse` allows (equal numel and
rnumel) and Triton's 2-D tiling makes efficient. The C++ scheduler fuses only loops of one order, so the FP8 cast
of x or dy and its transposed cast (the wgrad operand) are two loops on CPU; on Triton they are one kernel that
reads the tensor once and writes both layouts, Transformer Engine's cast-transpose. Reductions are not merged
with pointwise kernels (an amax stays its own pass). Triton's mix-order reductions (a reduction over
rows and one over columns of the same tensor in one kernel) are not formed on CPU: where the backward of an FP8
GEMM reduces dy both ways, the model charges two passes where a GPU may make one. GEMMs and attention are extern
kernels on both, so their count and size are exact.

The FP8 GEMMs are traced with the `scaled_mm` backend (the CUDA one); the same kernel list stands for Gaudi,
whose backend is not traceable (megatron/perf/hardware.py says how the model treats Gaudi).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron import cpu_bf16
from megatron.config import ModelConfig
from megatron.fp8.partition import FP8_DTYPES
from megatron.fp8.recipe import Fp8Backend, Fp8Recipe
from megatron.perf.kernels import Kernel, KernelClass

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
_FP8_SOURCES = ("megatron/fp8/", "torchao/float8/")
_GEMMS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten._scaled_mm.", "aten.baddbmm.")
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


@dataclass(frozen=True)
class BlockKernels:
    """The kernels of one block's forward and backward for one micro-batch; `graphs` compiled graphs (2 when the
    block is one graph: no graph break), `seconds` the extraction took."""

    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    graphs: int
    seconds: float

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return self.forward + self.backward


class _Captured(Exception):
    """Raised by the post-fusion pass once the kernels are read: nothing after scheduling is needed."""


def _innermost_frame(stack_trace: Optional[str]) -> Optional[tuple[str, str]]:
    frames = _FRAME.findall(stack_trace or "")
    return (frames[-1][0], frames[-1][2]) if frames else None


def _origins(node: Any) -> list[tuple[str, str]]:
    frames = []
    for origin in getattr(node.node, "origins", ()) if node.node is not None else ():
        frame = _innermost_frame(origin.meta.get("stack_trace"))
        if frame is not None:
            frames.append(frame)
    return frames


def _attention_flops(op: Any, fx_node: Any) -> float:
    """FLOPs of a fused attention call from its FX node: query [b, h, s_q, d], key [b, h_kv, s_k, d]."""
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, fx_node.args))
    values.update(fx_node.kwargs)
    backward = "grad_out" in values
    q, k = values["query"].meta["val"], values["key"].meta["val"]
    b, h, s_q, d = q.shape
    forward = 4.0 * b * h * s_q * k.shape[-2] * d * (0.5 if values.get("is_causal", False) else 1.0)
    return 2.5 * forward if backward else forward


def _accesses(node: Any) -> dict[str, int]:
    """Bytes per buffer the node reads or writes (each buffer once; what fusion keeps in registers not at all)."""
    return node.get_read_write_buffer_accesses(include_reads=True, include_writes=True)


def _kernel(node: Any, where: str) -> Optional[Kernel]:
    """The kernel of one scheduled node, or None for nodes that launch nothing (views, multi-output unpacking)."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    if isinstance(node, NopKernelSchedulerNode):
        return None
    accesses = _accesses(node)
    size = float(sum(accesses.values()))
    if isinstance(node, ExternKernelSchedulerNode):
        op = getattr(node.node, "op_overload", None)
        name = str(op) if op is not None else ""
        if any(name.startswith(g) for g in _GEMMS):
            return Kernel(name.split(".")[1], KernelClass.GEMM, float(node.estimate_flops() or 0), size,
                          fp8="_scaled_mm" in name, where=where)
        if any(a in name for a in _ATTENTION):
            fx = node.node.get_origin_node() or next(iter(node.node.origins))
            return Kernel(name.split(".")[1], KernelClass.ATTENTION, _attention_flops(op, fx), size, where=where)
        if size == 0:
            return None

    def dtype(buffer: str) -> Optional[torch.dtype]:
        try:
            return V.graph.get_dtype(buffer)
        except Exception:  # noqa: BLE001 - buffers without a plain layout (multi-output): no dtype to read
            return None

    fp8 = any(dtype(b) in FP8_DTYPES for b in accesses)
    frames = _origins(node)
    if frames and all(any(s in f for s in _FP8_SOURCES) for f, _ in frames):
        fp8 = True
    places = sorted({f"{f.rsplit('/', 1)[-1]}:{fn}" for f, fn in frames})
    label = ", ".join(places[:3]) + (", ..." if len(places) > 3 else "")
    return Kernel(label or node.get_name(), KernelClass.QUANTIZATION if fp8 else KernelClass.POINTWISE,
                  bytes=size, where=where)


def _pointwise_numel(node: Any) -> Optional[int]:
    """The iteration size of a fused pointwise kernel (no reduction loop); None for anything else."""
    from torch._inductor.scheduler import FusedSchedulerNode, SchedulerNode

    if not isinstance(node, (SchedulerNode, FusedSchedulerNode)) or node.is_reduction():
        return None
    sizes, reduction = node.group[1]
    if reduction:
        return None
    numel = 1
    for size in sizes:
        numel *= int(size)
    return numel


def _triton_groups(parts: list[Any]) -> list[list[Any]]:
    """The CPU scheduler's kernels grouped as Triton fuses them horizontally: pointwise kernels of one iteration size
    that read a common buffer and do not depend on one another (inductor's `SIMDScheduling.can_fuse`: equal numel
    and rnumel, fused when they share a read). The CPU scheduler fuses only loops of the same order, so a cast and
    a transposed cast of one tensor (dy for dgrad and for wgrad) stay two loops on CPU; Triton tiles them in two
    dimensions and reads the tensor once."""
    groups: list[list[Any]] = []
    keys: list[tuple[int, set[str], set[str]]] = []  # per group: numel, buffers read, nodes in it
    for part in parts:
        numel = _pointwise_numel(part)
        reads = {dep.name for dep in part.read_writes.reads}
        names = {n.get_name() for n in part.get_nodes()}
        ancestors = set(getattr(part, "ancestors", ()))
        for group, (g_numel, g_reads, g_names) in zip(groups, keys):
            if numel is not None and numel == g_numel and reads & g_reads and not ancestors & g_names \
                    and not any(names & set(getattr(member, "ancestors", ())) for member in group):
                group.append(part)
                g_reads |= reads
                g_names |= names
                break
        else:
            groups.append([part])
            keys.append((numel if numel is not None else -1, reads, names))
    return groups


def _merged(kernels: list[Kernel], accesses: list[dict[str, int]]) -> Kernel:
    """One kernel made of horizontally fused ones: each buffer read or written once."""
    union: dict[str, int] = {}
    for access in accesses:
        for buffer, size in access.items():
            union[buffer] = max(union.get(buffer, 0), size)
    kind = KernelClass.QUANTIZATION if any(k.kind is KernelClass.QUANTIZATION for k in kernels) \
        else kernels[0].kind
    return Kernel(" + ".join(k.name for k in kernels), kind, bytes=float(sum(union.values())),
                  where=kernels[0].where)


def _kernels(nodes: list[Any], where: str) -> list[Kernel]:
    # The C++ outer-loop fusion split back into its parts (Triton has none), then Triton's horizontal fusion.
    parts = [part for node in nodes
             for part in (node.get_outer_nodes() if hasattr(node, "get_outer_nodes") else [node])]
    out = []
    for group in _triton_groups(parts):
        made = [(k, part) for part in group if (k := _kernel(part, where)) is not None]
        if len(made) > 1:
            out.append(_merged([k for k, _ in made], [_accesses(part) for _, part in made]))
        elif made:
            out.append(made[0][0])
    return out


def compile_until(stop: type, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> bool:
    """`compile_fx_inner(gm, ...)` that a custom pass of inductor ends by raising `stop`; whether it did (inductor
    wraps what the pass raises; anything else propagates)."""
    from torch._inductor.compile_fx import compile_fx_inner

    try:
        compile_fx_inner(gm, example_inputs, **kwargs)
    except Exception as exc:
        if not isinstance(getattr(exc, "inner_exception", exc), stop):
            raise
        return True
    return False


def uninitialised_outputs(gm: torch.fx.GraphModule) -> Callable:
    """The compiled function of a compilation stopped early: uninitialised tensors of `gm`'s outputs' shapes, no
    computation (a boxed call, as inductor's)."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    metas = [getattr(o, "meta", {}).get("val") if isinstance(o, torch.fx.Node) else o for o in outputs]

    def run(args: list) -> list:
        args.clear()
        return [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=m.device)
                if isinstance(m, torch.Tensor) else m for m in metas]

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _capturing_backend(graphs: list[tuple[str, list[Kernel]]]) -> Callable:
    """A torch.compile backend: inductor up to its scheduler (kernels appended to `graphs`), then outputs of the
    right shapes and no computation."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from megatron.model.compile import block_inductor_options

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
        where = "backward" if kwargs.get("is_backward", False) else "forward"

        def read(nodes: list[Any]) -> list[Any]:
            graphs.append((where, _kernels(nodes, where)))
            raise _Captured()

        with inductor_config.patch(_post_fusion_custom_pass=read):
            compile_until(_Captured, gm, example_inputs, **kwargs)
        return uninitialised_outputs(gm)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        return compile_fx(gm, example_inputs, inner_compile=inner,
                          config_patches={**block_inductor_options(), "fx_graph_cache": False})

    return backend


@contextlib.contextmanager
def _fresh_compiler():
    """No compiled code cached before or after; the backward lowered with the forward; BF16 autocast as torch
    has it on a GPU (not this CPU's FP32 emulation of BF16 GEMMs, megatron/cpu_bf16.py, which would trace other
    ops: attention as matmuls). The FP8 weight cache keys on the storage pointer, which a fake tensor has not: torch
    warns of it, and nothing here reads the key (the weights are made once per trace)."""
    import warnings

    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    try:
        with functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False), \
                cpu_bf16.use_mode("native"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        torch._dynamo.reset()


def _fp8_layers(model: torch.nn.Module, recipe: Fp8Recipe, blocks: list[torch.nn.Module]) -> None:
    """Our FP8 layers as `--torch-compile` runs them: fused quantization traced into the graph, delayed scaling's
    history known to hold a scale (the steady state), the step's FP8 weights made before the graph by each block's
    pre-hook (with the fused functions' Python: their compiled code cannot run on tensors without storage). `model`
    is converted whole when it is a GPT model, else it is one linear."""
    from megatron.fp8 import Fp8Linear, convert_to_fp8, fused, set_fused_quantization
    from megatron.model.compile import refresh_fp8_weights

    if hasattr(model, "decoder"):
        convert_to_fp8(model, recipe)
    set_fused_quantization(model, True)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.fp8.learn_scale_validity([True, True, True])

    def refresh(block: torch.nn.Module, args: Any) -> None:
        with fused.uncompiled():
            refresh_fp8_weights(block, args)

    for block in blocks:
        block.register_forward_pre_hook(refresh)


# Ops that launch nothing in eager PyTorch (allocation, metadata) besides views (`OpOverload.is_view`).
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh",
              "_local_scalar_dense", "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "is_same_size"}
_EAGER_GEMMS = frozenset({"mm", "addmm", "bmm", "_scaled_mm"})


def _tensor_bytes(values: Any) -> float:
    from torch.utils._pytree import tree_leaves

    return float(sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor)))


class _EagerOps(TorchDispatchMode):
    """The FP8 layers that run eagerly inside a compiled block (a graph break: the tiled recipes, `traced.py`), op by
    op as eager PyTorch launches them: one kernel per op, reading its tensor arguments and writing its outputs.
    Active only inside those layers' forward and backward (`_eager_fp8_layers`), never while dynamo traces."""

    def __init__(self, kernels: list[Kernel], where: str) -> None:
        super().__init__()
        self.kernels, self.where = kernels, where

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in _NO_KERNEL or (not _tensor_bytes(out) and not func._schema.is_mutable):
            return out  # a view, an allocation, or a query (x.device): no kernel
        size = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        if name in _EAGER_GEMMS:
            a, b = args[0], args[1] if name != "addmm" else args[2]
            flops = 2.0 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
            self.kernels.append(Kernel(name, KernelClass.GEMM, flops, size, fp8=name == "_scaled_mm",
                                       where=self.where))
        else:
            self.kernels.append(Kernel(f"eager {name}", KernelClass.QUANTIZATION, bytes=size, where=self.where))
        return out


@contextlib.contextmanager
def _eager_fp8_layers(kernels: list[Kernel]) -> Iterator[None]:
    """Record the FP8 layers' eager path (their forward and both autograd functions' backward): its ops one kernel
    each (`_EagerOps`), except the fused functions of megatron/fp8/fused.py, compiled there as in a run and read
    here through the capturing backend like the block's graphs. Elsewhere (the compiled graphs trace the fused
    functions in; the pre-hook's weight casts are counted once per step in outside.py) they run as Python."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    from megatron.fp8 import fused
    from megatron.fp8.linear import Fp8Linear
    from megatron.fp8.per_tensor import Fp8Gemms
    from megatron.fp8.tiled import TiledFp8LinearFunction

    phase: list[Optional[str]] = [None]
    graphs: list[tuple[str, list[Kernel]]] = []
    backend = _capturing_backend(graphs)
    compiled: dict[int, Callable] = {}
    eager_forward, fused_call = Fp8Linear._eager_forward, fused.CompiledOrEager.__call__
    backwards = {cls: cls.__dict__["backward"] for cls in (Fp8Gemms, TiledFp8LinearFunction)}

    @contextlib.contextmanager
    def recording(where: str) -> Iterator[None]:
        phase[0] = where
        try:
            with _EagerOps(kernels, where):
                yield
        finally:
            phase[0] = None

    def forward(self: Any, *args: Any) -> Any:
        with recording("forward"):
            return eager_forward(self, *args)

    def recorded(original: Any) -> Any:
        def backward(ctx: Any, *grads: Any) -> Any:
            if torch.compiler.is_compiling():  # the per-tensor Function traced into a block: the graph's kernels
                return original.__func__(ctx, *grads)
            with recording("backward"):
                return original.__func__(ctx, *grads)
        return staticmethod(backward)

    def call(self: Any, *args: Any) -> Any:
        if phase[0] is None or torch.compiler.is_compiling():
            return self.fn(*args)
        where = phase[0]
        with _pop_mode_temporarily():
            fn = compiled.setdefault(id(self), torch.compile(self.fn, backend=backend, dynamic=False))
            out = fn(*args)
        kernels.extend(dataclasses.replace(k, where=where) for _, ks in graphs for k in ks)
        graphs.clear()
        return out

    Fp8Linear._eager_forward, fused.CompiledOrEager.__call__ = forward, call
    for cls, original in backwards.items():
        cls.backward = recorded(original)
    try:
        yield
    finally:
        Fp8Linear._eager_forward, fused.CompiledOrEager.__call__ = eager_forward, fused_call
        for cls, original in backwards.items():
            cls.backward = original


def _capture(module: torch.nn.Module, args: Callable[[], tuple], bf16: bool) -> BlockKernels:
    """Compile `module` (already on fake tensors) with the capturing backend, run its forward and backward on `args()`
    (made under the fake mode), and return the kernels of its forward and backward graphs and of any FP8 layer that
    runs eagerly between them."""
    start = time.perf_counter()
    graphs: list[tuple[str, list[Kernel]]] = []
    eager: list[Kernel] = []
    compiled = torch.compile(module, backend=_capturing_backend(graphs), dynamic=False)
    with _eager_fp8_layers(eager):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = compiled(*args())
        out.float().sum().backward()
    forward = tuple(k for where, ks in graphs if where == "forward" for k in ks)
    backward = tuple(k for where, ks in graphs if where == "backward" for k in ks)
    forward += tuple(k for k in eager if k.where == "forward")
    backward += tuple(k for k in eager if k.where == "backward")
    return BlockKernels(forward, backward, len(graphs), time.perf_counter() - start)


def extract_block(model: ModelConfig, recipe: Optional[Fp8Recipe], micro_batch_size: int, bf16: bool = True,
                  torchao: Optional[str] = None) -> BlockKernels:
    """The kernels of one compiled block of `model` (its shapes, recompute and Smooth-SwiGLU settings) for one
    micro-batch: BF16 (`recipe` None), our FP8 `recipe` (traced with the `scaled_mm` backend), or torchao's
    Float8Linear with its recipe `torchao` ("tensorwise", "rowwise") in the block's linears."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron.model.gpt import GPTModel

    # Attention dropout > 0 sends CPU SDPA to its unfused math path; on a GPU flash attention takes dropout.
    net = GPTModel(dataclasses.replace(model, num_layers=1, attention_dropout=0.0), device="meta")
    dtype = torch.bfloat16 if bf16 else torch.float32
    with _fresh_compiler(), FakeTensorMode(allow_non_fake_inputs=True):
        net.to_empty(device="cpu")
        block = net.decoder.layers[0]
        if recipe is not None:
            _fp8_layers(net, dataclasses.replace(recipe, backend=Fp8Backend.SCALED_MM), [block])
        elif torchao is not None:
            _torchao_linears(net.decoder, torchao)
        net.train()

        def args() -> tuple:
            b, s = micro_batch_size, model.seq_length
            x = torch.empty(b, s, model.hidden_size, dtype=dtype, requires_grad=True)
            rotary = net.rotary(torch.arange(s).unsqueeze(0).expand(b, s)) if net.rotary is not None else None
            return x, rotary, None

        return _capture(block, args, bf16)


def extract_linear(in_features: int, out_features: int, tokens: int, recipe: Optional[Fp8Recipe],
                   torchao: Optional[str] = None) -> BlockKernels:
    """The kernels of one linear layer's forward and backward on `tokens` BF16 tokens under autocast: nn.Linear
    (`recipe` None), our Fp8Linear (`recipe`, its FP8 weight made once per step before the graph, as in a compiled
    block), or torchao's Float8Linear (`torchao`, which casts its weight in the graph, per call)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron.fp8 import Fp8Linear

    with _fresh_compiler(), FakeTensorMode(allow_non_fake_inputs=True):
        layer: torch.nn.Module = torch.nn.Linear(in_features, out_features, bias=False)
        if recipe is not None:
            layer = Fp8Linear.from_linear(layer, dataclasses.replace(recipe, backend=Fp8Backend.SCALED_MM))
            _fp8_layers(layer, recipe, [layer])
        elif torchao is not None:
            holder = torch.nn.Sequential(layer)
            _torchao_linears(holder, torchao)
            layer = holder[0]

        def args() -> tuple:
            return (torch.empty(tokens, in_features, dtype=torch.bfloat16, requires_grad=True),)

        return _capture(layer, args, True)


def _torchao_linears(module: torch.nn.Module, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
