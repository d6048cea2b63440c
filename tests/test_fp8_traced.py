"""`Fp8Linear` traced into a compiled graph (megatron/fp8/traced.py): no graph break, the eager layer's bits.

The reference is the eager layer with fused quantization (itself bitwise the eager reference, test_fp8_fused.py).
Inductor, by default, keeps a fused op's input in fp32 where eager rounds it to bf16 first (e.g. a bf16 GEMM
output feeding the next layer's amax); `emulate_precision_casts` makes it round as eager does, so the traced
layers can be compared bit for bit: outputs, dx, dW, db and every scaling buffer over three steps (delayed
scaling's history becomes valid at the second). In a real block that option is off, and the traced and eager
blocks then agree within rounding noise (tests/test_torch_compile.py).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config

from megatron.config import ModelConfig
from megatron.fp8 import enable_fp8_stats, fp8_optimizer_step, set_fused_quantization
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import Fp8Recipe
from megatron.model.compile import register_fp8_weight_refresh
from megatron.model.smooth_swiglu import SmoothSwiGLUGranularity
from megatron.model.transformer import TransformerLayer


class _Chain(torch.nn.Module):
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


def _steps(m: torch.nn.Module, xs: list[torch.Tensor], bf16: bool, first: int = 0) -> list[tuple[str, torch.Tensor]]:
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
        out += [(f"{step}: {n} casts", torch.tensor(c.fp8_weight_quantizations)) for n, c in m.named_children()]
        fp8_optimizer_step(m)  # the delayed scaling update of a training step
        m.zero_grad()
    return out


def _assert_bias_grad_close(got: torch.Tensor, want: torch.Tensor, tokens: int) -> None:
    """db sums dy over the tokens in fp32 (inductor and eager sum in different orders): each is within
    (tokens - 1) 2^-24 sum|dy| of the exact sum, so they differ by at most twice that. dy is the same for every
    token here (the loss weights), so sum|dy| = |db|."""
    bound = 2 * (tokens - 1) * 2.0**-24 * want.double().abs()
    assert ((got.double() - want.double()).abs() <= bound).all()


RECIPES = {
    "delayed-hybrid": Fp8Recipe(),
    "tensorwise-e4m3-pow2-margin": Fp8Recipe(scaling="tensorwise", format="e4m3", power_of_two_scales=True, margin=1),
    "delayed-history4-scaled_mm": Fp8Recipe(amax_history_len=4, amax_compute_algo="max", backend="scaled_mm"),
    "bf16-wgrad": Fp8Recipe(fp8_wgrad=False),
}


@pytest.mark.isa_sensitive  # compiled vs eager bit for bit: generated kernels follow the ISA, CI reruns with AVX2
@pytest.mark.parametrize("name,column,bf16,step_weights", [
    ("delayed-hybrid", False, True, True), ("delayed-hybrid", True, True, False),
    ("tensorwise-e4m3-pow2-margin", False, True, True), ("delayed-history4-scaled_mm", True, False, True),
    ("bf16-wgrad", False, True, False)])
def test_traced_layers_equal_eager_bitwise(name, column, bf16, step_weights):
    assert_traced_equals_eager(RECIPES[name], column, bf16, step_weights, "cpu")


def assert_traced_equals_eager(recipe: Fp8Recipe, column: bool, bf16: bool, step_weights: bool, device: str) -> None:
    """`step_weights`: the compiled module has the pre-hook compiled blocks get (the FP8 weight made once per
    step, outside the graph, and the cast counter then equals the eager layer's); else W is cast per call.
    Also run on a GPU by tests/test_gpu.py."""
    torch.manual_seed(0)
    eager = _Chain(recipe, column).to(device)
    set_fused_quantization(eager, True)
    traced = copy.deepcopy(eager)
    torch._dynamo.reset()
    if step_weights:
        register_fp8_weight_refresh(traced)
    traced.compile(fullgraph=True, dynamic=False)  # fullgraph: a graph break would raise
    xs = [torch.randn(3, 8, 64, device=device) * s for s in (1.0, 3.0, 0.5)]
    with inductor_config.patch(emulate_precision_casts=True):
        got = _steps(traced, xs[:1], bf16)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got += _steps(traced, xs[1:], bf16, first=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # later steps compile nothing new
    want = _steps(eager, xs, bf16)
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
            _assert_bias_grad_close(g, w, tokens=24)
        else:
            assert torch.equal(g, w), f"{name} differs"


def test_nonfinite_input_reaches_the_output_when_traced():
    """The NaN-scale guard survives tracing: an inf in x makes the traced output NaN (the step is skipped)."""
    layer = Fp8Linear(16, 8, bias=False, recipe=Fp8Recipe())
    set_fused_quantization(layer, True)
    torch._dynamo.reset()
    layer.compile(fullgraph=True, dynamic=False)
    x = torch.randn(4, 16)
    assert torch.isfinite(layer(x)).all()
    x[1, 3] = float("inf")
    assert torch.isnan(layer(x)).all()


def _block(recipe: Fp8Recipe) -> TransformerLayer:
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         ffn_hidden_size=128, seq_length=16, max_position_embeddings=16, padded_vocab_size=128,
                         kv_channels=16, smooth_swiglu=SmoothSwiGLUGranularity.CHANNEL)
    block = TransformerLayer(config, 1)
    for parent in (block.self_attention, block.mlp):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Fp8Linear.from_linear(child, recipe))
    set_fused_quantization(block, True)
    register_fp8_weight_refresh(block)  # as compile_blocks does
    return block


def _graph_breaks(fn) -> int:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn()
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def test_compiled_transformer_block_has_no_graph_break():
    """A Llama block with FP8 linears and Smooth-SwiGLU's fc2 (column scale, input amax) traces as one graph
    (fullgraph raises on any break), forward and backward; a statistics iteration falls back to the eager layer
    (graph breaks, same call)."""
    torch.manual_seed(0)
    block = _block(Fp8Recipe())
    block.compile(fullgraph=True, dynamic=False)
    x = torch.randn(2, 16, 64, requires_grad=True)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x, None, None)
        out.float().sum().backward()

    assert _graph_breaks(run) == 0
    assert block.mlp.linear_fc2.weight.grad is not None and torch.isfinite(block.mlp.linear_fc2.weight.grad).all()
    # qkv, proj and fc1 from the per-step cache (made by the pre-hook); fc2 casts W diag(c) in the graph
    assert [block.self_attention.linear_qkv.fp8_weight_quantizations, block.self_attention.linear_proj.
            fp8_weight_quantizations, block.mlp.linear_fc1.fp8_weight_quantizations,
            block.mlp.linear_fc2.fp8_weight_quantizations] == [1, 1, 1, 0]
    stats_block = _block(Fp8Recipe())
    stats_block.compile(dynamic=False)
    enable_fp8_stats(stats_block, True)
    block = stats_block
    assert _graph_breaks(run) > 0


def test_untraceable_configurations_keep_the_eager_layer():
    """Stochastic rounding of gradients draws eager noise: such a layer stays a graph break (and still works)."""
    layer = Fp8Linear(16, 8, bias=False, recipe=Fp8Recipe(grad_stochastic_rounding=True))
    set_fused_quantization(layer, True)
    compiled = torch.compile(layer, dynamic=False)
    x = torch.randn(4, 16, requires_grad=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled(x).sum().backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) > 0
    assert x.grad is not None
