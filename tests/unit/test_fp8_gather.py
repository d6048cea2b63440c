"""`--fp8-param-gather` in one process (a one-rank gloo group): FSDP2 hands each FP8 linear the FP8 weight cast on
its shard, which the layer uses as it is; outputs and gradients equal the high-precision gather's bitwise; the
scales cost one all-reduce per step only where a current scale is needed; a shard is padded to FSDP2's shard size;
checkpoints hold plain tensors. tests/e2e/test_fsdp2_fp8_gather.py gathers over 2 ranks."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from megatron import comm
from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear, fp8_optimizer_step
from megatron.fp8.gathered import Fp8GatheredWeight
from megatron.fp8.recipe import Fp8Recipe, Fp8Scaling
from megatron.fp8.scaling import Fp8Role
from megatron.training.fp8_gather import Fp8ShardWeight, GatherScales, GatherSlot, eligible_layers, wrap_weights
from tests.support.config import tiny_argv
from tests.support.processes import one_rank_world

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv(comm.FORCE_ENV, "1")  # megatron.comm runs its collectives at world size 1 too
    with one_rank_world() as world:
        yield world


def _model(scaling: Fp8Scaling, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    recipe = Fp8Recipe(scaling=scaling)
    return nn.Sequential(Fp8Linear(32, 48, bias=False, recipe=recipe), nn.ReLU(),
                         Fp8Linear(48, 16, bias=False, recipe=recipe))


def _shard(model: nn.Module, group, fp8_gather: bool) -> GatherScales | None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from megatron.training.deepspeed_fp8 import fp8_weights_per_call

    fp8_weights_per_call(model)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if fp8_gather:
        wrap_weights(layers)
    mesh = DeviceMesh.from_group(group, "cpu")
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    return GatherScales(model, layers, group, torch.bfloat16) if fp8_gather else None


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    y = model(x)
    y.float().square().sum().backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.01)
            p.grad = None
    fp8_optimizer_step(model)
    return y.detach(), grads


@pytest.mark.parametrize("scaling", [Fp8Scaling.DELAYED, Fp8Scaling.TENSORWISE])
def test_outputs_and_gradients_equal_the_high_precision_gathers_bitwise(one_rank, scaling):
    gathered, plain = _model(scaling), _model(scaling)
    scales = _shard(gathered, one_rank, True)
    _shard(plain, one_rank, False)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    for step in range(3):
        (y_g, grads_g), (y_p, grads_p) = _step(gathered, x), _step(plain, x)
        assert torch.equal(y_g, y_p), step
        assert all(torch.equal(a, b) for a, b in zip(grads_g, grads_p)), step
    slots = [m.weight.to_local()._slot for m in gathered if isinstance(m, Fp8Linear)]
    assert all(slot.gathers >= 3 for slot in slots)  # forward and backward each step (resharded after forward)
    # Delayed: one all-reduce while the history has no valid scale (the first step), none after. Tensorwise: one per
    # step, for every layer together.
    assert scales.collectives == (1 if scaling is Fp8Scaling.DELAYED else 3)


def test_the_layer_receives_the_fp8_weight_cast_with_the_whole_weights_scale(one_rank):
    model = _model(Fp8Scaling.TENSORWISE)
    layer = model[0]
    full = layer.weight.detach().clone()
    _shard(model, one_rank, True)
    seen = {}
    layer.register_forward_pre_hook(lambda module, args: seen.setdefault("weight", module.weight))
    model(torch.randn(4, 32).bfloat16())
    weight = seen["weight"]
    assert isinstance(weight, Fp8GatheredWeight) and weight.dtype == torch.bfloat16
    state = layer.fp8
    backend = state.backend(full.device)
    spec = state.specs(backend)[Fp8Role.WEIGHT]
    hp = full.bfloat16()  # the high-precision gather's weight, cast as the per-call path casts it
    scale = state.own_amax_scale(Fp8Role.WEIGHT, hp.abs().amax().float(), spec)
    assert torch.equal(weight._scale, scale)
    assert torch.equal(weight._data.view(torch.uint8), backend.quantize(hp, scale, spec).view(torch.uint8))
    # Any other op sees the dequantized weight (a layer the FP8 controller put in high precision).
    assert torch.equal(weight + 0, (weight._data.float() / scale).bfloat16())


def test_scales_are_made_once_per_optimizer_step(one_rank):
    model = _model(Fp8Scaling.TENSORWISE)
    scales = _shard(model, one_rank, True)
    x = torch.randn(4, 32).bfloat16()
    model(x)
    model(x)  # a second micro-batch of the step: the weights did not change
    assert scales.collectives == 1
    _step(model, x)
    model(x)
    assert scales.collectives == 2


@pytest.mark.isa_sensitive  # compiled graphs, compared bit for bit: CI reruns it with AVX2 kernels
def test_a_compiled_block_takes_the_gathered_fp8_weight_as_it_is(one_rank):
    """`--torch-compile` with `--fp8-param-gather`: the compiled graph multiplies the FP8 bytes FSDP2 gathered (the
    block's pre-hook hands them over, no cast in the graph), so outputs and gradients equal those of the same block
    compiled with high-precision gathers (which casts W in the graph) bit for bit. A cast of the gathered weight
    again, with its own amax, would round twice."""
    from megatron.fp8 import set_fused_quantization
    from megatron.model.compile import compile_block

    # The block compiled inside the FSDP2 root, as compile_blocks compiles the transformer blocks: the root's
    # pre-hooks (FSDP2's gather, the gather scales) run eagerly before it.
    gathered, plain = nn.Sequential(_model(Fp8Scaling.DELAYED)), nn.Sequential(_model(Fp8Scaling.DELAYED))
    _shard(gathered, one_rank, True)
    _shard(plain, one_rank, False)
    for model in (gathered, plain):
        set_fused_quantization(model, True)
        compile_block(model[0])
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    for step in range(3):
        (y_g, grads_g), (y_p, grads_p) = _step(gathered, x), _step(plain, x)
        assert torch.equal(y_g, y_p), step
        assert all(torch.equal(a, b) for a, b in zip(grads_g, grads_p)), step
    layers = [m for m in gathered.modules() if isinstance(m, Fp8Linear)]
    assert all(m.weight.to_local()._slot.gathers >= 3 for m in layers)
    assert all(m.fp8.weight_quantizations == 0 for m in layers)  # never cast again after the gather


def test_fp8_adam_steps_the_plain_tensor_inside_a_gathered_shard(one_rank):
    """Fp8AdamW updates the high-precision storage of an FP8-gathered shard, as a plain tensor: a compiled update
    traced the subclass and guarded on its metadata (the layer's scaling state, which holds a process group), which
    failed and fell back to eager."""
    from megatron.optimizer.fp8_adam_shards import local

    model = _model(Fp8Scaling.DELAYED)
    _shard(model, one_rank, True)
    for layer in (m for m in model.modules() if isinstance(m, Fp8Linear)):
        shard = layer.weight._local_tensor
        assert isinstance(shard, Fp8ShardWeight)
        assert type(local(layer.weight)) is torch.Tensor and local(layer.weight) is shard.plain


def test_an_uneven_shard_is_padded_to_fsdp2s_shard_size():
    """3 rows over 2 ranks: FSDP2 gathers ceil(3 / 2) = 2 rows from each, the last rank's padded with zeros."""
    layer = Fp8Linear(4, 3, bias=False, recipe=Fp8Recipe(scaling=Fp8Scaling.TENSORWISE))
    slot = GatherSlot(layer.fp8, scale=torch.tensor(2.0), amax=torch.tensor(1.0))
    shard = Fp8ShardWeight(layer.weight.detach()[2:].clone(), slot)  # the second rank's one row
    mesh = types.SimpleNamespace(size=lambda: 2)
    policy = types.SimpleNamespace(param_dtype=None)
    (data,), (scale, amax, dtype) = shard.fsdp_pre_all_gather(mesh, torch.Size([3, 4]), (4, 1), layer, policy)
    assert data.dtype == torch.uint8 and data.shape == (2, 4) and not data[1].any()
    assert dtype == torch.float8_e4m3fn and scale is slot.scale and slot.gathers == 1


def test_a_checkpoint_holds_plain_tensors(one_rank):
    from megatron.training.fsdp2 import full_model_state

    model = _model(Fp8Scaling.DELAYED)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    _shard(model, one_rank, True)
    state = full_model_state(model)
    assert all(type(v) is torch.Tensor for v in state.values()), {k: type(v) for k, v in state.items()}
    assert all(torch.equal(state[k], want[k]) for k in want)


def test_smooth_swiglus_column_scaled_fc2_gathers_in_high_precision():
    from megatron.fp8 import convert_to_fp8
    from megatron.model.build import build_model

    config = parse_config(tiny_argv("--fp8-format", "hybrid", "--smooth-swiglu"))
    model = build_model(config.model, "cpu", 0)
    convert_to_fp8(model, config.fp8)
    names = {id(m): n for n, m in model.named_modules()}
    chosen = [names[id(m)] for m in eligible_layers(model)]
    assert chosen and not any(n.endswith("linear_fc2") for n in chosen)
    assert any(n.endswith("linear_fc1") for n in chosen)


REFUSED = {
    "without-fsdp2": (["--fp8-format", "hybrid", "--fp8-param-gather"], "applies to --use-torch-fsdp2 only"),
    "without-fp8": (["--use-torch-fsdp2", "--fp8-param-gather"], "add --fp8-format hybrid"),
    "tile-recipe": (["--use-torch-fsdp2", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--fp8-param-gather"],
                    "is not built for the tile recipes"),
}


@pytest.mark.parametrize("argv,message", list(REFUSED.values()), ids=list(REFUSED))
def test_what_fp8_param_gather_cannot_do_is_refused_in_one_line(argv, message):
    with pytest.raises(ValueError, match="^[^\n]*$") as error:
        parse_config(tiny_argv(*argv), world_size=2)
    assert message in str(error.value)


def test_the_weights_statistics_are_recorded_on_the_shard(one_rank):
    from megatron.fp8 import collect_fp8_stats, enable_fp8_stats

    model = _model(Fp8Scaling.TENSORWISE)
    enable_fp8_stats(model)
    _shard(model, one_rank, True)
    shards = [m.weight.to_local()._tensor for m in model if isinstance(m, Fp8Linear)]
    model(torch.randn(4, 32).bfloat16())
    stats = collect_fp8_stats(model)
    for name, shard in zip(("0", "2"), shards):
        assert stats[f"fp8/{name}/weight/amax"] == float(shard.bfloat16().abs().max())
        assert stats[f"fp8/{name}/weight/clipped_frac"] == 0.0
