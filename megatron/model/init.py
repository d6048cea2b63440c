"""Per-tensor initialization of `GPTModel`: every initial value is a function of (seed, name, position).

Why
---
A 70B model cannot be built whole on every rank and then cut (8 ranks x 280 GB of FP32 weights). Each rank
builds only its own pieces (`megatron/model/build.py`), so an element's initial value may depend neither on
the layout (tensor-parallel size, pipeline stage, vocabulary padding) nor on elements other ranks hold. Here it
depends only on (`--seed`, the parameter's full-model name such as `decoder.layers.3.mlp.linear_fc1.weight`,
the element's position in the full tensor). Hence, bit for bit: a TP=2 shard is the slice `shard_tensor` cuts
from the TP=1 tensor, a pipeline stage's layers are the PP=1 model's, and `GPTModel(config, seed=s)` built
directly (tests, tools) is the model `--seed s` starts from.

How
---
A tensor is drawn line by line: line i of tensor `name` is one contiguous FP32 `normal_` draw by a CPU generator
seeded with `(tensor_seed(seed, name) + i) mod 2**32`. Lines are rows (index along dim 0; a 1-D tensor is one
line), except for the row-parallel projections `linear_proj` and `linear_fc2`, drawn per input column (index
along dim 1): the dimension tensor parallelism cuts is the one lines are indexed by, so every piece draws its
own lines and nothing else (a column-parallel linear, the vocab-parallel embedding and head, fc1's
[gate_r | up_r] their rows; a row-parallel linear its columns). A piece cut across lines (possible, not used by
the layout table) draws the full lines and keeps its part of each. Vocabulary padding only appends rows, so the
rows of a smaller padding are unchanged. Cost: one seeding and one `normal_` per line (a few microseconds)
plus the generation itself; no Python work per element.

Consecutive seeds and not a hash per row: PyTorch's CPU generator (mt19937) keeps only the low 32 bits of a
seed, and 32-bit hashes collide within a large tensor (birthday bound: ~0.4 duplicated rows in one 57344-row
fc1 of a 70B model); base + r never repeats within a tensor. Values are generated on the CPU in FP32 whatever
the parameter's device, so every accelerator starts from the CPU-built model's weights. (`normal_` picks its
vectorized path by line length, the same in every layout; a CPU of another vector ISA may round differently.)

Distributions (Megatron's): normal(0, `init_method_std`) for QKV, fc1, the embeddings and the output layer;
normal(0, `init_method_std / sqrt(2 * num_layers)`) for the projections writing into the residual stream
(`linear_proj`, `linear_fc2`, `output_layer_std`); norm weights one; biases zero.

Buffers (RoPE tables) are not initialized here: modules compute them on the CPU at construction, also under
the meta device, and `materialize` moves them, so they are exactly those of a model built on the CPU.
"""
from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.model.transformer import output_layer_std

# Lines drawn per host block when they cannot be drawn straight into the parameter (columns, another device or
# dtype): at most 4 MB of FP32, and never more than the piece itself.
_BLOCK_ELEMENTS = 1 << 20
_SEED_MASK = (1 << 32) - 1


class InitKind(enum.Enum):
    NORMAL = "normal"
    ONES = "ones"
    ZEROS = "zeros"


@dataclass(frozen=True)
class InitRule:
    kind: InitKind
    std: float = 0.0
    line_dim: int = 0  # NORMAL: lines are indexed along this dim (the one tensor parallelism cuts)


_RESIDUAL_OUTPUTS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_NORMAL = ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight", "embedding.word_embeddings.weight",
           "embedding.position_embeddings.weight", "output_layer.weight")


def init_rule(name: str, config: ModelConfig) -> InitRule:
    """How the parameter with state_dict key `name` starts; a parameter without a rule is an error (add one)."""
    if name.endswith(".bias"):
        return InitRule(InitKind.ZEROS)
    if name.endswith("layernorm.weight"):
        return InitRule(InitKind.ONES)
    if name.endswith(_RESIDUAL_OUTPUTS):
        return InitRule(InitKind.NORMAL, output_layer_std(config), line_dim=1)
    if name.endswith(_NORMAL):
        return InitRule(InitKind.NORMAL, config.init_method_std)
    raise ValueError(f"no initialization rule for parameter {name!r}: add one to megatron/model/init.py")


def tensor_seed(seed: int, name: str) -> int:
    """A 32-bit seed for tensor `name` under run seed `seed` (blake2b: stable across processes and versions)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class Piece:
    """The part of a full tensor that a parameter holds: the full shape and, along `dim` (0 or 1), the kept
    positions `index` in the parameter's order (`megatron.parallel.layout.shard_indices`). No index: all of it."""

    full_shape: torch.Size
    dim: int = 0
    index: Optional[torch.Tensor] = None


class HostBlock:
    """The host block reused by every parameter of one `materialize` call, grown when a larger one is needed.

    Why not a block per parameter: freed and allocated again between parameters, it fragments the heap (small
    parameters land in the freed block): measured ~4 MB kept per row-parallel weight of a 1B model.
    """

    def __init__(self) -> None:
        self._data = torch.empty(0, dtype=torch.float32)

    def take(self, rows: int, columns: int) -> torch.Tensor:
        if self._data.numel() < rows * columns:
            self._data = torch.empty(0, dtype=torch.float32)  # free the old one first
            self._data = torch.empty(rows * columns, dtype=torch.float32)
        return self._data[:rows * columns].view(rows, columns)


@torch.no_grad()
def fill_initial_values_(dest: torch.Tensor, name: str, config: ModelConfig, seed: int,
                         piece: Optional[Piece] = None, host_block: Optional[HostBlock] = None) -> torch.Tensor:
    """Write the initial values of `piece` (default: the whole tensor) of parameter `name` into `dest`."""
    rule = init_rule(name, config)
    if rule.kind is InitKind.ONES:
        return dest.fill_(1.0)
    if rule.kind is InitKind.ZEROS:
        return dest.zero_()
    piece = piece if piece is not None else Piece(dest.shape)
    full = piece.full_shape
    if rule.line_dim and len(full) != 2:
        raise NotImplementedError(f"{name}: lines along dim {rule.line_dim} of a {len(full)}-D tensor")
    n_lines = full[rule.line_dim] if len(full) >= 2 else 1
    line_length = math.prod(full) // n_lines
    lines: list[int] | range = range(n_lines)
    keep = None  # positions kept within each line, for a piece cut across lines
    if piece.index is not None:
        if piece.dim == rule.line_dim and len(full) >= 2:
            lines = piece.index.tolist()
        elif len(full) <= 2:
            keep = piece.index
        else:
            raise NotImplementedError(f"{name}: pieces along dim {piece.dim} of a {len(full)}-D tensor")
    if not dest.is_contiguous():
        raise ValueError(f"{name}: the destination must be contiguous")
    out = dest.view(len(lines), -1) if rule.line_dim == 0 else dest.t()  # out[j]: the piece's j-th line
    base = tensor_seed(seed, name)
    generator = torch.Generator()

    def draw(line: int, into: torch.Tensor) -> None:
        generator.manual_seed((base + line) & _SEED_MASK)
        into.normal_(0.0, rule.std, generator=generator)

    if rule.line_dim == 0 and keep is None and dest.device.type == "cpu" and dest.dtype == torch.float32:
        for j, line in enumerate(lines):  # rows straight into the parameter: no temporary at all
            draw(line, out[j])
        return dest
    block = max(1, min(len(lines), _BLOCK_ELEMENTS // line_length, dest.numel() // line_length))
    buffer = (host_block or HostBlock()).take(block, line_length)
    for start in range(0, len(lines), block):
        chunk = lines[start:start + block]
        for k, line in enumerate(chunk):
            draw(line, buffer[k])
        values = buffer[:len(chunk)]
        out[start:start + len(chunk)].copy_(values if keep is None else values.index_select(1, keep))
    return dest


PieceOf = Callable[[str, nn.Parameter], Piece]


def materialize(model: nn.Module, device: torch.device | str, seed: int, piece_of: Optional[PieceOf] = None,
                keep: Optional[Callable[[str], bool]] = None) -> nn.Module:
    """Give `model`'s meta parameters storage on `device` and their initial values; move its buffers there.

    `model` is a `GPTModel` built on the meta device (its names are full-model state_dict keys, its `config`
    holds the distributions). `piece_of(name, parameter)` says which part of the full tensor a parameter is
    (default: all of it); `keep(name)` selects the parameters and buffers to materialize (default: all), the
    others stay on meta (a pipeline stage keeps its own layers). New Parameter objects replace the meta ones,
    carrying their attributes (`tensor_parallel_dim`, ...) and `requires_grad`. Returns `model`.
    """
    config, host_block = model.config, HostBlock()
    for name, param in list(model.named_parameters()):
        if keep is not None and not keep(name):
            continue
        if not param.is_meta:
            raise ValueError(f"materialize: {name} is already on {param.device}; build the model on the meta device")
        data = torch.empty(param.shape, dtype=param.dtype, device=device)
        fill_initial_values_(data, name, config, seed, piece_of(name, param) if piece_of else None, host_block)
        new = nn.Parameter(data, requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, new)
    for name, buffer in list(model.named_buffers()):
        if keep is not None and not keep(name):
            continue
        if buffer.is_meta:
            raise ValueError(f"materialize: buffer {name} has no values; compute buffers on the CPU at "
                             f"construction (as RotaryEmbedding does), also under the meta device")
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        persistent = leaf not in module._non_persistent_buffers_set
        module.register_buffer(leaf, buffer.to(device), persistent=persistent)
    return model
