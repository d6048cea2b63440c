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

The emulated GEMMs of a compiled CPU block (fused.py `_cast`) multiply the FP8 *values*, rounded to the grid in the
forward (grid.py), and their wgrad upcast the FP8 tensor again in backward. That FP8 tensor feeds backward alone,
and the partitioner honours `MUST_SAVE` only for nodes the forward needs: it recomputed the norm and the cast in
backward (on the demo model's step, the largest of the FP8 step's kernels). There the pass hands backward the
forward's values instead (the same numbers: grid.py's rounding is bitwise the cast) and marks them `MUST_SAVE`:
no recomputation and no upcast pass, for 2 bytes per element (bf16 values; fp32 in the `exact` mode) instead of 1.

(The BF16 GEMMs of the `bf16` mode apply the scales inside the GEMM, `cpu_gemm.scaled_bf16_gemm`: a linear's output
that backward reads, as SwiGLU's backward reads fc1's, is saved as the GEMM wrote it, with no epilogue to recompute.)
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


def _convert_to(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    return node.op == "call_function" and node.target is torch.ops.prims.convert_element_type.default and \
        node.args[1] == dtype


def _grid_values(cast: torch.fx.Node) -> dict[torch.dtype, torch.fx.Node]:
    """The forward's grid-rounded values of the operand `cast` converts, by dtype: `fp8_grid(y)` ends in
    copysign(where(...), y) (fp32), then a conversion to bf16 where the values are kept in bf16."""
    y = cast.args[0]
    found = {}
    for sign in y.users:
        rounded = sign.args[0] if sign.target is torch.ops.aten.copysign.Tensor and sign.args[1] is y else None
        if isinstance(rounded, torch.fx.Node) and rounded.target is torch.ops.aten.where.self:
            found[torch.float32] = sign
            found.update({torch.bfloat16: u for u in sign.users if _convert_to(u, torch.bfloat16)})
    return found


def _reuse_forward_values(cast: torch.fx.Node) -> None:
    """Where backward upcasts `cast` (the emulated wgrad's operand: `q.float()`, then `.to(bf16)` in the bf16 mode)
    and the forward holds the same values rounded on the grid, backward takes those (marked MUST_SAVE); the upcast
    and the cast then fall away."""
    values = _grid_values(cast)
    for up in [u for u in cast.users if _convert_to(u, torch.float32)]:
        for node in [u for u in up.users if _convert_to(u, torch.bfloat16)] + [up]:
            dtype = node.args[1]
            if node.users and dtype in values:
                node.replace_all_uses_with(values[dtype])
                values[dtype].meta["recompute"] = CheckpointPolicy.MUST_SAVE
            if not node.users:
                node.graph.erase_node(node)
    if not cast.users:
        cast.graph.erase_node(cast)


class SaveFp8Casts(CustomGraphPass):
    """Joint-graph pass: the forward's FP8 casts are saved for backward, not recomputed (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        backward = _backward_nodes(graph)
        for node in list(graph.nodes):
            if node not in backward and is_fp8_cast(node) and "recompute" not in node.meta:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                _reuse_forward_values(node)

    def uuid(self) -> str:  # part of inductor's cache key
        return "megatron-fp8-save-casts-5"
