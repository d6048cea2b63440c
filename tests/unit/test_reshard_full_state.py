"""Resharding's reader (`megatron.checkpoint.full_state.read_full_state`) against a state known in advance.

tests/e2e/test_reshard.py compares a resharded checkpoint with its source, both read by this reader: a reader that
merges the TP pieces of a tensor wrongly reads the source wrongly, hands that to the loading run, which saves it
and reads it back the same way, and the comparison agrees. Here the full state is made first, cut into the files
of a TP = 2 checkpoint by hand (the slicing below follows the layout table of megatron/parallel/layout.py and does
not use its functions), and the reader must give the full state back bit for bit: TP 2 -> 1 without a launch.
"""
from __future__ import annotations

import json

import torch

from megatron.arguments import parse_config
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.full_state import read_full_state
from megatron.model import GPTModel
from tests.support.config import tiny_argv

TP = 2
STEP = 2.0


def _tp_piece(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """TP rank `rank`'s piece of `full`: contiguous rows (vocabulary, QKV), contiguous columns (the row-parallel
    projections), or for linear_fc1 ([gate | up]) the rank's rows of each half, [gate_r | up_r]."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        rows = full.shape[0] // TP
        return full[rank * rows:(rank + 1) * rows].clone()
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        half = full.shape[0] // 2
        rows = half // TP
        return torch.cat([full[rank * rows:(rank + 1) * rows], full[half + rank * rows:half + (rank + 1) * rows]])
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        cols = full.shape[1] // TP
        return full[:, rank * cols:(rank + 1) * cols].clone()
    return full.clone()  # replicated: norms


def _exact_e4m3(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """Values of the form +-(1 + m/8) x 2^e, e in [-6, 0]: exact in E4M3 (and in E4M3 scaled by a power of two)."""
    mantissa = 1 + torch.randint(0, 8, shape, generator=g) / 8
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return sign * mantissa * 2.0 ** torch.randint(-6, 1, shape, generator=g)


def _powers_of_two(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """2^e, e in [-10, 0]: exact in E5M2."""
    return 2.0 ** torch.randint(-10, 1, shape, generator=g).float()


def _fp8_moment(piece: torch.Tensor, dtype: torch.dtype, scale_inv: float) -> dict:
    """A moment as Fp8AdamW saves it with one block per tensor: FP8 codes (flat) and the block's inverse scale."""
    codes = (piece.reshape(-1) / scale_inv).to(dtype)
    assert torch.equal(codes.float() * scale_inv, piece.reshape(-1))  # exactly representable: no rounding here
    return {"codes": codes, "scale_inv": torch.tensor([scale_inv])}


def test_tensor_parallel_checkpoint_reads_back_as_the_full_state_it_was_cut_from(tmp_path):
    """Weights and Fp8AdamW moments (FP8 codes with a different scale on each TP rank for matrices, FP32 for
    vectors) of a TP = 2 checkpoint written by hand: the reader returns the full tensors they were cut from. A
    merge that ignores linear_fc1's [gate | up] halves, swaps the ranks, joins along the wrong dimension, or
    assigns moments to the wrong parameters fails here, whatever it does to a checkpoint it wrote itself."""
    config = parse_config(tiny_argv("--tensor-model-parallel-size", str(TP)), world_size=TP, env={})
    assert config.model.swiglu  # linear_fc1 holds [gate | up]
    g = torch.Generator().manual_seed(0)
    model = {name: torch.randn(t.shape, generator=g) for name, t in GPTModel(config.model, seed=0).state_dict().items()}
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(model)
    names = list(model)
    # Fp8AdamW's (and AdamW's) parameter order: matrices (weight decay), then vectors, each in model order.
    order = [n for n in names if model[n].ndim >= 2] + [n for n in names if model[n].ndim < 2]
    exp_avg = {n: _exact_e4m3(model[n].shape, g) for n in names}
    exp_avg_sq = {n: _powers_of_two(model[n].shape, g) for n in names}

    folder = ckpt.iteration_dir(tmp_path, 2)
    for rank in range(TP):
        state = {}
        for index, name in enumerate(order):
            m, v = _tp_piece(name, exp_avg[name], rank), _tp_piece(name, exp_avg_sq[name], rank)
            saved = {"step": torch.tensor(STEP)}
            if model[name].ndim >= 2:
                scale_inv = 2.0 ** -(rank + 1)  # each rank's piece has its own scale
                for key, piece, dtype in (("exp_avg", m, torch.float8_e4m3fn), ("exp_avg_sq", v, torch.float8_e5m2)):
                    q = _fp8_moment(piece, dtype, scale_inv)
                    saved[key], saved[key + "_scale_inv"] = q["codes"], q["scale_inv"]
            else:
                saved["exp_avg"], saved["exp_avg_sq"] = m, v
            state[index] = saved
        matrices = sum(model[n].ndim >= 2 for n in names)
        optimizer = {"state": state, "param_groups": [
            {"weight_decay": 0.1, "lr": 1e-3, "params": list(range(matrices))},
            {"weight_decay": 0.0, "lr": 1e-3, "params": list(range(matrices, len(order)))}]}
        payload = {"model": {n: _tp_piece(n, t, rank) for n, t in model.items()}, "optimizer": optimizer,
                   "lr_scheduler": {"num_steps": 16}, "checkpoint_version": 1, "iteration": 2}
        file = ckpt.model_file(folder, rank)
        file.parent.mkdir(parents=True)
        torch.save(payload, file)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    (folder / "train_state.json").write_text(json.dumps({"iteration": 2, "consumed_train_samples": 16}))

    full = read_full_state(folder)
    assert full.layout == "tensor_parallel"
    assert full.model.keys() == model.keys()
    for name, tensor in model.items():
        assert torch.equal(full.model[name], tensor), name
    assert full.optimizer["params"].keys() == model.keys()
    for name in names:
        got = full.optimizer["params"][name]
        assert got["step"] == STEP, name
        assert torch.equal(got["exp_avg"], exp_avg[name]), (name, "exp_avg")
        assert torch.equal(got["exp_avg_sq"], exp_avg_sq[name]), (name, "exp_avg_sq")
    assert [g["weight_decay"] for g in full.optimizer["groups"]] == [0.1, 0.0]
    assert full.extras["lr_scheduler"] == {"num_steps": 16} and full.train_state["iteration"] == 2
