"""`build_model`: this rank's `GPTModel`, without ever holding the whole model.

    GPTModel(config, device="meta")          shapes only: no storage, no initialization work
    -> parallelize_tensor(...)               TP: each sharded parameter cut to this rank's piece (still meta)
    -> materialize(..., keep=stage.holds)    storage on `device` for this rank's parameters only, filled with
                                             the per-tensor initial values of its pieces (megatron/model/init.py)

A rank therefore allocates its own pieces and nothing else: at TP=t about 1/t of the model, on a pipeline
stage its own layers, where building the full model first cost every rank all of it (8 ranks x 280 GB of
FP32 for a 70B model). The values do not depend on the layout: a TP=2 shard equals the slice of the TP=1
tensor, a stage's layers equal the PP=1 model's (tests/unit/test_model_construction.py checks both bitwise).

ZeRO-3 (`partition`, from `deepspeed_zero3.zero3_partitioner`): TP is 1 there, so the piece of every parameter is the
whole tensor. Instead of materializing all of them and letting `deepspeed.initialize` partition them (every rank
would first hold the whole model: 280 GB of FP32 for 70B), the model is materialized one part at a time, the
embedding, each transformer layer, the final norm, the head, and each part is handed to `partition` (DeepSpeed's
`zero.Init(module=part)`: each rank keeps its 1/DP slice of every tensor) before the next one is allocated. A rank
then holds its partitions plus one part at full size, and the values are those above, bit for bit. Partitioned
parameters keep their full shape in `ds_shape` (their data is an empty placeholder): code that needs the shape
before DeepSpeed gathers them reads that.

Pipeline stages: the modules outside `stage` stay on meta. The FP8 swap (`convert_to_fp8`) still sees the
whole `decoder.layers` (its first/last-layer rules count layers of the full model) and gives the swapped
meta layers meta buffers; `build_pipeline_module` then keeps the materialized ones only (and checks that
DeepSpeed's partition agrees with `stage`). The RoPE table is held by every stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.model.gpt import GPTModel
from megatron.model.init import Piece, PieceOf, materialize
from megatron.parallel.layout import TP_SHARD_DIM, shard_indices, shard_spec
from megatron.parallel.parallelize import parallelize_tensor
from megatron.parallel_state import ParallelState


@dataclass(frozen=True)
class PipelineStage:
    """The parts of a `GPTModel` one pipeline stage holds: transformer layers `layers` (0-based indices into
    `decoder.layers`), the embedding on the first stage, the final norm and the LM head on the last."""

    layers: range
    embedding: bool
    head: bool

    def holds(self, name: str) -> bool:
        """Whether parameter or buffer `name` (a `GPTModel` state_dict key) belongs to this stage."""
        if name.startswith("decoder.layers."):
            return int(name.split(".")[2]) in self.layers
        if name.startswith("embedding."):
            return self.embedding
        if name.startswith(("decoder.final_layernorm.", "output_layer.", "output_head.")):
            return self.head
        if name.startswith("rotary."):
            return True  # every layer recomputes its rotary table from the positions
        raise ValueError(f"PipelineStage: no stage rule for {name!r}")


def tensor_parallel_pieces(config: ModelConfig, rank: int, size: int) -> PieceOf:
    """`piece_of` for `materialize`: a parameter that `parallelize_tensor` sharded (it carries
    `tensor_parallel_dim`) is rank `rank`'s piece of the full tensor as `shard_spec` defines it."""

    def piece_of(name: str, param: nn.Parameter) -> Piece:
        dim = getattr(param, TP_SHARD_DIM, None)
        if dim is None:
            return Piece(param.shape)
        spec = shard_spec(name, config)
        if spec is None or spec.dim != dim:
            raise ValueError(f"{name} is sharded along dim {dim} but the layout table says {spec}")
        full = list(param.shape)
        full[dim] *= size
        return Piece(torch.Size(full), dim, shard_indices(full[dim], spec, rank, size))

    return piece_of


def model_part(name: str) -> str:
    """The part that parameter or buffer `name` is materialized with under `partition`: `decoder.layers.<i>` for a
    transformer layer's, `decoder.<module>` for the decoder's others, else the top-level module's name."""
    parts = name.split(".")
    if parts[0] != "decoder":
        return parts[0]
    return ".".join(parts[:3] if parts[1] == "layers" else parts[:2])


def build_model(config: ModelConfig, device: torch.device | str, seed: int,
                parallel: ParallelState = ParallelState(), sequence_parallel: bool = False,
                stage: Optional[PipelineStage] = None,
                partition: Optional[Callable[[nn.Module], None]] = None) -> GPTModel:
    """This rank's `GPTModel` on `device`: tensor-parallel over `parallel` (a no-op at TP=1); with `stage`,
    only that pipeline stage's parts materialized (the rest stays on meta, see the module docstring); with
    `partition` (ZeRO-3), each part handed to it as soon as it is materialized (module docstring).

    At TP=1 without a stage it equals `GPTModel(config, seed=seed, device=device)`.
    """
    model = GPTModel(config, device="meta")
    parallelize_tensor(model, parallel, sequence_parallel)
    piece_of = tensor_parallel_pieces(config, parallel.tensor_parallel_rank, parallel.tensor_parallel_size)
    if partition is None:
        materialize(model, device, seed, piece_of=piece_of, keep=stage.holds if stage is not None else None)
        return model
    if stage is not None or parallel.tensor_parallel_size > 1:
        raise ValueError("build_model: partitioned construction (ZeRO-3) is for TP = 1 without pipeline stages")
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    for part in dict.fromkeys(model_part(name) for name in names):  # in model order, each part once
        materialize(model, device, seed, piece_of=piece_of, keep=lambda name, part=part: model_part(name) == part)
        partition(model.get_submodule(part))
    return model
