"""Resharding on resume: `--load` of a checkpoint written at another TP / PP / DP layout (or by another engine).

Each engine's `load_checkpoint` first asks `layout_of(folder)` whether the checkpoint's layout is its own; if
so it loads as before (exact: the same bits). Otherwise it calls `load_resharded`, which

1. reads the whole state without its layout (`checkpoint_conversion.full_state.read_full_state`): full-model
   weights, FP32 Adam moments per parameter, FP8 scaling state per layer, LR schedule, RNG, train state;
2. cuts out what this rank holds: its TP piece of each of its parameters (its PP stage's parameters only),
   for ZeRO 1/2 its slice of DeepSpeed's flattened partition (`param._hp_mapping`), for ZeRO-3 its piece of
   each parameter in the sub-group's flat partition (`_load_zero3_optimizer`);
3. writes weights (and ZeRO's FP32 master partition; ZeRO-3's module partitions `ds_tensor` from it), then
   the moments through the optimizer's own `load_state_dict`, which quantizes them into its formats
   (Fp8AdamW: FP8 codes with this layout's scales);
4. returns the client state (LR schedule, RNG, FP8 scaling state under this engine's layer names) to the loop,
   which restores it as for any checkpoint. The data position is the train state's consumed samples.

What is exact and what is not: weights, AdamW moments, step counts, FP8 scaling state (amaxes are reduced over
every rank holding a piece of a tensor, so every piece carries the full tensor's) and the LR schedule move
unchanged. Fp8AdamW moments are requantized: one more rounding of each element to its FP8 format under the new
pieces' scales (bounded in docs/checkpoints.md, "Resharding on resume"). The RNG state of rank 0 is given to
every rank (the pieces of another layout have no RNG of their own; dropout streams change, nothing else).
The padded vocabulary must be the same (`--make-vocab-size-divisible-by` x TP): padding rows take part in
the softmax, so adding or dropping them would change the model; the error says which value to pass.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from megatron.checkpoint import layouts
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.full_state import MOMENTS, FullState, read_full_state, tensor_parallel_piece
from megatron.config import ModelConfig
from megatron.partitioned import full_shape, zero3_partitions_in_groups

logger = logging.getLogger("megatron")


def saved_layout(folder: Path) -> dict:
    """What the files of iteration folder `folder` say about its layout: {"layout", "mp_files", "zero_ranks",
    "optimizer" (the saved run's --optimizer, None when its config.json does not say)}."""
    layout = layouts.detect_layout(folder)
    mp = len(list(folder.glob("mp_rank_*_model_states.pt"))) or len(list(folder.glob("mp_rank_*/model_optim_rng.pt")))
    zero = len(list(folder.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))  # "bf16_" prefix: BF16_Optimizer
    if layout == layouts.DEEPSPEED_ZERO3:  # every ZeRO-3 rank writes its model-states file, optimizer or not
        zero = len(list(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")))
    config_file = folder / "config.json"
    try:
        saved_optimizer = ckpt.read_json(config_file).get("optimizer", {}).get("optimizer") \
            if config_file.exists() else None
    except (ckpt.CheckpointError, AttributeError):
        saved_optimizer = None  # the loader names a damaged config.json
    return {"layout": layout, "mp_files": mp, "zero_ranks": zero, "optimizer": saved_optimizer}


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The --optimizer value of a built optimizer (what config.json records)."""
    from megatron.optimizer.fp8_adam import Fp8AdamW

    return "fp8adam" if isinstance(optimizer, Fp8AdamW) else "adam"


def optimizer_switched(saved: dict, optimizer: torch.optim.Optimizer, load_optimizer: bool) -> bool:
    """The checkpoint's optimizer states are of the other kind (Fp8AdamW's FP8 moments vs AdamW's FP32 ones): they
    are loaded through the full state, which converts the moments, as for a change of layout."""
    return load_optimizer and saved.get("optimizer") not in (None, optimizer_name(optimizer))


def newest_folder(load_dir: str, iteration: Optional[int] = None) -> Optional[Path]:
    """The folder of `iteration` (None: the tracker's) under `load_dir`; None when there is no checkpoint."""
    iteration = ckpt.read_tracker(load_dir) if iteration is None else iteration
    return None if iteration is None else ckpt.iteration_dir(load_dir, iteration)


def _shape_error(name: str, saved: torch.Size, local: torch.Size, full: FullState, model_config: ModelConfig,
                 tp_size: int) -> ckpt.CheckpointError:
    if "word_embeddings" in name or name.startswith("output_layer"):
        saved_rows = int(full.model[name].shape[0])
        divisor = saved_rows // tp_size if saved_rows % tp_size == 0 else saved_rows
        return ckpt.CheckpointError(
            f"{full.path} has a padded vocabulary of {saved_rows} rows, this run {model_config.padded_vocab_size} "
            f"(--make-vocab-size-divisible-by x --tensor-model-parallel-size {tp_size}): the padding rows take part "
            f"in the softmax, so they must stay. Pass --make-vocab-size-divisible-by {divisor} to keep {saved_rows}.")
    return ckpt.CheckpointError(f"{full.path} does not match the model built from the current flags: {name} is "
                                f"{tuple(saved)} there and {tuple(local)} here (this rank's piece). Use the same "
                                "--num-layers/--hidden-size/... as the run that saved it.")


def _pieces(named_params: list[tuple[str, nn.Parameter]], full: FullState, model_config: ModelConfig,
            tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    missing = [n for n, _ in named_params if n not in full.model]
    if missing:
        raise ckpt.CheckpointError(f"{full.path} lacks parameters of this model: {missing[:5]}; use the same "
                                   "architecture flags as the run that saved it")
    out = {}
    for name, param in named_params:
        shape = full_shape(param)  # ZeRO-3: the parameter's shape, not its partition's
        try:
            piece = tensor_parallel_piece(name, full.model[name], model_config, tp_rank, tp_size)
        except ValueError:
            piece = None
        if piece is None or piece.shape != shape:
            raise _shape_error(name, full.model[name].shape, shape, full, model_config, tp_size)
        out[name] = piece
    return out


def _moment_pieces(name: str, full: FullState, model_config: ModelConfig, tp_rank: int, tp_size: int) -> dict:
    saved = full.optimizer["params"][name]
    return {"step": torch.tensor(float(saved["step"]), dtype=torch.float32),
            **{m: tensor_parallel_piece(name, saved[m], model_config, tp_rank, tp_size) for m in MOMENTS}}


def _load_state(optimizer: torch.optim.Optimizer, state: dict, groups: list[dict], full: FullState) -> None:
    """`optimizer.load_state_dict` of FP32 moments; an Fp8AdamW also gets the saved stochastic-rounding streams."""
    from megatron.optimizer.fp8_adam import Fp8AdamW

    sd = {"state": state, "param_groups": groups}
    if isinstance(optimizer, Fp8AdamW) and full.optimizer.get("fp8_adam"):
        sd["fp8_adam"] = {k: v for k, v in full.optimizer["fp8_adam"].items() if k == "rng_states"}
    optimizer.load_state_dict(sd)


def _load_plain_optimizer(optimizer: torch.optim.Optimizer, full_name: dict[int, str], full: FullState,
                          model_config: ModelConfig, tp_rank: int, tp_size: int) -> None:
    """An optimizer stepping the parameters themselves (TorchEngine, DeepSpeed ZeRO 0): a torch state dict."""
    sd = _plain_optimizer_state(optimizer, full_name, full, model_config, tp_rank, tp_size)
    _load_state(optimizer, sd["state"], sd["param_groups"], full)


def _plain_optimizer_state(optimizer: torch.optim.Optimizer, full_name: dict[int, str], full: FullState,
                           model_config: ModelConfig, tp_rank: int, tp_size: int) -> dict:
    """This rank's pieces of the saved moments as `optimizer.state_dict()` numbers them, with the current groups."""
    groups, state, index = [], {}, 0
    for group in optimizer.param_groups:  # the current hyper-parameters: the flags win (the LR is the scheduler's)
        ids = []
        for p in group["params"]:
            name = full_name[id(p)]
            if name in full.optimizer["params"]:
                state[index] = _moment_pieces(name, full, model_config, tp_rank, tp_size)
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _load_zero_optimizer(zero, full_name: dict[int, str], full: FullState, model_config: ModelConfig,
                         tp_rank: int, tp_size: int, load_optimizer: bool) -> None:
    """DeepSpeed ZeRO 1/2: this rank's slice of each flattened group (FP32 master weights and the moments).

    `param._hp_mapping` (DeepSpeed's tensor-fragment link) says which elements of a parameter this rank's
    partition holds (lp_fragment_address) and where (hp_fragment_address).
    """
    base = zero.optimizer
    state = {}
    # DeepSpeed's ZeRO 1/2 optimizer, or its BF16_Optimizer (ZeRO-1 with --params-dtype bf16): other attribute names
    bit16_groups = getattr(zero, "bit16_groups", None) or zero.bf16_groups
    fp32_partitions = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_groups_flat_partition
    for i, params in enumerate(bit16_groups):
        partition = fp32_partitions[i]
        flat = {m: torch.zeros_like(partition, dtype=torch.float32) for m in MOMENTS}
        step = None
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue
            name = full_name[id(p)]
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            weight = tensor_parallel_piece(name, full.model[name], model_config, tp_rank, tp_size).reshape(-1)
            with torch.no_grad():
                partition.narrow(0, hp.start, hp.numel).copy_(weight.narrow(0, lp.start, lp.numel))
            if load_optimizer:
                moments = _moment_pieces(name, full, model_config, tp_rank, tp_size)
                step = moments["step"]
                for m in MOMENTS:
                    flat[m].narrow(0, hp.start, hp.numel).copy_(moments[m].reshape(-1).narrow(0, lp.start, lp.numel))
        if load_optimizer and step is not None:
            state[i] = {"step": step, **{m: flat[m].to(partition.device) for m in MOMENTS}}
    if load_optimizer:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]} for i, g in enumerate(base.param_groups)]
        _load_state(base, state, groups, full)
        # DeepSpeed's own loader relinks after replacing the base optimizer's state (its fragments point into it).
        zero._link_all_hp_params()
        zero._hp_optimizer_states_linked = False


def _zero3_slice(tensor: torch.Tensor, rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s ZeRO-3 piece of a flattened parameter: `numel` elements from rank x numel, zero-padded
    past the end (DeepSpeed pads the last pieces so that every rank holds the same count)."""
    flat = tensor.reshape(-1)
    out = torch.zeros(numel, dtype=flat.dtype)
    start = min(rank * numel, flat.numel())
    take = min(numel, flat.numel() - start)
    out[:take] = flat[start:start + take]
    return out


def _load_zero3_optimizer(zero, named: list[tuple[str, nn.Parameter]], pieces: dict[str, torch.Tensor],
                          full: FullState, model_config: ModelConfig, tp_rank: int, tp_size: int,
                          load_optimizer: bool) -> None:
    """DeepSpeed ZeRO-3: this rank's piece of every parameter, into the FP32 master partitions, the module's
    partitions (`ds_tensor`) and the client optimizer's state on the flat partitions.

    Each sub-group k's FP32 master `fp32_partitioned_groups_flat[k]` is its parameters' pieces end to end
    (`fp16_groups[k]` order), each piece `partition_numel()` elements: rank r holds elements
    [r x that, (r + 1) x that) of the flattened parameter, zero-padded. The module's partitions are then copied
    from the masters, as DeepSpeed's own loader does. At load time every parameter is partitioned, also those
    below `stage3_param_persistence_threshold` (DeepSpeed gathers and keeps them from the first forward on).
    """
    if getattr(zero, "offload_param", False) or getattr(zero, "swap_optimizer", False):
        raise ckpt.CheckpointError("resharding into ZeRO-3 with offload_param or an NVMe-swapped optimizer is not "
                                   "supported: resume at the layout that wrote the checkpoint, or without offloading")
    by_id = {id(p): name for name, p in named}
    states = {}
    with torch.no_grad():
        for k, params in enumerate(zero.fp16_groups):
            pieces_k = [(by_id[id(p)], p) for p in params]
            flat, state = _zero3_sub_group_pieces(zero, k, pieces_k, pieces, full if load_optimizer else None,
                                                  model_config, tp_rank, tp_size)
            _write_zero3_sub_group(zero, k, flat)
            if state is not None:
                states[k] = state
    if load_optimizer:
        _load_zero3_client_state(zero, states, full)


def _zero3_sub_group_pieces(zero, k: int, named: list[tuple[str, nn.Parameter]], pieces: dict[str, torch.Tensor],
                            full: Optional[FullState], model_config: ModelConfig, tp_rank: int,
                            tp_size: int) -> tuple[torch.Tensor, Optional[dict]]:
    """Sub-group k's flat FP32 master on this rank (its parameters' pieces end to end) and, with `full`, its Adam
    state in the same layout (None without)."""
    rank = zero._get_sub_group_partition_rank(k)
    master = zero.fp32_partitioned_groups_flat[k]
    weights, moments, step = [], {m: [] for m in MOMENTS}, None
    for name, p in named:
        numel = p.partition_numel()
        if p.numel() != 0:  # gathered: it would keep its old full value until DeepSpeed releases it
            raise RuntimeError(f"ZeRO-3 parameter {name} is gathered while the checkpoint loads; the loader "
                               "expects every parameter partitioned, as after deepspeed.initialize")
        weights.append(_zero3_slice(pieces[name], rank, numel))
        if full is not None:
            saved = _moment_pieces(name, full, model_config, tp_rank, tp_size)
            step = saved["step"]
            for m in MOMENTS:
                moments[m].append(_zero3_slice(saved[m], rank, numel))
    flat = torch.cat(weights)
    if flat.numel() != master.numel():
        raise ckpt.CheckpointError(f"ZeRO-3 sub-group {k} holds {master.numel()} master values on this "
                                   f"rank, its parameters' pieces {flat.numel()}: DeepSpeed's partitioning "
                                   "is not the one this loader knows (DeepSpeed 0.19)")
    if full is None or step is None:
        return flat, None
    return flat, {"step": step, **{m: torch.cat(v).to(master.device) for m, v in moments.items()}}


def _write_zero3_sub_group(zero, k: int, flat: torch.Tensor) -> None:
    """Sub-group k's flat pieces into its FP32 master and the module's partitions (`ds_tensor`)."""
    zero.fp32_partitioned_groups_flat[k].copy_(flat)
    zero.fp16_partitioned_groups_flat[k].copy_(flat)
    # DeepSpeed's loader re-points each ds_tensor at its flat buffer too (they are views already).
    partitions = zero.fp16_partitioned_groups[k]
    for partition, q in zip(partitions, zero.unflatten(zero.fp16_partitioned_groups_flat[k], partitions)):
        partition.data = q.data


def _load_zero3_client_state(zero, states: dict[int, dict], full: FullState) -> None:
    """The client optimizer's state on the sub-groups' flat masters (`states`: sub-group -> its Adam state)."""
    base = zero.optimizer
    flats = zero.fp32_partitioned_groups_flat
    with zero3_partitions_in_groups(zero):  # the groups hold the sub-groups' flat masters only around this
        sub_group = {id(flat): k for k, flat in enumerate(flats)}
        state, groups, index = {}, [], 0
        for group in base.param_groups:
            ids = []
            for flat in group["params"]:
                if sub_group[id(flat)] in states:
                    state[index] = states[sub_group[id(flat)]]
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        _load_state(base, state, groups, full)


def load_resharded(folder: Path, *, model: nn.Module, full_name: Callable[[str], Optional[str]],
                   model_config: ModelConfig, tp_rank: int, tp_size: int, optimizer: torch.optim.Optimizer,
                   zero_optimizer=None, load_optimizer: bool, module_only: bool,
                   fp8_name: Callable[[str], Optional[str]] = lambda n: n, describe: str = "",
                   weights: Optional[list[tuple[str, torch.Tensor]]] = None,
                   load_pieces: Optional[Callable[[dict, Optional[dict]], None]] = None) -> dict:
    """Load `folder` (any layout) into this rank's `model` and optimizer; returns the loop's dict (module docstring).

    `full_name(local parameter name)` is the full-model name (None: not a parameter of the checkpoint);
    `fp8_name(full layer name)` the FP8 layer name on this rank, or None for a layer another stage holds.
    `zero_optimizer` is DeepSpeed's ZeRO 1/2/3 optimizer when there is one (it owns master weights and moments).
    `weights` (local name, tensor) replaces the model's parameters as what is filled and what the optimizer's
    state is keyed by: the FP32 masters of `--params-dtype bf16` (MainParams), which the optimizer steps.
    `load_pieces(weights, optimizer state)` sets them where the engine does (FSDP2): this rank's tensor-parallel
    pieces by full name, and the optimizer's state dict in `optimizer.state_dict()`'s numbering (None: not loaded).
    """
    full = read_full_state(folder)
    named = [(full_name(n), p) for n, p in (weights if weights is not None else model.named_parameters())]
    pieces = _pieces(named, full, model_config, tp_rank, tp_size)
    restore_optimizer = load_optimizer and not module_only
    if restore_optimizer and full.optimizer is None:
        raise ckpt.CheckpointError(f"{folder} has no optimizer state this run can use ({full.optimizer_missing}); "
                                   "pass --no-load-optim (or --finetune) to load its weights only")
    by_id = {id(p): name for name, p in named}
    zero3 = hasattr(zero_optimizer, "fp32_partitioned_groups_flat")  # ZeRO-3 writes the partitions itself
    if load_pieces is not None:
        load_pieces(pieces, _plain_optimizer_state(optimizer, by_id, full, model_config, tp_rank, tp_size)
                    if restore_optimizer else None)
    elif zero3:
        _load_zero3_optimizer(zero_optimizer, named, pieces, full, model_config, tp_rank, tp_size, restore_optimizer)
    else:
        with torch.no_grad():
            for name, p in named:
                p.copy_(pieces[name])
        if zero_optimizer is not None:
            _load_zero_optimizer(zero_optimizer, by_id, full, model_config, tp_rank, tp_size, restore_optimizer)
        elif restore_optimizer:
            _load_plain_optimizer(optimizer, by_id, full, model_config, tp_rank, tp_size)
    saved = full.saved_parallel
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.warning("resharded %s (%s layout: tensor parallel %s, pipeline %s, data parallel %s) into this run's "
                       "layout%s; Fp8AdamW moments, if any, were requantized", folder, full.layout,
                       saved.get("tensor_model_parallel_size", "?"), saved.get("pipeline_model_parallel_size", "?"),
                       full.config.get("training", {}).get("data_parallel_size", "?"), f" ({describe})" if describe else "")
    return {"payload": _client_state(full, fp8_name), "train_state": full.train_state, "config": full.config,
            "path": folder}


def _client_state(full: FullState, fp8_name: Callable[[str], Optional[str]]) -> dict:
    """The loop's client state of a resharded checkpoint: its extras, the FP8 state under this rank's layer names."""
    payload = dict(full.extras)
    if full.fp8 is not None:
        layers = {}
        for name, entry in full.fp8.get("layers", {}).items():
            local = fp8_name(name)
            if local is not None:
                layers[local] = entry
        payload["fp8"] = {**full.fp8, "layers": layers}
    return payload


# ---------------------------------------------------------------------------------- DeepSpeed engines
def deepspeed_layout_matches(engine, saved: dict) -> bool:
    """Whether a DeepSpeed engine (`DeepSpeedBase`) can give `saved` to DeepSpeed's own loader: same engine layout,
    same number of model-parallel files and of ZeRO partitions."""
    p = engine.parallel
    if optimizer_switched(saved, engine.optimizer, True):
        return False
    zero_ranks = p.data_parallel_size if engine.zero_stage in (1, 2) else 0
    if p.pipeline_parallel_size > 1:
        return (saved["layout"] == layouts.PIPELINE and saved["mp_files"] == p.pipeline_parallel_size
                * p.tensor_parallel_size and saved["zero_ranks"] == zero_ranks)
    if engine.zero_stage == 3:
        return saved["layout"] is None or (saved["layout"] == layouts.DEEPSPEED_ZERO3
                                           and saved["zero_ranks"] == p.data_parallel_size)
    return (saved["layout"] == layouts.DEEPSPEED and saved["mp_files"] == p.tensor_parallel_size
            and saved["zero_ranks"] == zero_ranks)


def load_into_deepspeed(engine, folder: Path, *, load_optimizer: bool, module_only: bool) -> dict:
    """`load_resharded` for DeepSpeedEngine (ZeRO 0-3) and PipelineEngine (ZeRO 0-2)."""
    from megatron.checkpoint.full_state import full_to_pipeline_name, pipeline_to_full_name
    from megatron.fp8 import Fp8Linear

    p = engine.parallel
    model_config = engine.config.model
    num_layers = model_config.num_layers
    full_name: Callable[[str], Optional[str]] = lambda n: n
    fp8_name: Callable[[str], Optional[str]] = lambda n: n
    describe = f"DeepSpeed ZeRO {engine.zero_stage}, data parallel {p.data_parallel_size}"
    if p.pipeline_parallel_size > 1:
        local_fp8 = {name for name, m in engine.model.named_modules() if isinstance(m, Fp8Linear)}
        full_name = lambda n: pipeline_to_full_name(n, num_layers)  # noqa: E731
        fp8_name = lambda n: (lambda local: local if local in local_fp8 else None)(  # noqa: E731
            full_to_pipeline_name(n, num_layers))
        describe = f"pipeline stage {p.pipeline_parallel_rank} of {p.pipeline_parallel_size}, {describe}"
    zero = engine.engine.optimizer if engine.zero_stage in (1, 2, 3) else None
    loaded = load_resharded(folder, model=engine.model, full_name=full_name, model_config=model_config,
                            tp_rank=p.tensor_parallel_rank, tp_size=p.tensor_parallel_size, optimizer=engine.optimizer,
                            zero_optimizer=zero, load_optimizer=load_optimizer, module_only=module_only,
                            fp8_name=fp8_name, describe=describe)
    if not module_only:  # what DeepSpeed's own loader restores besides the weights and optimizer
        engine.engine.global_steps = int(loaded["train_state"].get("iteration", 0))
        engine.engine.global_samples = int(loaded["train_state"].get("consumed_train_samples", 0))
    return loaded
