"""What backward keeps of a compiled block's FP8 casts: the FP8 tensors themselves.

AOTAutograd's partitioner chooses what the forward graph saves for backward and what backward recomputes. For
an FP8 linear fed by a norm it found the cheapest cut in saved bytes to be the block's FP32 input (which the
norm's backward needs anyway) and recomputed the norm and the FP8 cast from it in backward: a second pass
over the input per FP8 GEMM, and the "1 byte per element" that FP8 activations promise held nowhere.
Transformer Engine and torchao keep the FP8 operand for wgrad; so does the eager `Fp8Linear`.

`SaveFp8Casts` is an inductor joint-graph pass (`joint_custom_pre_pass`, run before partitioning) that marks
every cast to an FP8 dtype of the forward `MUST_SAVE`, the tag activation checkpointing uses: the partitioner
then saves those tensors and backward does not recompute them. A cast that already carries a recompute tag
(a block under activation recompute, whose policy decides) is left alone. tests/unit/test_fp8_traced_graph.py
checks the partitioned graphs: no FP8 cast of the forward in backward, the FP8 operands among the saved tensors.
"""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def is_fp8_cast(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _CASTS:
        return False
    dtype = node.args[1] if node.target is torch.ops.prims.convert_element_type.default else node.kwargs.get("dtype")
    return dtype in FP8_DTYPES


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes that depend on a tangent (the incoming gradients) of a joint graph."""
    found = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for node in graph.nodes:  # topological order
        if node not in found and any(parent in found for parent in node.all_input_nodes):
            found.add(node)
    return found


class SaveFp8Casts(CustomGraphPass):
    """Joint-graph pass: the forward's FP8 casts are saved for backward, not recomputed (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        backward = _backward_nodes(graph)
        for node in graph.nodes:
            if node not in backward and is_fp8_cast(node) and "recompute" not in node.meta:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self) -> str:  # part of inductor's cache key
        return "megatron-fp8-save-casts-1"
