"""Properties of the compiled graph of an FP8 layer traced into a compiled block (megatron/fp8/traced.py), read
off inductor's post-grad graphs, so that a GPU-only cost cannot come back unseen: with the per-step FP8
weight (the compiled blocks' pre-hook) dgrad's row-major W^T is made once per optimizer step, outside the graph,
and the backward graph takes it as an input instead of transposing the weight per micro-batch; a Smooth-SwiGLU
fc2 (W diag(c), new every micro-batch) takes the amax of W diag(c) from W's column maxima, made once per step,
instead of a reduction over W per micro-batch; once delayed scaling's history holds a scale, the casts of x and dy
do not wait for their own amax (which only feeds the history), so one pass over the tensor can do both; a
compiled block's backward uses the FP8 operands its forward saved (1 byte per element) and recomputes no cast."""
from __future__ import annotations

import pytest
import torch

from megatron.fp8 import Fp8Recipe, fp8_optimizer_step, fp8_state_dict, load_fp8_state_dict, set_fused_quantization
from megatron.fp8.linear import Fp8Linear
from megatron.model.compile import register_fp8_weight_refresh
from megatron.fp8.partition import is_fp8_cast
from tests.support.fp8_traced import amaxes_reading_a_cat, fp8_llama_block, post_grad_graphs

T, K, N = 48, 32, 16  # multiples of 16: _scaled_mm's operands need no padding
SCALED_MM = torch.ops.aten._scaled_mm.default
FP8_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK_ACTIVATIONS = [(32, 64), (32, 64), (32, 64), (32, 128)]  # qkv, proj, fc1 inputs; fc2's (32 tokens)
VIEWS = {torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.view.default,
         torch.ops.aten.reshape.default, torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default}


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """The node a tensor comes from, through views (which copy nothing)."""
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


def _compiled_graphs(module: torch.nn.Module, pre_hook: bool, prepare=None) -> list[torch.fx.Graph]:
    """The post-grad graphs of one forward + backward of `module` (fused quantization, with or without the
    compiled blocks' pre-hook) on x: [T, K], compiled with fullgraph; `prepare(module, x)` runs eagerly first."""
    set_fused_quantization(module, True)
    if pre_hook:
        register_fp8_weight_refresh(module)
    x = torch.randn(T, K, requires_grad=True)
    if prepare is not None:
        prepare(module, x)
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    return post_grad_graphs(lambda: compiled(x).square().sum().backward())


def _dgrad_weight_source(step_weight: bool) -> torch.fx.Node:
    torch.manual_seed(0)
    graphs = _compiled_graphs(Fp8Linear(K, N, bias=False, recipe=Fp8Recipe(backend="scaled_mm")), step_weight)
    [dgrad] = [n for g in graphs for n in g.nodes if n.target is SCALED_MM and tuple(n.meta["val"].shape) == (T, K)]
    return _source(dgrad.args[1])


@pytest.mark.parametrize("step_weight", [True, False])
def test_dgrad_weight_is_made_once_per_step_outside_the_graph(step_weight):
    source = _dgrad_weight_source(step_weight)
    if step_weight:
        assert source.op == "placeholder", source.format_node()  # an input: the step's cached W^T
    else:  # the control: a weight made per call is transposed in the graph (a copy per micro-batch)
        assert source.op == "call_function", source.format_node()


REDUCTIONS = {torch.ops.aten.amax.default, torch.ops.aten.max.default, torch.ops.aten.max.dim}


class _ColumnScaledFc2(torch.nn.Module):
    """An FP8 fc2 with a Smooth-SwiGLU-style column scale (named as in the MLP, whose flag the pre-hook reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_fc2 = Fp8Linear(K, N, bias=False, recipe=Fp8Recipe())
        self.fc2_weight_column_scaled = True

    def forward(self, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        c = torch.exp2((torch.arange(K, dtype=torch.float32) + shift) % 5 - 2)
        return self.linear_fc2(x, weight_column_scale=c)


@pytest.mark.parametrize("step_maxima", [True, False])
def test_column_scaled_weight_amax_needs_no_pass_over_the_weight(step_maxima):
    torch.manual_seed(0)
    graphs = _compiled_graphs(_ColumnScaledFc2(), step_maxima)
    over_w = [n for n in graphs[0].nodes if n.target in REDUCTIONS and tuple(n.args[0].meta["val"].shape) == (N, K)]
    if step_maxima:  # the amax of W diag(c) is a [K] product with the step's column maxima, a graph input
        assert not over_w, [n.format_node() for n in over_w]
    else:  # the control: without the pre-hook the graph reduces W itself
        assert over_w


def test_column_maxima_are_computed_once_per_optimizer_step():
    """Eager: three micro-batches with three column scales use one column-maxima pass; the optimizer step's hook
    drops them; a per-call weight (ZeRO-3) computes them per call; the unfused reference reduces W diag(c)."""
    torch.manual_seed(0)
    module = _ColumnScaledFc2()
    layer = module.linear_fc2
    set_fused_quantization(module, True)
    x = torch.randn(T, K)
    for step in range(2):
        for shift in range(3):
            module(x, shift).sum().backward()
        assert layer.fp8.column_maxima_passes == step + 1
        assert layer.fp8.weight_quantizations == 3 * (step + 1)  # W diag(c) itself is cast per call
        with torch.no_grad():
            layer.weight.add_(0.01)
        fp8_optimizer_step(module)
    layer.fp8.configure(weight_per_call=True)
    module(x).sum().backward()
    module(x, 1).sum().backward()
    assert layer.fp8.column_maxima_passes == 2 + 2
    layer.fp8.configure(weight_per_call=False)
    set_fused_quantization(module, False)
    fp8_optimizer_step(module)
    module(x).sum().backward()
    assert layer.fp8.column_maxima_passes == 4


def _fp8_casts(graph: torch.fx.Graph, shape: tuple[int, int]) -> list[tuple[torch.fx.Node, bool]]:
    """(node, an amax among its ancestors) for each FP8 cast of a tensor of `shape` in `graph`."""
    casts = []
    for node in graph.nodes:
        if is_fp8_cast(node) and tuple(node.meta["val"].shape) == shape:
            seen, stack = set(), [node]
            while stack:
                for parent in stack.pop().all_input_nodes:
                    if parent not in seen:
                        seen.add(parent)
                        stack.append(parent)
            casts.append((node, any(p.target in REDUCTIONS for p in seen)))
    return casts


def _full_amaxes(graph: torch.fx.Graph, shape: tuple[int, int]) -> list[torch.fx.Node]:
    """The reductions of `graph` over a whole tensor of `shape` to one value (the amax of a cast)."""
    return [n for n in graph.nodes if n.target in REDUCTIONS and n.meta["val"].dim() == 0
            and tuple(n.all_input_nodes[0].meta["val"].shape) == shape]


@pytest.mark.parametrize("history_valid", [True, False])
def test_delayed_casts_do_not_wait_for_their_amax_once_the_history_is_valid(history_valid):
    def fill_history(layer: torch.nn.Module, x: torch.Tensor) -> None:  # one eager training step
        layer(x).square().sum().backward()
        fp8_optimizer_step(layer)
        assert bool(layer.fp8_scale_valid.all())

    torch.manual_seed(0)
    layer = Fp8Linear(K, N, bias=False, recipe=Fp8Recipe(backend="scaled_mm"))  # delayed scaling
    graphs = _compiled_graphs(layer, True, fill_history if history_valid else None)
    # (the pre-hook's eager weight cast compiles a graph of its own; x is cast in the forward, dy in the backward)
    x_casts = [c for g in graphs for c in _fp8_casts(g, (T, K))]
    dy_casts = [c for g in graphs for c in _fp8_casts(g, (T, N))]
    assert len(x_casts) == 1 and len(dy_casts) == 1, (x_casts, dy_casts)
    # Valid: neither cast has an amax among its ancestors. The control (first step, no scale yet): both wait.
    assert [x_casts[0][1], dy_casts[0][1]] == [not history_valid] * 2
    # Valid: each cast comes before its amax in the graph, because inductor's CPU scheduler fuses a reduction into the
    # loop of a pointwise kernel over the same elements that comes before it, not after it: one loop reads the tensor
    # for both. The control: the amax comes first, the cast waits for it.
    for shape, [(cast, _)] in (((T, K), x_casts), ((T, N), dy_casts)):
        [graph] = [g for g in graphs if cast in g.nodes]
        order = {node: i for i, node in enumerate(graph.nodes)}
        amaxes = _full_amaxes(graph, shape)
        assert len(amaxes) == 1, (shape, amaxes)
        assert (order[amaxes[0]] > order[cast]) == history_valid, (shape, graph)


def test_scale_validity_is_read_once_per_step_until_valid_and_again_after_a_load():
    """What the traced casts rely on: `Fp8LayerState.known_valid` is True only where the buffer is. It is read at
    most once per scaling update while a role is not valid, and forgotten when a checkpoint's FP8 state is loaded
    (which may hold a history that is not valid yet)."""
    recipe = Fp8Recipe()
    layer = Fp8Linear(K, N, bias=False, recipe=recipe)
    fresh = fp8_state_dict(layer, recipe)
    layer.fp8.refresh_scale_validity()
    assert layer.fp8.known_valid == (False, False, False)
    layer.fp8_scale_valid.fill_(True)
    layer.fp8.refresh_scale_validity()  # the same step: not read again
    assert layer.fp8.known_valid == (False, False, False)
    x = torch.randn(T, K, requires_grad=True)
    layer(x).sum().backward()
    fp8_optimizer_step(layer)  # the update tells the layer (one read for the model), no refresh needed
    assert layer.fp8.known_valid == (True, True, True) == tuple(layer.fp8_scale_valid.tolist())
    layer.fp8.refresh_scale_validity()
    assert layer.fp8.known_valid == (True, True, True)
    load_fp8_state_dict(layer, recipe, fresh)
    assert layer.fp8.known_valid == (False, False, False)
    layer.fp8.refresh_scale_validity()
    assert layer.fp8.known_valid == (False, False, False) == tuple(layer.fp8_scale_valid.tolist())


def _block_step_graphs(block: torch.nn.Module) -> list[torch.fx.Graph]:
    """The post-grad graphs of one BF16-autocast forward + backward of a compiled `fp8_llama_block`."""
    x = torch.randn(2, 16, 64, requires_grad=True)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x, None, None)
        out.float().sum().backward()

    return post_grad_graphs(run)


@pytest.mark.parametrize("save_casts", [True, False])
def test_compiled_block_backward_keeps_the_fp8_operands_and_recomputes_no_cast(save_casts):
    """A Llama block (FP8 linears, Smooth-SwiGLU) compiled as `--torch-compile` compiles it: the backward graph
    casts only dy (E5M2), none of the forward's E4M3 operands, and the forward saves each activation's FP8
    operand (x for qkv, fc1, proj, and fc2's smoothed input: [tokens, K] in 1 byte per element). The control,
    the block compiled without the partition pass, recomputes the norms and casts in backward."""
    from megatron.model.compile import compile_block

    torch.manual_seed(0)
    block = fp8_llama_block(Fp8Recipe(backend="scaled_mm"))
    if save_casts:
        compile_block(block)
    else:
        register_fp8_weight_refresh(block)
        block.compile(dynamic=False)
    graphs = _block_step_graphs(block)
    forward, backward = [g for g in graphs if any(n.target is SCALED_MM for n in g.nodes)]
    recomputed = [n.args[1] for n in backward.nodes if is_fp8_cast(n) and n.args[1] is torch.float8_e4m3fn]
    saved = [n for n in forward.nodes if n.op == "output"][0].args[0]
    saved_fp8 = sorted(tuple(n.meta["val"].shape) for n in saved
                       if isinstance(n, torch.fx.Node) and n.meta["val"].dtype == torch.float8_e4m3fn)
    if save_casts:
        assert not recomputed, recomputed
        assert [s for s in saved_fp8 if s[0] == 32] == BLOCK_ACTIVATIONS, saved_fp8
    else:
        assert recomputed


def test_emulated_block_backward_takes_the_forward_fp8_values():
    """The emulated GEMMs of a compiled CPU block in the bf16 mode (megatron/fp8/cpu_gemm.py) multiply each
    activation's FP8 values, rounded to the grid in the forward (grid.py); wgrad takes those values, saved by the
    forward, and backward neither recomputes a cast nor converts an FP8 tensor back (megatron/fp8/partition.py).
    The FP8 tensor itself feeds backward only, where the partitioner ignores MUST_SAVE: without the pass's rewrite
    backward recomputed the norms and the casts."""
    from megatron.fp8 import cpu_gemm
    from megatron.model.compile import compile_block

    torch.manual_seed(0)
    with cpu_gemm.use_mode("bf16"):
        block = fp8_llama_block(Fp8Recipe())
        compile_block(block)
        graphs = _block_step_graphs(block)
    forward, backward = graphs[-2:]
    from_fp8 = [n for n in backward.nodes if n.op == "call_function" and n.all_input_nodes
                and getattr(n.all_input_nodes[0].meta.get("val"), "dtype", None) in FP8_FORMATS]
    assert not [n for n in backward.nodes if is_fp8_cast(n) and n.args[1] is torch.float8_e4m3fn]
    assert not from_fp8, from_fp8
    saved = [n for n in forward.nodes if n.op == "output"][0].args[0]
    # wgrad's GEMM takes the values transposed: the forward saves that view of them
    untransposed = [n.args[0] if n.target is torch.ops.aten.permute.default else n for n in saved
                    if isinstance(n, torch.fx.Node)]
    values = sorted(tuple(n.meta["val"].shape) for n in untransposed if isinstance(n, torch.fx.Node)
                    and n.meta["val"].dtype == torch.bfloat16 and n.args and isinstance(n.args[0], torch.fx.Node)
                    and n.args[0].target is torch.ops.aten.copysign.Tensor)
    assert [s for s in values if s[0] == 32] == BLOCK_ACTIVATIONS, values


def test_emulated_block_saves_fc1s_output_as_its_bf16_gemm_wrote_it():
    """In the `bf16` mode every FP8 GEMM of the block is the custom op that applies the scales inside the GEMM
    (megatron/fp8/cpu_gemm.py): no plain GEMM in the forward, and SwiGLU's backward reads fc1's output as the op wrote
    it (saved, of fc1's output shape)."""
    from megatron.fp8 import cpu_gemm
    from megatron.model.compile import compile_block

    torch.manual_seed(0)
    with cpu_gemm.use_mode("bf16"):
        block = fp8_llama_block(Fp8Recipe())
        compile_block(block)
        forward = _block_step_graphs(block)[-2]
    gemm = torch.ops.megatron.scaled_bf16_gemm.default
    assert not [n for n in forward.nodes if n.target is torch.ops.aten.mm.default]
    assert len([n for n in forward.nodes if n.target is gemm]) == 4  # qkv, proj, fc1, fc2
    saved = [n for n in [n for n in forward.nodes if n.op == "output"][0].args[0] if isinstance(n, torch.fx.Node)]
    fc1 = block.mlp.linear_fc1
    assert (32, fc1.out_features) in [tuple(n.meta["val"].shape) for n in saved if n.target is gemm]


@pytest.fixture(scope="module")
def emulated_block_compiled():
    """One compilation of `fp8_llama_block` in the CPU `bf16` mode, forward and backward, with the compile caches
    off: (the backward's generated code, (amaxes reading a concatenation before, after) per graph the cast-through-cat
    pass saw, megatron/fp8/cat_casts.py)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from megatron.fp8 import cpu_gemm
    from megatron.fp8.cat_casts import CastThroughCat
    from megatron.model.compile import compile_block

    seen = []
    original = CastThroughCat.__call__

    def recording(self, graph):
        before = amaxes_reading_a_cat(graph)
        original(self, graph)
        seen.append((before, amaxes_reading_a_cat(graph)))

    torch._dynamo.reset()
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as patch, cpu_gemm.use_mode("bf16"), \
            inductor_config.patch(force_disable_caches=True):
        patch.setattr(CastThroughCat, "__call__", recording)
        block = fp8_llama_block(Fp8Recipe())
        compile_block(block)
        x = torch.randn(2, 16, 64, requires_grad=True)

        def run() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = block(x, None, None)
            out.float().sum().backward()

        _, codes = run_and_get_code(run)
    return codes[-1], seen


def test_emulated_block_backward_writes_each_cast_of_dy_once_for_both_gemms(emulated_block_compiled):
    """In the `bf16` mode each linear's dgrad takes dy's cast values and its wgrad the same values transposed: inductor
    hands wgrad a view of the buffer dgrad reads (the op accepts any strides), instead of writing the same values a
    second time. Backward's eight GEMM calls (four linears) read four buffers of dy's values."""
    import re

    backward = emulated_block_compiled[0]
    calls = re.findall(r"scaled_bf16_gemm\.default\((?:reinterpret_tensor\()?(buf\d+)", backward)
    assert len(calls) == 8, backward
    assert len(set(calls)) == 4, calls


def test_emulated_block_backward_casts_no_concatenation(emulated_block_compiled):
    """The compiled block's backward, where fc1's and qkv's dy amaxes read a concatenation (SwiGLU's backward, the
    split after qkv), leaves the cast-through-cat pass with one fewer: fc1's, so that SwiGLU's backward, dy's cast and
    its amax are one loop; qkv's, whose parts are views, stays (megatron/fp8/cat_casts.py)."""
    seen = emulated_block_compiled[1]
    assert [(before, after) for before, after in seen if before] == [(2, 1)], seen
