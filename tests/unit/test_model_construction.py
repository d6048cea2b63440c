"""Building the model without materializing it whole: layout-independent initial values, per-rank memory.

- Per-tensor initialization (megatron/model/init.py): a TP shard or a pipeline stage built on meta and then
  materialized equals, bitwise, the slice or the layers of the TP=1/PP=1 model; the distributions are
  Megatron's; the RoPE buffers are those of a CPU-built model.
- Memory: no tensor produced during construction (recorded by a TorchDispatchMode) is larger than the rank's
  largest parameter piece; the recorder's negative control is the old path (build whole, then cut). The ~1B
  model's construction in 2 processes is in tests/e2e/test_model_construction_launch.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.arguments import parse_config
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.build import PipelineStage, build_model
from megatron.model.init import InitKind, Piece, fill_initial_values_, init_rule
from megatron.model.transformer import output_layer_std
from megatron.parallel.layout import TP_SHARD_DIM, ShardSpec, shard_indices, shard_spec, shard_tensor
from megatron.parallel_state import ParallelState
from tests.support.config import tiny_argv
from tests.support.model_construction import SEED, LargestTensor, largest_parameter as _largest_parameter

ROPE, UNTIED, SWIGLU, NO_BIAS = ("--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
                                 "--swiglu", "--disable-bias-linear")


def _config(tp: int = 1, *switches: str, drop: tuple[str, ...] = (), **overrides) -> ModelConfig:
    """The tiny test model (tests/conftest.py) at tensor-parallel size `tp`, without the switches in `drop`."""
    argv = [a for a in tiny_argv(*switches, tensor_model_parallel_size=tp, **overrides) if a not in drop]
    return parse_config(argv, world_size=tp).model


# ----------------------------------------------------------------------------------- values and layouts
def test_initial_values_follow_megatrons_distributions():
    cfg = _config(1, drop=(ROPE, NO_BIAS), normalization="LayerNorm", hidden_size=128, ffn_hidden_size=512)
    model = GPTModel(cfg, seed=SEED)
    assert model.embedding.position_embeddings is not None and model.decoder.layers[0].mlp.linear_fc1.bias is not None
    for name, p in model.named_parameters():
        rule = init_rule(name, cfg)
        if rule.kind is InitKind.ONES:
            assert torch.equal(p, torch.ones_like(p)), name
        elif rule.kind is InitKind.ZEROS:
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            residual = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
            assert rule.std == (output_layer_std(cfg) if residual else cfg.init_method_std), name
            # Sample mean and std of n normal draws: within 5 of their standard errors (std / sqrt(n),
            # std / sqrt(2n)) of the distribution's.
            n = p.numel()
            assert abs(p.mean().item()) < 5 * rule.std / math.sqrt(n), name
            assert abs(p.std().item() / rule.std - 1) < 5 / math.sqrt(2 * n), name
            assert torch.unique(p.detach(), dim=0).shape[0] == p.shape[0], name  # every row its own draw


@pytest.mark.parametrize("tp, sequence_parallel, drop, overrides", [
    (2, False, (), {}),  # SwiGLU ([gate_r | up_r] pieces), RoPE, GQA, untied head
    (2, True, (ROPE, UNTIED), {"normalization": "LayerNorm"}),  # learned positions, tied embedding
    (4, False, (), {"num_key_value_heads": 4}),
    (2, False, (SWIGLU,), {"ffn_hidden_size": 256}),  # GeLU: fc1 is one block
])
def test_tensor_parallel_pieces_are_slices_of_the_tp1_model(tp, sequence_parallel, drop, overrides):
    cfg = _config(tp, drop=drop, **overrides)
    full = GPTModel(cfg, seed=SEED).state_dict()
    for rank in range(tp):
        parallel = ParallelState(tensor_parallel_size=tp, tensor_parallel_rank=rank)
        model = build_model(cfg, "cpu", SEED, parallel, sequence_parallel)
        pieces = model.state_dict()
        assert pieces.keys() == full.keys()
        for name, piece in pieces.items():
            spec = shard_spec(name, cfg)
            expected = full[name] if spec is None else shard_tensor(full[name], spec, rank, tp)
            assert torch.equal(piece, expected), (rank, name)
        sharded = {n for n, p in model.named_parameters() if hasattr(p, TP_SHARD_DIM)}
        assert sharded == {n for n in full if shard_spec(n, cfg) is not None}


def test_vocabulary_padding_only_appends_rows():
    small, large = _config(1), _config(1, make_vocab_size_divisible_by=256)
    assert (small.padded_vocab_size, large.padded_vocab_size) == (128, 256)
    a, b = GPTModel(small, seed=SEED).state_dict(), GPTModel(large, seed=SEED).state_dict()
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(b[name][:128], a[name])
    assert all(torch.equal(a[n], b[n]) for n in a if "word_embeddings" not in n and "output_layer" not in n)


@pytest.mark.parametrize("num_layers, stages", [(2, 2), (5, 2), (4, 4)])
def test_pipeline_stages_hold_the_pp1_layers(num_layers, stages):
    pytest.importorskip("deepspeed")
    from megatron.training.pipeline_engine import pipeline_stage

    cfg = _config(1, num_layers=num_layers)
    full = GPTModel(cfg, seed=SEED).state_dict()
    held = []
    for stage_rank in range(stages):
        stage = pipeline_stage(num_layers, ParallelState(pipeline_parallel_size=stages,
                                                         pipeline_parallel_rank=stage_rank))
        model = build_model(cfg, "cpu", SEED, stage=stage)
        for name, tensor in model.state_dict().items():
            assert tensor.is_meta != stage.holds(name), name
            if not tensor.is_meta:
                assert torch.equal(tensor, full[name]), (stage_rank, name)
        assert model.rotary.cos.device.type == "cpu"
        held += list(stage.layers)
        assert stage.embedding == (stage_rank == 0) and stage.head == (stage_rank == stages - 1)
    assert held == list(range(num_layers))  # every layer on exactly one stage, in order


def test_tensor_and_pipeline_parallel_together():
    cfg = _config(2, num_layers=4)
    full = GPTModel(cfg, seed=SEED).state_dict()
    stage = PipelineStage(layers=range(2, 4), embedding=False, head=True)
    model = build_model(cfg, "cpu", SEED, ParallelState(tensor_parallel_size=2, tensor_parallel_rank=1), stage=stage)
    real = {n: t for n, t in model.state_dict().items() if not t.is_meta}
    assert real and all(stage.holds(n) for n in real)
    for name, tensor in real.items():
        spec = shard_spec(name, cfg)
        assert torch.equal(tensor, full[name] if spec is None else shard_tensor(full[name], spec, 1, 2)), name


def test_gpt_model_built_directly_is_the_trainers_model():
    cfg = _config(1)
    torch.manual_seed(SEED)
    direct = GPTModel(cfg)
    after_build = torch.rand(4)
    torch.manual_seed(SEED)
    assert torch.equal(torch.rand(4), after_build)  # construction drew no global random numbers
    built = build_model(cfg, "cpu", SEED).state_dict()
    assert all(torch.equal(t, built[n]) for n, t in direct.state_dict().items())
    other = GPTModel(cfg, seed=SEED + 1).state_dict()
    normal = [n for n in built if init_rule(n, cfg).kind is InitKind.NORMAL]
    assert normal and not any(torch.equal(built[n], other[n]) for n in normal)  # the seed matters
    layers = [built[f"decoder.layers.{i}.mlp.linear_fc1.weight"] for i in range(2)]
    assert not torch.equal(*layers)  # so does the name


def test_rotary_tables_are_those_of_a_cpu_build():
    cfg = _config(1)
    half = torch.arange(0, cfg.kv_channels, 2, dtype=torch.float64) / cfg.kv_channels
    angles = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), 1.0 / cfg.rotary_base**half)
    for model in (GPTModel(cfg, seed=SEED), build_model(cfg, "cpu", SEED)):
        assert torch.equal(model.rotary.cos, angles.cos().float())
        assert torch.equal(model.rotary.sin, angles.sin().float())


def test_host_blocks_and_pieces_give_the_same_values():
    """Rows go straight into an FP32 CPU parameter; columns, other dtypes (or devices) and pieces cut across
    lines go through host blocks: always the same values."""
    cfg = _config(2)
    fc1, fc2 = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"
    for name, shape in ((fc1, (256, 64)), (fc2, (64, 128))):
        direct = fill_initial_values_(torch.empty(shape), name, cfg, SEED)
        assert torch.equal(fill_initial_values_(torch.empty(shape, dtype=torch.float64), name, cfg, SEED),
                           direct.double())
        for dim in (0, 1):  # dim 0 of fc1 and dim 1 of fc2 are lines; the others cut across them
            spec = ShardSpec(dim)
            piece = Piece(torch.Size(shape), dim, shard_indices(shape[dim], spec, 1, 2))
            expected = shard_tensor(direct, spec, 1, 2)
            for dtype in (torch.float32, torch.float64):
                got = fill_initial_values_(torch.empty(expected.shape, dtype=dtype), name, cfg, SEED, piece)
                assert torch.equal(got, expected.to(dtype)), (name, dim, dtype)


def test_unknown_parameters_have_no_silent_initialization():
    with pytest.raises(ValueError, match="no initialization rule"):
        init_rule("decoder.layers.0.mlp.new_gate.weight", _config(1))


def test_construction_allocates_no_tensor_larger_than_a_piece():
    cfg = _config(2)
    parallel = ParallelState(tensor_parallel_size=2, tensor_parallel_rank=0)
    with LargestTensor() as new:
        model = build_model(cfg, "cpu", SEED, parallel)
    assert 0 < new.largest <= _largest_parameter(model), new.op
    # Negative control, the old path: the whole model first, then cut.
    from megatron.parallel import parallelize_tensor

    with LargestTensor() as old:
        parallelize_tensor(GPTModel(cfg, seed=SEED), parallel)
    assert old.largest == 2 * _largest_parameter(model)  # the full embedding (or fc1)
