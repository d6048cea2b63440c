"""Sharded checkpoints of FSDP2 under tensor parallelism: every rank's shards as pieces of one global tensor.

FSDP2 shards each tensor-parallel rank's piece of a parameter over that rank's data-parallel group: a DTensor on a
1-D mesh whose global shape is the TP piece's. Saved as it is, the TP ranks' pieces of a weight would all claim the
same key and the same offsets. `TensorParallelShards.globalize` re-describes each local shard (the same storage, no
copy) as a piece of a DTensor on the 2-D mesh (tp, dp): Shard(TP dimension) over tp, then FSDP2's Shard(0) over dp,
tp outermost, which is how the pieces nest (the rank layout puts TP ranks innermost: rank = replica * tp + tp rank,
parallel_state.py). Replicated tensors (norms) are Replicate() over tp: DCP writes them once. Fp8AdamW's per-tensor
scales are one per TP piece: a (tp,) tensor, Shard(0) over tp.

The global tensor is the TP pieces end to end along their dimension; checkpoint/dcp_io.untangled gives readers the
full model's layout (SwiGLU's fc1 pieces are [gate_r | up_r]). A load at the same TP size reads the overlapping
pieces in place, at any data-parallel size; another TP size loads through the full state (checkpoint/reshard.py).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron.checkpoint import dcp_io
from megatron.config import ModelConfig
from megatron.parallel.layout import shard_spec
from megatron.parallel_state import ParallelState


def parameter_name(key: str) -> str:
    """The parameter a flat DCP key belongs to (`model/<name>`, `optimizer/state/<name>/<entry>`)."""
    if key.startswith(dcp_io.MODEL):
        return key[len(dcp_io.MODEL):]
    return key[len(dcp_io.STATE):].rpartition("/")[0]


class TensorParallelShards:
    """The (tp, dp) mesh over the process groups the run has, and the re-description of the flat state on it."""

    def __init__(self, parallel: ParallelState, model_config: ModelConfig, device_type: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_size
        ranks = torch.arange(tp * dp).reshape(dp, tp).T  # [tp rank, replica] -> rank
        self.tp, self.model_config = tp, model_config
        self.mesh = DeviceMesh.from_group([parallel.tensor_parallel_group, parallel.data_parallel_group],
                                          device_type, mesh=ranks, mesh_dim_names=("tp", "dp"))

    def globalize(self, flat: dict[str, Any]) -> dict[str, Any]:
        """`flat` (dcp_io.flat_state of this rank's FSDP2 shards) with every DTensor a piece of its global tensor."""
        from torch.distributed.tensor import DTensor

        out = {}
        for key, value in flat.items():
            if isinstance(value, DTensor):
                value = self._global(parameter_name(key), value)
            elif key.endswith("_scale_inv") and isinstance(value, torch.Tensor):
                value = self._per_piece(parameter_name(key), value)
            out[key] = value
        return out

    def _per_piece(self, name: str, scale: torch.Tensor) -> Any:
        """Fp8AdamW's per-tensor scale of a moment (shape (1,), equal over the data-parallel ranks) is its TP
        piece's own: (tp,) over the mesh, one per piece (checkpoint/dcp_io.full_optimizer reads the codes piece by
        piece). A replicated parameter's is the same on every rank, saved once as it is."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if shard_spec(name, self.model_config) is None:
            return scale
        return DTensor.from_local(scale.reshape(1), self.mesh, (Shard(0), Replicate()), run_check=False,
                                  shape=torch.Size((self.tp,)), stride=(1,))

    def _global(self, name: str, value: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        (fsdp_placement,) = value.placements
        spec = shard_spec(name, self.model_config)
        shape = list(value.shape)
        if spec is not None:
            shape[spec.dim] *= self.tp
        placements = (Shard(spec.dim) if spec is not None else Replicate(), fsdp_placement)
        stride = torch.empty(shape, device="meta").stride()
        with torch.no_grad():
            return DTensor.from_local(value._local_tensor, self.mesh, placements, run_check=False,
                                      shape=torch.Size(shape), stride=stride)
