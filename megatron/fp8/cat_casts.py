"""FP8 casts of a concatenation, made on its parts: one pass over dy where there were three.

The gradient that fc1's FP8 backward casts is a concatenation: SwiGLU's backward writes its gate and up halves
(the backward of `chunk`). Inductor realizes a `cat` as a buffer its parts are written into, and every pointwise op or
reduction reading it is a loop of its own: in a compiled block's backward, SwiGLU's backward wrote dy, the amax
read it, the cast read it again and wrote the FP8 values (in the demo model's profile, fc1's dy kernel took
twice the BF16 step's SwiGLU backward).

`CastThroughCat`, an inductor post-grad pass, moves the pointwise ops that read a concatenation (the cast's
scale, clamp and grid rounding: grid.py) onto each part, and concatenates their results instead; a reduction of
the whole concatenation to one number (the amax) becomes the maximum of each part's amax, taken over the last
dimension first, which inductor computes in the loop that writes the part. The SwiGLU backward, the cast and the
amax are then one loop over dy. The same numbers: each element goes through the same operations, and a maximum
does not depend on the order it is taken in (NaN propagates either way).

Taken only where the concatenation's pointwise readers feed a full `amax` (what an FP8 cast computes), every
other tensor they read is a 0-d one (scales, flags), no part is empty and all have the concatenation's dtype, and
each part is itself made by a pointwise op, which inductor then computes in the loop of the cast. qkv's dy is left as
it is: its parts are views of the RoPE backward's results, which, read by the cast and by the amax, inductor wrote
to FP32 buffers first (its kernel ~1 ms per demo step slower than with the concatenation). Only on CPU, where it was
measured (inductor's C++ code): on a GPU the casts write FP8 tensors, which the rewrite would concatenate, and it
has not run there.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.alias.default, aten._unsafe_view.default, aten.reshape.default}


def _pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.pointwise in target.tags


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_scalar_tensor(arg: Any) -> bool:
    val = _val(arg)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _full_amax(node: torch.fx.Node) -> bool:
    """`amax` over every dimension, to a 0-d tensor."""
    if node.target is not aten.amax.default:
        return False
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _closure(cat: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """(the view of the concatenation its readers read, the pointwise nodes computed from it alone, with 0-d
    tensors, in graph order)."""
    head = cat
    while len(head.users) == 1 and next(iter(head.users)).target in _VIEWS:
        head = next(iter(head.users))
    shape = getattr(_val(head), "shape", None)
    inside: set[torch.fx.Node] = set()
    frontier = [head]
    while frontier:  # every pointwise node of the same shape reached from the head
        for user in frontier.pop().users:
            if user not in inside and _pointwise(user) and _val(user) is not None and _val(user).shape == shape:
                inside.add(user)
                frontier.append(user)
    changed = True
    while changed:  # less those that also read a tensor from elsewhere (and what they feed)
        changed = False
        for node in list(inside):
            if any(a is not head and a not in inside and not _is_scalar_tensor(a) for a in node.all_input_nodes):
                inside.discard(node)
                changed = True
    position = {n: i for i, n in enumerate(cat.graph.nodes)}
    return head, sorted(inside, key=position.__getitem__)


def _exits(head: torch.fx.Node, order: list[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(reader outside the closure, the closure node or head it reads), in graph order."""
    inside = set(order)
    found = []
    for node in [head] + order:
        for user in node.users:
            if user not in inside:
                found.append((user, node))
    return found


def _node(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """A call node with its fake value computed (`meta['val']`), as inductor's lowering expects."""
    node = graph.call_function(target, args, kwargs or {})
    fake_args = torch.fx.node.map_arg(args, _val)
    fake_kwargs = torch.fx.node.map_arg(kwargs or {}, _val)
    node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def _copies(head: torch.fx.Node, order: list[torch.fx.Node], parts: list[torch.fx.Node]
            ) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Each closure node made again on each part (the part in the head's place), just before the node."""
    graph = head.graph
    copies: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in order:
        with graph.inserting_before(node):
            made = []
            for i, part in enumerate(parts):
                mapping = {head: part}
                mapping.update({n: c[i] for n, c in copies.items()})
                args = torch.fx.node.map_arg(node.args, lambda a: mapping.get(a, a))
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: mapping.get(a, a))
                made.append(_node(graph, node.target, args, kwargs))
            copies[node] = made
    return copies


def _part_amax(pieces: list[torch.fx.Node]) -> torch.fx.Node:
    """The maximum of each piece's amax, each over its last dimension first (the loop that writes the piece)."""
    graph, total = pieces[0].graph, None
    for piece in pieces:
        rows = _node(graph, aten.amax.default, (piece, [_val(piece).dim() - 1]))
        whole = _node(graph, aten.amax.default, (rows, []))
        total = whole if total is None else _node(graph, aten.maximum.default, (total, whole))
    return total


def _rewrite(cat: torch.fx.Node) -> bool:
    """The rewrite of one concatenation (module docstring); whether it applied."""
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    dtype = getattr(_val(cat), "dtype", None)
    if dtype is None or _val(cat).device.type != "cpu":  # (module docstring: inductor's C++ code only)
        return False
    if any(_val(p) is None or _val(p).numel() == 0 or _val(p).dtype != dtype for p in parts):
        return False  # (cat promotes mixed dtypes: the readers would see other numbers)
    if not all(_pointwise(p) for p in parts):  # (module docstring: views of a larger computation)
        return False
    head, order = _closure(cat)
    exits = _exits(head, order)
    if any(source is head for _, source in exits):  # something else reads the concatenation itself: keep it as is
        return False
    if not any(_full_amax(user) for user, _ in exits):
        return False
    graph = cat.graph
    copies = _copies(head, order, parts)
    joined: dict[torch.fx.Node, torch.fx.Node] = {}  # one concatenation per closure node read outside it
    for user, source in exits:
        if _full_amax(user):
            with graph.inserting_before(user):
                new = _part_amax(copies[source])
        else:
            if source not in joined:
                with graph.inserting_before(source):
                    whole = _node(graph, aten.cat.default, (copies[source], dim))
                    joined[source] = _node(graph, aten.view.default, (whole, list(_val(source).shape)))
            new = joined[source]
        user.replace_input_with(source, new)
    for node in reversed(order):
        if not node.users:
            graph.erase_node(node)
    while not head.users:  # the views of the concatenation, then the concatenation itself
        parent = head.args[0] if head is not cat else None
        graph.erase_node(head)
        if parent is None:
            break
        head = parent
    return True


class CastThroughCat(CustomGraphPass):
    """Post-grad pass: the FP8 casts (and amax) of a concatenation made on its parts (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is aten.cat.default:
                _rewrite(node)

    def uuid(self) -> str:  # part of inductor's cache key
        return "megatron-fp8-cast-through-cat-4"
