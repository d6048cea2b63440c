"""`Fp8Linear` traced into a compiled graph (megatron/fp8/traced.py): no graph break, the eager layer's bits.

The reference is the eager layer with fused quantization (itself bitwise the eager reference, test_fp8_fused.py).
Inductor, by default, keeps a fused op's input in fp32 where eager rounds it to bf16 first (e.g. a bf16 GEMM
output feeding the next layer's amax); `emulate_precision_casts` makes it round as eager does, so the traced
layers can be compared bit for bit: outputs, dx, dW, db and every scaling buffer over three steps (delayed
scaling's history becomes valid at the second). Compiled blocks are built with that option
(`block_inductor_options`); whole blocks still differ from eager blocks by the summation order of their
reductions (the norms, attention), within rounding noise (tests/unit/test_torch_compile.py).
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from megatron.fp8 import cpu_gemm, enable_fp8_stats, set_fused_quantization
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import Fp8Recipe
from megatron.model.compile import register_fp8_weight_refresh
from tests.support.fp8_traced import assert_traced_equals_eager, fp8_llama_block, onednn_fp8_capped_away

RECIPES = {
    "delayed-hybrid": Fp8Recipe(),
    # current scaling's options and a BF16 wgrad in one compilation (each compilation costs 15-30 s on 2 cores)
    "tensorwise-e4m3-pow2-margin-bf16-wgrad": Fp8Recipe(scaling="tensorwise", format="e4m3", power_of_two_scales=True,
                                                        margin=1, fp8_wgrad=False),
    "delayed-history4-scaled_mm": Fp8Recipe(amax_history_len=4, amax_compute_algo="max", backend="scaled_mm"),
}


@pytest.mark.isa_sensitive  # compiled vs eager bit for bit: generated kernels follow the ISA, CI reruns with AVX2
@pytest.mark.parametrize("name,column,bf16,step_weights,gemms", [
    ("delayed-hybrid", False, True, True, "exact"), ("delayed-hybrid", True, True, False, "bf16"),
    ("tensorwise-e4m3-pow2-margin-bf16-wgrad", False, True, True, "exact"),
    ("delayed-history4-scaled_mm", True, False, True, "exact")])
def test_traced_layers_equal_eager_bitwise(name, column, bf16, step_weights, gemms):
    """`gemms`: the emulated GEMMs' CPU mode (megatron/fp8/cpu_gemm.py); `bf16`, the default on CPUs with AMX, runs
    every FP8 GEMM of the bf16 model as a BF16 GEMM on the FP8 values, traced and eager alike."""
    if RECIPES[name].backend.value == "scaled_mm" and onednn_fp8_capped_away():
        pytest.skip("torch sends this CPU's _scaled_mm to oneDNN (the CPU has AMX), and ONEDNN_MAX_CPU_ISA caps "
                    "oneDNN below its FP8 matmul; the default pass ran it with this CPU's kernels")
    with cpu_gemm.use_mode(gemms):
        assert_traced_equals_eager(RECIPES[name], column, bf16, step_weights, "cpu")


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


def _block(recipe: Fp8Recipe) -> torch.nn.Module:
    block = fp8_llama_block(recipe)
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
    (graph breaks, same call). Tracing is the subject: AOTAutograd traces forward and backward as inductor
    would, without generating kernels (inductor's kernels for these layers are compared with eager above)."""
    torch.manual_seed(0)
    block = _block(Fp8Recipe())
    block.compile(fullgraph=True, dynamic=False, backend="aot_eager")
    x = torch.randn(2, 16, 64, requires_grad=True)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x, None, None)
        out.float().sum().backward()

    assert _graph_breaks(run) == 0
    assert block.mlp.linear_fc2.weight.grad is not None and torch.isfinite(block.mlp.linear_fc2.weight.grad).all()
    # qkv, proj and fc1 from the per-step cache (made by the pre-hook); fc2 casts W diag(c) in the graph
    assert [block.self_attention.linear_qkv.fp8.weight_quantizations, block.self_attention.linear_proj.
            fp8.weight_quantizations, block.mlp.linear_fc1.fp8.weight_quantizations,
            block.mlp.linear_fc2.fp8.weight_quantizations] == [1, 1, 1, 0]
    stats_block = _block(Fp8Recipe())
    stats_block.compile(dynamic=False, backend="eager")  # the break is dynamo's
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


def test_emulated_layers_stay_eager_on_a_torch_below_the_traced_minimum(monkeypatch):
    """The emulated backend is traced only from `EMULATED_TRACE_MIN_TORCH` on (older inductor computes its traced
    backward wrongly): below it the layer is a graph break and its gradients are the eager layer's, bit for bit."""
    from megatron.fp8 import traced

    torch.manual_seed(0)
    layer = Fp8Linear(16, 8, bias=False, recipe=Fp8Recipe())
    set_fused_quantization(layer, True)
    x = torch.randn(4, 16)
    assert traced.traceable(layer.fp8, x, None)
    monkeypatch.setattr(traced, "EMULATED_TRACE_MIN_TORCH", (99, 0))  # above any installed torch
    assert not traced.traceable(layer.fp8, x, None)
    eager = Fp8Linear(16, 8, bias=False, recipe=Fp8Recipe())
    eager.load_state_dict(layer.state_dict())
    set_fused_quantization(eager, True)
    compiled = torch.compile(layer, dynamic=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(xc).sum().backward()
    eager(xe).sum().backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) > 0
    assert torch.equal(xc.grad, xe.grad) and torch.equal(layer.weight.grad, eager.weight.grad)
