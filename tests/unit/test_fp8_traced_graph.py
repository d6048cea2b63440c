"""Properties of the compiled graph of an FP8 layer traced into a compiled block (megatron/fp8/traced.py), read
off inductor's post-grad backward graph, so that a GPU-only cost cannot come back unseen: with the per-step FP8
weight (the compiled blocks' pre-hook) dgrad's row-major W^T is made once per optimizer step, outside the graph,
and the backward graph takes it as an input instead of transposing the weight per micro-batch."""
from __future__ import annotations

import pytest
import torch

from megatron.fp8 import Fp8Recipe, set_fused_quantization
from megatron.fp8.linear import Fp8Linear
from megatron.model.compile import register_fp8_weight_refresh
from tests.support.fp8_traced import post_grad_graphs

T, K, N = 48, 32, 16  # multiples of 16: _scaled_mm's operands need no padding
SCALED_MM = torch.ops.aten._scaled_mm.default
VIEWS = {torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.view.default,
         torch.ops.aten.reshape.default, torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default}


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """The node a tensor comes from, through views (which copy nothing)."""
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


def _dgrad_weight_source(step_weight: bool) -> torch.fx.Node:
    torch.manual_seed(0)
    layer = Fp8Linear(K, N, bias=False, recipe=Fp8Recipe(backend="scaled_mm"))
    set_fused_quantization(layer, True)
    if step_weight:
        register_fp8_weight_refresh(layer)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(T, K, requires_grad=True)
    graphs = post_grad_graphs(lambda: compiled(x).square().sum().backward())
    [dgrad] = [n for g in graphs for n in g.nodes if n.target is SCALED_MM and tuple(n.meta["val"].shape) == (T, K)]
    return _source(dgrad.args[1])


@pytest.mark.parametrize("step_weight", [True, False])
def test_dgrad_weight_is_made_once_per_step_outside_the_graph(step_weight):
    source = _dgrad_weight_source(step_weight)
    if step_weight:
        assert source.op == "placeholder", source.format_node()  # an input: the step's cached W^T
    else:  # the control: a weight made per call is transposed in the graph (a copy per micro-batch)
        assert source.op == "call_function", source.format_node()
