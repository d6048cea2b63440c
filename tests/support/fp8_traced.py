"""FP8 linears traced into a compiled graph against the eager layers, bit for bit (tests/unit/test_fp8_traced.py on
the CPU, tests/unit/test_gpu.py on a GPU)."""
from __future__ import annotations

import copy
import os
import unittest.mock

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

from megatron.config import LLAMA, ModelConfig
from megatron.fp8 import fp8_optimizer_step, set_fused_quantization
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import Fp8Recipe
from megatron.model.compile import BLOCK_BACKEND, register_fp8_weight_refresh
from megatron.model.smooth_swiglu import SmoothSwiGLUGranularity
from megatron.model.transformer import TransformerLayer


class Chain(torch.nn.Module):
    """Two FP8 linears back to back (the second's input is the first's bf16 output); with `column`, the second
    gets a Smooth-SwiGLU-style column scale and its input's exact amax, as fc2 does (named as in the MLP, whose
    `fc2_weight_column_scaled` the compiled blocks' pre-hook reads)."""

    def __init__(self, recipe: Fp8Recipe, column: bool = False) -> None:
        super().__init__()
        self.linear_fc1 = Fp8Linear(64, 96, bias=False, recipe=recipe)
        self.linear_fc2 = Fp8Linear(96, 48, bias=True, recipe=recipe)
        self.fc2_weight_column_scaled = column

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if not self.fc2_weight_column_scaled:
            return self.linear_fc2(h)
        c = torch.exp2(torch.arange(96, device=x.device, dtype=torch.float32) % 5 - 2)
        return self.linear_fc2(h * (1 / c).to(h.dtype), weight_column_scale=c,
                               input_amax=h.abs().amax().float() / 4)


def fp8_llama_block(recipe: Fp8Recipe) -> torch.nn.Module:
    """A one-layer Llama block (hidden 64, GQA 4/2 heads, FFN 128, sequence 16, Smooth-SwiGLU per channel) whose
    four linears are `Fp8Linear`s with `recipe` and fused quantization, as `--torch-compile` runs them."""
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         ffn_hidden_size=128, seq_length=16, max_position_embeddings=16, padded_vocab_size=128,
                         kv_channels=16, smooth_swiglu=SmoothSwiGLUGranularity.CHANNEL, **LLAMA)
    block = TransformerLayer(config, 1)
    for parent in (block.self_attention, block.mlp):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Fp8Linear.from_linear(child, recipe))
    set_fused_quantization(block, True)
    return block


def steps(m: torch.nn.Module, xs: list[torch.Tensor], bf16: bool, first: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the output, dx, every gradient and every buffer after each of the steps."""
    out = []
    for step, x in enumerate(xs, start=first):
        x = x.clone().requires_grad_()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            y = m(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device=x.device)).sum().backward()
        out += [(f"{step}: y", y.detach()), (f"{step}: dx", x.grad)]
        out += [(f"{step}: grad {n}", p.grad.clone()) for n, p in m.named_parameters()]
        out += [(f"{step}: {n}", b.clone()) for n, b in m.named_buffers()]
        out += [(f"{step}: {n} casts", torch.tensor(c.fp8.weight_quantizations)) for n, c in m.named_children()]
        fp8_optimizer_step(m)  # the delayed scaling update of a training step
        m.zero_grad()
    return out


def assert_bias_grad_close(got: torch.Tensor, want: torch.Tensor, tokens: int) -> None:
    """db sums dy over the tokens in fp32 (inductor and eager sum in different orders): each is within
    (tokens - 1) 2^-24 sum|dy| of the exact sum, so they differ by at most twice that. dy is the same for every
    token here (the loss weights), so sum|dy| = |db|."""
    bound = 2 * (tokens - 1) * 2.0**-24 * want.double().abs()
    assert ((got.double() - want.double()).abs() <= bound).all()


def assert_traced_equals_eager(recipe: Fp8Recipe, column: bool, bf16: bool, step_weights: bool, device: str) -> None:
    """`step_weights`: the compiled module has the pre-hook compiled blocks get (the FP8 weight made once per
    step, outside the graph, and the cast counter then equals the eager layer's); else W is cast per call.
    Run on the CPU by tests/unit/test_fp8_traced.py, on a GPU by tests/unit/test_gpu.py."""
    torch.manual_seed(0)
    eager = Chain(recipe, column).to(device)
    set_fused_quantization(eager, True)
    traced = copy.deepcopy(eager)
    torch._dynamo.reset()
    if step_weights:
        register_fp8_weight_refresh(traced)
    # As compiled blocks are compiled (their backend keeps BF16 round trips: `block_inductor_options`); fullgraph: a
    # graph break would raise.
    traced.compile(fullgraph=True, dynamic=False, backend=BLOCK_BACKEND)
    xs = [torch.randn(3, 8, 64, device=device) * s for s in (1.0, 3.0, 0.5)]
    got, graphs = [], []
    for step, x in enumerate(xs):
        got += steps(traced, [x], bf16, first=step)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # Later steps compile nothing new, but for one graph when delayed scaling's history becomes valid (the first
    # update's fp8_optimizer_step tells the layers, whose casts then use the history's scale without the amax:
    # Fp8Linear.fp8.known_valid).
    turns_valid = recipe.scaling.value == "delayed"
    assert [graphs[1] - graphs[0], graphs[2] - graphs[1]] == [1 if turns_valid else 0, 0], graphs
    want = steps(eager, xs, bf16)
    # The cast counter counts casts outside a graph: the per-step ones the pre-hook makes (as many as the eager
    # layer's), none for a layer casting per call inside the graph (no pre-hook, or a column-scaled fc2).
    per_call = {"linear_fc1": not step_weights, "linear_fc2": column or not step_weights}
    for (name, g), (_, w) in zip(got, want):
        if name.endswith(" casts"):
            layer = name.split(": ")[1].split(" ")[0]
            assert int(g) == (0 if per_call[layer] else int(w)) and int(w) > 0, name
    got = [(n, w if n.endswith(" casts") else g) for (n, g), (_, w) in zip(got, want)]
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want):
        assert g.dtype == w.dtype, name
        if name.endswith("grad linear_fc2.bias"):
            assert_bias_grad_close(g, w, tokens=24)
        else:
            assert torch.equal(g, w), f"{name} differs"


class _Recorded(Exception):
    """Raised by the recording pass: inductor stops before lowering the graph it recorded."""


def post_grad_graphs(run) -> list[torch.fx.Graph]:
    """The post-grad graphs inductor would generate kernels from (forward, then backward) for whatever `run()`
    compiles with inductor, read without generating any: each graph is recorded by inductor's post-grad custom
    pass, which then stops that compilation, and the compiled function returns uninitialised tensors of its
    outputs' shapes (megatron/perf/extract.py's helpers). So `run()` must not depend on the values it computes.
    Lowering, fusion and C++ compilation take most of a compilation; the compile caches are off, so every graph
    is really built."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from megatron.perf.extract import compile_until, uninitialised_outputs

    graphs: list[torch.fx.Graph] = []

    class Record(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            graphs.append(graph)
            raise _Recorded()

        def uuid(self) -> None:
            return None

    def inner(gm: torch.fx.GraphModule, example_inputs, **kwargs):
        if not compile_until(_Recorded, gm, example_inputs, **kwargs):
            raise AssertionError("inductor compiled a graph without running its post-grad passes")
        return uninitialised_outputs(gm)

    compile_fx = compile_fx_module.compile_fx

    def recording_compile_fx(model, example_inputs, inner_compile=None, **kwargs):
        return compile_fx(model, example_inputs, inner_compile=inner, **kwargs)

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=Record(), force_disable_caches=True), \
            unittest.mock.patch.object(compile_fx_module, "compile_fx", recording_compile_fx):
        run()
    return graphs


def onednn_fp8_capped_away() -> bool:
    """Whether a CPU `_scaled_mm` may raise here: torch sends it to oneDNN on CPUs with AMX (it asks the CPU, not
    oneDNN), and ONEDNN_MAX_CPU_ISA below AMX (the suite's AVX2 pass) leaves oneDNN without an FP8 matmul. A CPU
    without AMX (any AMD, older Intel) runs torch's own FP8 GEMM, capped or not."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if not cap or "AMX" in cap or cap in ("ALL", "DEFAULT"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_int8" in f.read().split()
    except OSError:
        return False


def _reaches_cat(node: torch.fx.Node) -> bool:
    """Whether `node` reads a concatenation through views and pointwise ops."""
    seen, stack = set(), [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent.target is torch.ops.aten.cat.default:
                return True
            pointwise = isinstance(parent.target, torch._ops.OpOverload) and torch.Tag.pointwise in parent.target.tags
            views = parent.target in (torch.ops.aten.view.default, torch.ops.aten.alias.default,
                                     torch.ops.aten.reshape.default)
            if parent not in seen and (pointwise or views):
                seen.add(parent)
                stack.append(parent)
    return False


def amaxes_reading_a_cat(graph: torch.fx.Graph) -> int:
    """How many amaxes of `graph` read a concatenation (megatron/fp8/cat_casts.py)."""
    return len([n for n in graph.nodes if n.target is torch.ops.aten.amax.default and _reaches_cat(n)])
