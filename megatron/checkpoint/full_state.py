"""The whole training state of a checkpoint of any layout, without its layout: what resharding starts from.

`read_full_state(folder)` returns a `FullState` whose tensors are all full-model (TP = 1, PP = 1, DP = 1):

    model        the merged state dict (`layouts.read_model_state`); FP32 master weights where the checkpoint
                 has them apart from BF16 module weights (--params-dtype bf16 under ZeRO 1/2: `_use_masters`)
    optimizer    None (saved with --no-save-optim), or
                 {"groups":  the saved hyper-parameters of each param group (0: decay, 1: no decay),
                  "params":  {full parameter name: {"step", "exp_avg", "exp_avg_sq"}} (FP32 moments),
                  "fp8_adam": Fp8AdamW's plain-data extras (formats, stochastic-rounding streams) or None}
    fp8          the FP8 scaling state keyed by full-model layer names (`megatron.fp8.state`)
    extras       the rest of rank 0's client state: LR schedule, RNG
    train_state, config (the saved run's), layout, path

Why FP32 moments: a saved Fp8AdamW moment is FP8 codes times one scale per tensor or per block *of the saved
piece* (a TP shard, a ZeRO partition of flattened parameters). Another layout cuts other pieces, whose blocks
straddle the old ones, so the codes cannot be moved as they are: they are dequantized here (exactly: FP8 times
a power of two or an FP32 scale is representable in FP32) and quantized again by the loading optimizer, which
adds at most one more rounding per element (docs/checkpoints.md, "Resharding on resume", has the bound and
the measurement).

Where the optimizer state lives, per layout (file names as in `layouts.py`):

    single / TP          mp_rank_XX/model_optim_rng.pt["optimizer"]: torch state dict of the TP shard; its
                         parameter indices follow the model's parameter order, decay group first
    deepspeed, ZeRO 0    mp_rank_00_model_states.pt["optimizer"]: the same, for the whole model
    deepspeed, ZeRO 1/2  zero_pp_rank_<d>_mp_rank_00_optim_states.pt: each data-parallel rank's slice of the
                         flattened group, with DeepSpeed's `param_slice_mappings` (name -> offset, length);
                         a parameter's slices are consecutive in rank order
    pipeline             per stage s: mp_rank_<s>_model_states.pt (ZeRO 0) or zero_pp_rank_<d>_mp_rank_<s>_...
                         (ZeRO 1), named by the PipelineModule (`<layer index>.<name in the layer>`)
    deepspeed_zero3      zero_pp_rank_<d>_mp_rank_00_optim_states.pt: each rank's piece of every parameter,
                         ceil(numel / DP) elements, end to end per sub-group (`_read_zero3`)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron.checkpoint import dcp_io, layouts
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.configs import model_config_from_dict
from megatron.checkpoint.deepspeed_io import CLIENT_KEY, DS_MODEL_FILE
from megatron.config import ModelConfig
from megatron.optimizer.fp8_state_quant import dequantize
from megatron.parallel.layout import ShardSpec, merge_shards, shard_spec

MOMENTS = ("exp_avg", "exp_avg_sq")
# ZeRO partitions also hold each slice's FP32 master weights: with --params-dtype bf16 the module states are
# BF16, and the master (what resume continues from) is read from the partitions instead (`_use_masters`).
MASTER = "master"
_PARTITIONED = (*MOMENTS, MASTER)
# DeepSpeed's BF16_Optimizer (ZeRO-1 with --params-dtype bf16) prefixes its partition files with "bf16_".
_ZERO_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


@dataclass
class FullState:
    model: dict[str, torch.Tensor]
    optimizer: Optional[dict]
    fp8: Optional[dict]
    extras: dict
    train_state: dict
    config: dict
    layout: str
    path: Path
    optimizer_missing: str = ""  # why `optimizer` is None


    @property
    def saved_parallel(self) -> dict:
        return self.config.get("parallel", {})


# ------------------------------------------------------------------------------- pipeline names
def pipeline_to_full_name(name: str, num_layers: int) -> str:
    """`<layer index>.<rest>` of a PipelineModule (embedding 0, transformer layers 1..L, head L+1) -> GPTModel's."""
    index, _, rest = name.partition(".")
    i = int(index)
    if i == 0:
        return rest
    if i <= num_layers:
        return f"decoder.layers.{i - 1}.{rest.removeprefix('layer.')}"
    return rest if rest.startswith("output_layer") else f"decoder.{rest}"


def full_to_pipeline_name(name: str, num_layers: int) -> str:
    """Inverse of `pipeline_to_full_name`."""
    if name.startswith("embedding."):
        return f"0.{name}"
    if name.startswith("decoder.layers."):
        index, _, rest = name.removeprefix("decoder.layers.").partition(".")
        return f"{int(index) + 1}.layer.{rest}"
    if name.startswith("decoder."):
        return f"{num_layers + 1}.{name.removeprefix('decoder.')}"
    return f"{num_layers + 1}.{name}"


def pipeline_stage_names(names: list[str], num_layers: int, stages: int, stage: int) -> list[str]:
    """The full names held by pipeline stage `stage`, in order: an equal share of the transformer layers (the
    trainer requires --num-layers divisible by the stages), the embedding on the first stage, the head on the last."""
    per = num_layers // stages
    out = []
    for name in names:
        index = int(full_to_pipeline_name(name, num_layers).split(".", 1)[0])
        owner = 0 if index == 0 else stages - 1 if index == num_layers + 1 else (index - 1) // per
        if owner == stage:
            out.append(name)
    return out


# ------------------------------------------------------------------------------------- moments
def moment_values(saved: dict, name: str, shape: torch.Size) -> torch.Tensor:
    """FP32 values of one saved moment (AdamW's FP32 tensor, or Fp8AdamW's codes and scales) of `shape`."""
    data, scale_inv = saved[name], saved.get(name + "_scale_inv")
    numel = shape.numel()
    if scale_inv is None:
        if data.numel() != numel:
            raise ckpt.CheckpointError(f"optimizer moment {name} has {data.numel()} values, its parameter {numel}")
        return data.float().reshape(shape).clone()
    return dequantize(data, scale_inv.float(), numel).reshape(shape).clone()


def _step(saved: dict) -> float:
    return float(saved.get("step", 0))


def _param_groups(optimizer_state: dict) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer_state["param_groups"]]


def ordered_groups(names: list[str], model: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names in the optimizer's order (`megatron.optimizer.get_param_groups`): matrices, then vectors."""
    decay = [n for n in names if model[n].ndim >= 2]
    no_decay = [n for n in names if model[n].ndim < 2]
    return [decay, no_decay] if no_decay else [decay]


def _tensor_parallel_shape(name: str, shape: torch.Size, model_config: ModelConfig,
                           tp: int) -> tuple[Optional[ShardSpec], torch.Size]:
    """The TP layout of parameter `name` and the shape of one TP rank's piece of it (the shape itself at TP = 1)."""
    spec = shard_spec(name, model_config) if tp > 1 else None
    local = list(shape)
    if spec is not None:
        local[spec.dim] //= tp
    return spec, torch.Size(local)


def _torch_optimizer_moments(states: list[dict], names: list[str], model: dict[str, torch.Tensor],
                             model_config: ModelConfig) -> dict[str, dict]:
    """Per-name moments from torch optimizer state dicts, one per TP rank (merged along the TP layout)."""
    tp = len(states)
    order = [n for group in ordered_groups(names, model) for n in group]
    out: dict[str, dict] = {}
    for index, name in enumerate(order):
        spec, local = _tensor_parallel_shape(name, model[name].shape, model_config, tp)
        per_rank = []
        for state in states:
            saved = state["state"].get(index)
            if saved is None:  # a parameter that never had a gradient step: no state anywhere
                break
            per_rank.append({m: moment_values(saved, m, local) for m in MOMENTS} | {"step": _step(saved)})
        if len(per_rank) != tp:
            continue
        entry = {"step": per_rank[0]["step"]}
        for m in MOMENTS:
            entry[m] = per_rank[0][m] if spec is None else merge_shards([r[m] for r in per_rank], spec)
        out[name] = entry
    return out


def _zero_moments(files: list[Path], rename) -> tuple[dict[str, dict], dict]:
    """Per-name flat moments from the ZeRO 1/2 partition files of one model-parallel rank, in data-parallel order
    (a parameter's slices are consecutive across ranks)."""
    pieces: dict[str, dict[str, list]] = {}
    steps: dict[str, float] = {}
    base0: dict = {}
    for file in files:
        osd = layouts.load_file(file)["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        base0 = base0 or base
        mappings = osd.get("param_slice_mappings")
        if mappings is None:
            raise ckpt.CheckpointError(f"{file} has no param_slice_mappings (DeepSpeed older than 0.10?): "
                                       "cannot tell which parameter each slice belongs to")
        for i, mapping in enumerate(mappings):
            saved = base["state"].get(i)
            if saved is None:
                continue
            partition = osd["single_partition_of_fp32_groups"][i]
            flat = {m: moment_values(saved, m, partition.shape) for m in MOMENTS}
            flat[MASTER] = partition.float()  # the FP32 master weights of this slice
            for local_name, address in mapping.items():
                name = rename(local_name)
                slot = pieces.setdefault(name, {m: [] for m in _PARTITIONED})
                for m in _PARTITIONED:
                    slot[m].append(flat[m][address.start:address.start + address.numel])
                steps[name] = _step(saved)
    out = {name: {"step": steps[name], **{m: torch.cat(slot[m]) for m in _PARTITIONED}} for name, slot in pieces.items()}
    return out, base0


def _merge_tensor_parallel(per_rank: list[dict[str, dict]], model: dict[str, torch.Tensor],
                           model_config: ModelConfig) -> dict[str, dict]:
    """Full moments from each TP rank's flat per-name moments (TP shards merged along the TP layout)."""
    tp = len(per_rank)
    out = {}
    for name in per_rank[0]:
        spec, local = _tensor_parallel_shape(name, model[name].shape, model_config, tp)
        entry = {"step": per_rank[0][name]["step"]}
        for m in _PARTITIONED:
            pieces = []
            for rank in per_rank:
                values = rank.get(name, {}).get(m)
                if values is None or values.numel() != local.numel():
                    raise ckpt.CheckpointError(f"ZeRO partitions of {name} hold {None if values is None else values.numel()} "
                                               f"values per tensor-parallel rank, the parameter "
                                               f"{local.numel()}: the partition files are incomplete")
                pieces.append(values.reshape(local))
            entry[m] = pieces[0] if spec is None else merge_shards(pieces, spec)
        out[name] = entry
    return out


def _zero_files(folder: Path, mp_rank: int) -> list[Path]:
    found = {}
    for p in folder.glob("*zero_pp_rank_*_optim_states.pt"):
        m = _ZERO_OPTIM.fullmatch(p.name)
        if m and int(m.group(2)) == mp_rank:
            found[int(m.group(1))] = p
    if found and sorted(found) != list(range(len(found))):
        raise ckpt.CheckpointError(f"{folder}: ZeRO partition files of data-parallel ranks {sorted(found)} "
                                   f"(expected 0..{len(found) - 1}): some are missing")
    return [found[d] for d in sorted(found)]


def _optimizer_meta(base: dict) -> dict:
    return {"groups": _param_groups(base) if base else [], "fp8_adam": base.get("fp8_adam") if base else None}


def _read_torch_layouts(folder: Path, names, model, model_config) -> tuple[Optional[dict], dict]:
    shards = []
    rank = 0
    while ckpt.model_file(folder, rank).exists():
        shards.append(layouts.load_file(ckpt.model_file(folder, rank)))
        rank += 1
    extras = {k: v for k, v in shards[0].items() if k not in ("model", "optimizer")}
    if any("optimizer" not in s for s in shards):
        return None, extras
    states = [s["optimizer"] for s in shards]
    return {"params": _torch_optimizer_moments(states, names, model, model_config), **_optimizer_meta(states[0])}, extras


def _read_torch_dist(folder: Path, model_config: ModelConfig) -> tuple[Optional[dict], dict]:
    """A sharded (DCP) checkpoint's optimizer state, keyed by name already, and rank 0's extras (dcp_io.py)."""
    extras = {k: v for k, v in dcp_io.read_extras(folder).items() if k not in ("checkpoint_version", "iteration")}
    saved = dcp_io.full_optimizer(folder, model_config)
    if saved is None:
        return None, extras
    from megatron.optimizer.fp8_adam_shards import moment_values  # Fp8AdamW's codes and scales: their values

    params = {name: {m: moment_values(entry, m) for m in MOMENTS} | {"step": _step(entry)}
              for name, entry in saved["state"].items()}
    return {"params": params, **_optimizer_meta(saved)}, extras


def _saved_tp(config: dict) -> int:
    return int(config.get("parallel", {}).get("tensor_model_parallel_size", 1) or 1)


def _read_stage_optimizer(folder: Path, mp_ranks: list[int], rename, names, model, model_config):
    """(moments, base state) of the model-parallel ranks `mp_ranks` (one per TP rank, in order); None: none saved."""
    zero = [_zero_files(folder, r) for r in mp_ranks]
    if all(zero):
        results = [_zero_moments(files, rename) for files in zero]
        return _merge_tensor_parallel([r[0] for r in results], model, model_config), results[0][1]
    states = [layouts.load_file(folder / f"mp_rank_{r:02d}_model_states.pt").get("optimizer") for r in mp_ranks]
    if not all(states):
        return None, None
    return _torch_optimizer_moments(states, names, model, model_config), states[0]


def _read_deepspeed(folder: Path, names, model, model_config, tp: int) -> tuple[Optional[dict], dict]:
    data = layouts.load_file(folder / DS_MODEL_FILE)
    extras = dict(data.get(CLIENT_KEY) or {})
    params, base = _read_stage_optimizer(folder, list(range(tp)), lambda n: n, names, model, model_config)
    return (None if params is None else {"params": params, **_optimizer_meta(base)}), extras


def _zero3_partitioned_numel(numel: int, world: int) -> int:
    """Elements of one parameter each ZeRO-3 rank holds: the parameter is split evenly, the last piece padded."""
    return -(-numel // world)


def _read_zero3(folder: Path) -> tuple[Optional[dict], dict]:
    """ZeRO-3: each rank's optim file holds, per sub-group k, its FP32 flat partition (`fp32_flat_groups[k]`)
    and the client optimizer's state on it (base state index k: DeepSpeed fills the param groups with the
    sub-groups in order). A sub-group's flat partition is its parameters' pieces end to end, in the order of the
    model-states file's `param_shapes`; rank r's piece of a parameter of n elements is elements
    [r * ceil(n / DP), (r + 1) * ceil(n / DP)) of the flattened parameter, zero-padded past n."""
    model_states = layouts.load_file(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    extras = dict(model_states.get(CLIENT_KEY) or {})
    files = _zero_files(folder, 0)
    if not files:
        return None, extras
    shapes = [(name, torch.Size(shape)) for group in model_states["param_shapes"] for name, shape in group.items()]
    world = len(files)
    per_rank: list[dict[str, torch.Tensor]] = []  # each rank's moments, flat over all its sub-groups
    steps: set[float] = set()
    base0: dict = {}
    for file in files:
        osd = layouts.load_file(file)["optimizer_state_dict"]
        base, flats = osd["optimizer_state_dict"], osd["fp32_flat_groups"]
        base0 = base0 or base
        if len(base["state"]) != len(flats):
            if not base["state"]:  # saved before the first step: no moments anywhere
                return None, extras
            raise ckpt.CheckpointError(f"{file}: {len(base['state'])} optimizer states for {len(flats)} ZeRO-3 "
                                       "sub-groups: the file is not one this reader understands")
        moments = {m: [] for m in MOMENTS}
        for k, flat in enumerate(flats):
            saved = base["state"][k]
            steps.add(_step(saved))
            for m in MOMENTS:
                moments[m].append(moment_values(saved, m, flat.shape))
        per_rank.append({m: torch.cat(v) for m, v in moments.items()})
    if len(steps) != 1:
        raise ckpt.CheckpointError(f"{folder}: the ZeRO-3 sub-groups were stepped {sorted(steps)} times")
    step = steps.pop()
    held = sum(_zero3_partitioned_numel(shape.numel(), world) for _, shape in shapes)
    if any(r[MOMENTS[0]].numel() != held for r in per_rank):
        raise ckpt.CheckpointError(f"{folder}: the ZeRO-3 partitions hold {per_rank[0][MOMENTS[0]].numel()} values "
                                   f"per rank, the parameters in param_shapes {held}: the files are incomplete")
    params: dict[str, dict] = {}
    offset = 0
    for name, shape in shapes:
        piece = _zero3_partitioned_numel(shape.numel(), world)
        params[name] = {"step": step, **{
            m: torch.cat([r[m][offset:offset + piece] for r in per_rank])[:shape.numel()].reshape(shape).clone()
            for m in MOMENTS}}
        offset += piece
    return {"params": params, **_optimizer_meta(base0)}, extras


def _read_pipeline(folder: Path, names, model, model_config, stages: int, tp: int) -> tuple[Optional[dict], dict]:
    """Stage s, TP rank t wrote mp_rank_<s x TP + t>_model_states.pt (client state; with ZeRO 0 its optimizer)."""
    num_layers = model_config.num_layers
    params: dict[str, dict] = {}
    meta: dict = {}
    fp8_layers: dict = {}
    extras: dict = {}
    has_optimizer = True
    rename = lambda n: pipeline_to_full_name(n, num_layers)  # noqa: E731
    for stage in range(stages):
        data = layouts.load_file(folder / f"mp_rank_{stage * tp:02d}_model_states.pt")
        client = dict(data.get(CLIENT_KEY) or {})
        if stage == 0:
            extras = client
        fp8 = client.get("fp8")
        if fp8:
            fp8_layers.update({rename(k): v for k, v in fp8["layers"].items()})
        stage_names = pipeline_stage_names(names, num_layers, stages, stage)
        stage_params, base = _read_stage_optimizer(folder, [stage * tp + t for t in range(tp)], rename, stage_names,
                                                   model, model_config)
        if stage_params is None:
            has_optimizer = False
            continue
        params.update(stage_params)
        meta = meta or _optimizer_meta(base)
    if extras.get("fp8") is not None:
        extras["fp8"] = {**extras["fp8"], "layers": fp8_layers}
    return ({"params": params, **meta} if has_optimizer else None), extras


def read_full_state(folder: Path) -> FullState:
    """The layout-free state of iteration folder `folder` (module docstring)."""
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ckpt.CheckpointError(f"{config_file} is missing: the saved model's shape cannot be known without it")
    config = ckpt.read_json(config_file)
    model_config = model_config_from_dict(config, folder)
    model, _, layout = layouts.read_model_state(folder, model_config)
    names = list(model)
    if layout in (layouts.SINGLE, layouts.TENSOR_PARALLEL):
        optimizer, extras = _read_torch_layouts(folder, names, model, model_config)
    elif layout == layouts.TORCH_DIST:
        optimizer, extras = _read_torch_dist(folder, model_config)
    elif layout == layouts.DEEPSPEED:
        optimizer, extras = _read_deepspeed(folder, names, model, model_config, _saved_tp(config))
    elif layout == layouts.PIPELINE:
        tp = _saved_tp(config)
        stages = int(config.get("parallel", {}).get("pipeline_model_parallel_size", 0)) or \
            len(list(folder.glob("mp_rank_*_model_states.pt"))) // tp
        optimizer, extras = _read_pipeline(folder, names, model, model_config, stages, tp)
    else:
        optimizer, extras = _read_zero3(folder)
    if optimizer is not None:
        _use_masters(model, optimizer["params"])
        missing = [n for n in names if n not in optimizer["params"]]
        if missing and len(missing) < len(names):
            raise ckpt.CheckpointError(f"{folder}: the optimizer state covers {len(names) - len(missing)} of "
                                       f"{len(names)} parameters (missing e.g. {missing[:3]})")
    fp8 = extras.pop("fp8", None)
    train_state = ckpt.read_json(folder / "train_state.json")
    missing_reason = "" if optimizer is not None else "saved with --no-save-optim"
    return FullState(model=model, optimizer=optimizer, fp8=fp8, extras=extras, train_state=train_state,
                     config=config, layout=layout, path=folder, optimizer_missing=missing_reason)


def _use_masters(model: dict[str, torch.Tensor], params: dict[str, dict]) -> None:
    """Replace BF16 module weights by the FP32 master weights the ZeRO partitions hold (--params-dtype bf16), and
    drop the masters from the moment entries. FP32 module weights are the masters already (checked equal)."""
    for name, entry in params.items():
        master = entry.pop(MASTER, None)
        if master is None or name not in model:
            continue
        if master.numel() != model[name].numel():
            raise ckpt.CheckpointError(f"the ZeRO partitions hold {master.numel()} master values of {name}, the "
                                       f"module {model[name].numel()}: the partition files are incomplete")
        if model[name].dtype != torch.float32:
            model[name] = master.reshape(model[name].shape).clone()


def tensor_parallel_piece(name: str, full: torch.Tensor, model_config: ModelConfig, tp_rank: int,
                          tp_size: int) -> torch.Tensor:
    """This TP rank's piece of a full-model tensor named `name` (a copy; the tensor itself at TP = 1)."""
    from megatron.parallel.layout import shard_tensor

    spec = shard_spec(name, model_config) if tp_size > 1 else None
    return full.clone() if spec is None else shard_tensor(full, spec, tp_rank, tp_size)


__all__: list[Any] = ["FullState", "read_full_state", "pipeline_to_full_name", "full_to_pipeline_name",
                      "pipeline_stage_names", "tensor_parallel_piece", "MOMENTS"]
