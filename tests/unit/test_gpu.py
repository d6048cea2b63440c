"""GPU checks (CUDA with FP8 tensor cores, sm89+): skipped with the reason on machines without one.

They compare the `scaled_mm` backend (torch._scaled_mm) with the emulated one on the same device, and run a
tiny FP8 training step end to end on the GPU. Run them on a machine with a GPU: `pytest -m gpu`.
"""
import pytest
import torch

from megatron.fp8 import Fp8Linear, Fp8Recipe
from megatron.fp8.recipe import Fp8Backend
from megatron.fp8.stats import sqnr_db

HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")]


def _linear(backend: Fp8Backend, weight: torch.Tensor) -> Fp8Linear:
    layer = Fp8Linear(weight.shape[1], weight.shape[0], bias=False, recipe=Fp8Recipe(backend=backend), device="cuda")
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def test_scaled_mm_backend_matches_emulation_on_gpu():
    torch.manual_seed(0)
    weight = torch.randn(512, 256, device="cuda") * 0.02
    x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    outs = {}
    for backend in (Fp8Backend.SCALED_MM, Fp8Backend.EMULATED):
        layer = _linear(backend, weight)
        xi = x.detach().clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.float().pow(2).sum().backward()
        outs[backend] = (y.float(), xi.grad.float(), layer.weight.grad.float())
    for got, ref in zip(outs[Fp8Backend.SCALED_MM], outs[Fp8Backend.EMULATED]):
        assert sqnr_db(got, ref) > 35.0  # same FP8 inputs; only accumulation order and bf16 output differ


def test_adamw_on_gpu_parameters_is_the_fused_kernel():
    from megatron.arguments import parse_config
    from megatron.model import GPTModel
    from megatron.optimizer import build_optimizer
    from tests.support.config import tiny_argv

    cfg = parse_config(tiny_argv(weight_decay=0.1))
    opt = build_optimizer(GPTModel(cfg.model).cuda(), cfg.optimizer)
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]


def test_tiny_fp8_gpt_trains_on_gpu():
    from megatron.arguments import parse_config
    from megatron.training.loop import pretrain
    from tests.support.config import tiny_argv

    result = pretrain(parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", "--device", "cuda",
                                             "--fp8-backend", "scaled_mm", train_iters=30, eval_iters=0)))
    assert result.losses[-1] < result.losses[0] - 1.0


def _grads_of(per_call: bool, fused: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer = Fp8Linear(256, 512, bias=False, recipe=Fp8Recipe(backend=Fp8Backend.SCALED_MM), device="cuda")
    layer.fp8.configure(weight_per_call=per_call, fused_quantization=fused)
    x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).sum().backward()
    return [y.float(), x.grad, layer.weight.grad]


def test_per_call_and_fused_weights_are_bitwise_on_gpu():
    """ZeRO-3's per-call FP8 weight (requantized in backward) and the compiled (Triton) quantization give the
    scaled_mm backend the same FP8 operands as the cached eager path: equal outputs and gradients."""
    ref = _grads_of(False, False)
    for per_call, fused in ((True, False), (False, True), (True, True)):
        for got, want in zip(_grads_of(per_call, fused), ref):
            assert torch.equal(got, want), (per_call, fused)


def test_traced_fp8_layers_equal_eager_on_gpu():
    """The FP8 layers traced into a compiled graph (megatron/fp8/traced.py) on the GPU: Triton quantization and
    torch._scaled_mm in the graph give the eager layer's bits (with inductor's precision casts emulated), with a
    Smooth-SwiGLU column scale on the second layer and the per-step weight pre-hook on the first."""
    from tests.support.fp8_traced import assert_traced_equals_eager

    assert_traced_equals_eager(Fp8Recipe(backend=Fp8Backend.SCALED_MM), True, True, True, "cuda")
    assert_traced_equals_eager(Fp8Recipe(backend=Fp8Backend.SCALED_MM, scaling="tensorwise"), False, True, True,
                               "cuda")


def test_fp8_layer_and_optimizer_steps_do_not_synchronise_on_gpu():
    """Under `torch.cuda.set_sync_debug_mode("error")` every host-device synchronisation raises: an FP8 layer's
    forward and backward (power-of-two scales, eager and fused), Fp8AdamW's step with stochastic rounding and the
    delayed-scaling update queue their kernels without waiting for the device (tests/unit/test_host_sync.py counts
    the host-to-device copies on CPU)."""
    from megatron.fp8 import fp8_optimizer_step, set_fused_quantization
    from megatron.optimizer.fp8_adam import Fp8AdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(Fp8Linear(256, 512, bias=False, recipe=Fp8Recipe(power_of_two_scales=True),
                                          device="cuda"),
                                Fp8Linear(512, 256, bias=False, recipe=Fp8Recipe(), device="cuda"))
    set_fused_quantization(model[1], True)
    opt = Fp8AdamW(model.parameters(), lr=1e-3, compile=False)
    x = torch.randn(64, 256, device="cuda")
    for step in range(3):  # the first step makes state and caches; the later ones must not synchronise
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            fp8_optimizer_step(model)
        finally:
            torch.cuda.set_sync_debug_mode("default")
