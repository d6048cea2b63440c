"""Fp8AdamW on FSDP2's shards: each rank steps its own rows of every parameter, and the result is the unsharded one's.

FSDP2 gives every rank rows [start_r, end_r) of each parameter (a DTensor, Shard(0) over the data-parallel mesh; torch
.chunk's split: ceil(rows / world) rows each, the last ones shorter or empty). Fp8AdamW steps the local rows
(`local`) with three facts that make its FP8 moments those of the same optimizer on the whole tensor:
- the blocks of a blockwise scale never straddle a shard boundary: every shard starts on a block boundary
  (`check_blocks` refuses a block size that does not divide ceil(rows / world) x row length);
- stochastic rounding's noise is keyed on the element's position in the whole tensor (`flat_offset`);
- a per-tensor scale takes the amax of the whole tensor: the shards' amaxes are max-reduced over the mesh
  (Fp8AdamW's `shard_group`).
A checkpoint holds the unsharded optimizer's state (`unsharded_state_dict`: the shards' codes, scales and FP32
moments end to end, exactly the bytes the whole-tensor optimizer would hold), so every engine and tool reads it, and
`local_state_dict` cuts it (or a resharded checkpoint's FP32 moments) back into this rank's rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron import comm
from megatron.optimizer.fp8_state_quant import block_layout, dequantize

MOMENTS = ("exp_avg", "exp_avg_sq")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor as a plain tensor (the same storage); any other tensor as it is. A shard that
    `--fp8-param-gather` wraps (a tensor subclass) gives the high-precision tensor inside (its `plain`): the update
    writes it in place, and a compiled update traces no subclass."""
    shard = getattr(tensor, "_local_tensor", tensor)
    return getattr(shard, "plain", shard)


def is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "_local_tensor") and hasattr(p, "device_mesh")


@dataclass(frozen=True)
class Rows:
    """How a parameter's rows are split over the mesh (torch.chunk's split, as FSDP2's Shard(0))."""

    rows: int
    row_numel: int
    world: int
    rank: int

    @classmethod
    def of(cls, p: torch.Tensor) -> "Rows":
        from torch.distributed.tensor import Shard

        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"Fp8AdamW steps FSDP2 shards of dimension 0; got placements {p.placements}")
        shape = tuple(p.shape)
        return cls(shape[0], math.prod(shape[1:]), p.device_mesh.size(), p.device_mesh.get_local_rank())

    @property
    def chunk(self) -> int:
        return -(-self.rows // self.world)

    def start(self, rank: int) -> int:
        """The first element of `rank`'s rows in the flattened parameter."""
        return min(rank * self.chunk, self.rows) * self.row_numel

    def numel(self, rank: int) -> int:
        return min(self.start(rank) + self.chunk * self.row_numel, self.rows * self.row_numel) - self.start(rank)


def flat_offset(p: torch.Tensor) -> int:
    """The position of this rank's first element in the flattened whole parameter (0 when not sharded)."""
    if not is_sharded(p):
        return 0
    rows = Rows.of(p)
    return rows.start(rows.rank)


def check_blocks(p: torch.Tensor, block_size: int) -> None:
    """Every shard of `p` must start on a scale block's boundary (module docstring): ValueError otherwise."""
    if block_size <= 0 or not is_sharded(p):
        return
    rows = Rows.of(p)
    step = rows.chunk * rows.row_numel
    if rows.chunk < rows.rows and step % block_size:
        raise ValueError(f"--fp8-optimizer-block-size {block_size}: under FSDP2 a parameter of shape {tuple(p.shape)} "
                         f"is split into shards of {step} elements over {rows.world} ranks, which blocks of "
                         f"{block_size} would straddle; use a block size that divides {step} (e.g. 128 for "
                         "Llama shapes)")


def _gather_flat(piece: torch.Tensor, lengths: list[int], group: Any) -> torch.Tensor:
    """The ranks' 1-D pieces (of `lengths`) end to end, in rank order; FP8 travels as bytes."""
    as_bytes = piece.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    send = piece.view(torch.uint8) if as_bytes else piece
    width = max(lengths)
    padded = torch.zeros(width, dtype=send.dtype, device=send.device)
    padded[:send.numel()] = send
    out = comm.all_gather(padded, group)
    whole = torch.cat([o[:n] for o, n in zip(out, lengths)])
    return whole.view(piece.dtype) if as_bytes else whole


def _stored_lengths(rows: Rows, fmt_block: Optional[int], is_fp8: bool) -> tuple[list[int], list[int]]:
    """Per rank: the stored elements of a moment and its number of block scales (0 and 0 for an empty shard)."""
    codes, scales = [], []
    for r in range(rows.world):
        n = rows.numel(r)
        if not is_fp8 or n == 0:
            codes.append(n)
            scales.append(0)
            continue
        n_blocks, block_len = block_layout(n, fmt_block or 0)
        codes.append(n_blocks * block_len)
        scales.append(n_blocks)
    return codes, scales


def _moment_format(optimizer: Any, p: torch.Tensor, group: dict, name: str) -> Any:
    return optimizer._formats(p, group)[MOMENTS.index(name)]


def unsharded_state_dict(optimizer: Any, group: Any) -> dict:
    """`optimizer.state_dict()` as the whole-tensor optimizer would return it (a collective over `group`)."""
    sd = optimizer.state_dict()
    params = [(p, g) for g in optimizer.param_groups for p in g["params"]]
    for index, (p, param_group) in enumerate(params):
        entry = sd["state"].get(index)
        if entry is None or not is_sharded(p):
            continue
        entry = sd["state"][index] = dict(entry)  # state_dict() hands out the live per-parameter dicts
        rows = Rows.of(p)
        for name in MOMENTS:
            fmt = _moment_format(optimizer, p, param_group, name)
            codes, scales = _stored_lengths(rows, fmt.block_size, fmt.is_fp8)
            data = entry[name].reshape(-1)[:codes[rows.rank]]
            whole = _gather_flat(data, codes, group)
            entry[name] = whole if fmt.is_fp8 else whole.view(tuple(p.shape))
            key = name + "_scale_inv"
            if key in entry and fmt.block_size > 0:
                entry[key] = _gather_flat(entry[key].reshape(-1)[:scales[rows.rank]], scales, group)
    return sd


def local_state_dict(optimizer: Any, state: dict) -> dict:
    """A whole-tensor optimizer state (ours, in the unsharded layout, or AdamW's FP32 moments) cut into this rank's
    rows, for `optimizer.load_state_dict` (which converts moments of another format)."""
    params = [(p, g) for g in optimizer.param_groups for p in g["params"]]
    out = {**state, "state": {}}
    for index, saved in state["state"].items():
        p, param_group = params[index]
        if not is_sharded(p):
            out["state"][index] = saved
            continue
        rows = Rows.of(p)
        start, n = rows.start(rows.rank), rows.numel(rows.rank)
        entry = {k: v for k, v in saved.items() if not k.startswith(MOMENTS)}
        for name in MOMENTS:
            entry.update(_local_moment(saved, name, _moment_format(optimizer, p, param_group, name), start, n, p))
        out["state"][index] = entry
    return out


def _local_moment(saved: dict, name: str, fmt: Any, start: int, n: int, p: torch.Tensor) -> dict:
    data, scale = saved[name], saved.get(name + "_scale_inv")
    shape = (n // max(math.prod(tuple(p.shape)[1:]), 1), *tuple(p.shape)[1:])
    if scale is None:  # FP32 values (AdamW's, or an FP32-state parameter's): the rows
        return {name: data.reshape(-1)[start:start + n].reshape(shape).clone()}
    saved_block = data.numel() // max(scale.numel(), 1)
    if scale.numel() == 1 and fmt.block_size == 0:  # one scale for the tensor: the codes' rows, the same scale
        return {name: data.reshape(-1)[start:start + n].clone(), name + "_scale_inv": scale.clone()}
    if n == 0:  # an empty shard holds one padding block, as Fp8AdamW makes it
        return {name: torch.zeros(1, dtype=data.dtype), name + "_scale_inv": torch.ones(1, dtype=scale.dtype)}
    if start % saved_block:  # saved with blocks this rank's rows do not start on: the FP32 values, requantized
        values = dequantize(data, scale.float(), data.numel())[start:start + n]
        return {name: values.reshape(shape).clone()}
    blocks = -(-n // saved_block)
    return {name: data.reshape(-1)[start:start + blocks * saved_block].clone(),
            name + "_scale_inv": scale.reshape(-1)[start // saved_block:start // saved_block + blocks].clone()}


def check_sharded_checkpoints(optimizer: Any) -> None:
    """Sharded checkpoints (`--ckpt-format torch_dist`) store a blockwise moment's scales as a (rows, row length /
    block) tensor sharded like its parameter: the block size must divide every FP8-moment parameter's row length."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not (is_sharded(p) and optimizer.uses_fp8_states(p, group) and optimizer.block_size > 0):
                continue
            row_numel = math.prod(tuple(p.shape)[1:])
            if row_numel % optimizer.block_size:
                raise ValueError(f"--fp8-optimizer-block-size {optimizer.block_size} with --ckpt-format torch_dist: a "
                                 f"parameter of shape {tuple(p.shape)} has rows of {row_numel} elements, which the "
                                 "block size must divide (the scales are saved row by row); use a block size dividing "
                                 "every matrix's row length (e.g. 128 for Llama shapes), or --ckpt-format torch")


def sharded_state(optimizer: Any, names: dict[int, str]) -> dict:
    """The optimizer's state as DCP saves and loads it in place (keyed by parameter name, `names` by id): each moment
    (FP8 codes or FP32 values) a DTensor sharded like its parameter, a blockwise moment's scales one of shape
    (rows, row length / block), a per-tensor scale and the step as they are (equal on every rank). States are made
    (zeros) where the optimizer has none yet, so that a load has tensors to read into."""
    from torch.distributed.tensor import DTensor

    state: dict[str, dict] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p].update(optimizer._init_state(local(p), group))
            entry = optimizer.state[p]
            rows = tuple(local(p).shape)  # this rank's rows of the parameter
            out: dict[str, Any] = {"step": entry["step"]}
            for name in MOMENTS:
                data, scale = entry[name], entry.get(name + "_scale_inv")
                n = local(p).numel()
                out[name] = DTensor.from_local(data.reshape(-1)[:n].view(rows), p.device_mesh, p.placements,
                                               run_check=False, shape=p.shape, stride=p.stride())
                if scale is not None and optimizer.block_size > 0:
                    width = math.prod(tuple(p.shape)[1:]) // optimizer.block_size
                    shape = (p.shape[0], width)
                    out[name + "_scale_inv"] = DTensor.from_local(
                        scale.reshape(-1)[:rows[0] * width].view(rows[0], width), p.device_mesh, p.placements,
                        run_check=False, shape=torch.Size(shape), stride=(width, 1))
                elif scale is not None:
                    out[name + "_scale_inv"] = scale
            state[names[id(p)]] = out
    return {"state": state, "param_groups": groups}


def moment_values(entry: dict, name: str) -> torch.Tensor:
    """FP32 values of a moment read whole from a sharded checkpoint (`sharded_state`'s layout: FP8 codes shaped as the
    parameter with a per-tensor scale, or (rows, row length / block) scales; or FP32 values)."""
    data, scale = entry[name], entry.get(name + "_scale_inv")
    if scale is None:
        return data.float()
    return dequantize(data.reshape(-1), scale.reshape(-1).float(), data.numel()).view(data.shape)
