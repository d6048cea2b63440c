"""`--use-torch-fsdp2` in one process: what it refuses with one line, and the optimizer state's renumbering between
torch.distributed.checkpoint's names and the torch engine's numbers (tests/e2e/test_fsdp2_launch.py trains)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.training.fsdp2 import _named, _numbered
from tests.support.config import tiny_argv

REFUSED = {
    "deepspeed": (["--deepspeed"], 1, "--use-torch-fsdp2 and --deepspeed are two engines"),
    "pipeline": (["--pipeline-model-parallel-size", "2"], 2, "with --pipeline-model-parallel-size > 1"),
    "main-params": (["--bf16", "--params-dtype", "bf16"], 1, "with --params-dtype bf16"),
}


@pytest.mark.parametrize("argv,world,message", list(REFUSED.values()), ids=list(REFUSED))
def test_what_fsdp2_does_not_combine_with_is_refused_in_one_line(argv, world, message):
    with pytest.raises(ValueError, match="^[^\n]*$") as error:
        parse_config(tiny_argv("--use-torch-fsdp2", *argv), world_size=world)
    assert message in str(error.value)


def test_blocks_are_compiled_under_fsdp2_by_default_on_cuda():
    """What ZeRO-3 cannot do: `--torch-compile auto` compiles the blocks (FP8 layers traced in) on CUDA, and `on`
    is accepted everywhere (tests/e2e/test_fsdp2_launch.py runs it)."""
    from megatron.model.compile import plan_torch_compile

    assert plan_torch_compile(parse_config(tiny_argv("--use-torch-fsdp2"), world_size=2), "cuda").blocks
    assert parse_config(tiny_argv("--use-torch-fsdp2", "--torch-compile", "on"), world_size=2).parallel.use_torch_fsdp2


@pytest.mark.parametrize("flag", ["--grad-reduce-in-bf16", "--no-fsdp-reshard-after-forward"])
def test_fsdp2s_own_flags_need_it(flag):
    with pytest.raises(ValueError, match=f"{flag} applies to --use-torch-fsdp2 only"):
        parse_config(tiny_argv(flag))


def test_the_optimizer_state_is_numbered_as_the_torch_engine_numbers_it_and_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    numbered = optimizer.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {  # what torch.distributed.checkpoint's full optimizer state dict holds: the same, keyed by name
        "state": {names[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"]},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                          "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups],
    }
    got = _numbered(by_name)
    assert got["param_groups"] == numbered["param_groups"]
    assert got["state"].keys() == numbered["state"].keys()
    for i, state in numbered["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in state.items())
    back = _named(got, optimizer, model)
    assert back["param_groups"] == by_name["param_groups"] and back["state"].keys() == by_name["state"].keys()


def test_the_performance_model_shards_all_three_and_counts_fsdp2s_collectives():
    """The dry run's memory estimate divides weights, gradients and moments by the data-parallel size, and the
    step's collectives are FSDP2's: weights gathered in BF16 per micro-batch for forward and backward (once with
    --no-fsdp-reshard-after-forward), gradients reduce-scattered once per step in FP32 (BF16 on request)."""
    from megatron.perf.comm import step_collectives
    from megatron.perf.flops import count_parameters, memory_estimate_bytes

    argv = tiny_argv("--use-torch-fsdp2", "--bf16", micro_batch_size=2, global_batch_size=16)
    config = parse_config(argv, world_size=4)  # data parallel 4, 2 micro-batches per step
    params, dp = count_parameters(config.model), 4
    mem = memory_estimate_bytes(config)
    for key, per_param in (("weights_GiB", 4.0), ("grads_GiB", 4.0), ("optimizer_GiB", 8.0), ("master_GiB", 0.0)):
        assert mem[key] * 2.0**30 == pytest.approx(params * per_param / dp), key
    by_name = {c.name: c for c in step_collectives(config, devices_per_node=8)}
    gather, regather = by_name["FSDP2 weight all-gather (forward)"], by_name["FSDP2 weight all-gather (backward)"]
    assert gather.bytes == regather.bytes == 2.0 * params and gather.count == regather.count == 2
    assert by_name["FSDP2 gradient reduce-scatter"].bytes == 4.0 * params
    assert by_name["FSDP2 gradient reduce-scatter"].count == 1
    kept = parse_config(argv + ["--no-fsdp-reshard-after-forward", "--grad-reduce-in-bf16"], world_size=4)
    names = {c.name: c for c in step_collectives(kept, devices_per_node=8)}
    assert "FSDP2 weight all-gather (backward)" not in names
    assert names["FSDP2 gradient reduce-scatter"].bytes == 2.0 * params


def test_sharded_checkpoints_need_fsdp2():
    with pytest.raises(ValueError, match="^--ckpt-format torch_dist .* --use-torch-fsdp2 only"):
        parse_config(tiny_argv("--ckpt-format", "torch_dist"))
    assert parse_config(tiny_argv("--use-torch-fsdp2", "--ckpt-format", "torch_dist"),
                        world_size=2).checkpoint.ckpt_format == "torch_dist"
