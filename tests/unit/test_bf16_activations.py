"""Under `--bf16` (autocast, FP32 parameters) the norms hand BF16 to the next GEMM: the residual stream stays
FP32, qkv and fc1 receive 2-byte inputs (an FP8 linear quantizes BF16, its dgrad writes BF16), and a BF16 GEMM
computes exactly what it computed when autocast did the cast."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear
from megatron.model.layers import LayerNorm, RMSNorm, activation_dtype
from megatron.training.loop import Trainer
from tests.support.config import tiny_argv


@pytest.mark.parametrize("norm", [RMSNorm(16), LayerNorm(16)], ids=["rmsnorm", "layernorm"])
def test_norm_output_is_the_fp32_norm_rounded_once_to_bf16_under_autocast(norm):
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 5, 16) * 7
    plain = norm(x)
    assert plain.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = norm(x)
        if isinstance(norm, RMSNorm):  # any input dtype (nn.LayerNorm wants its weight's)
            assert norm(x.bfloat16()).dtype == torch.bfloat16 and norm(x.double()).dtype == torch.float64
    assert autocast.dtype == torch.bfloat16 and torch.equal(autocast, plain.to(torch.bfloat16))
    # The BF16 GEMM that follows is the one autocast would have run on the FP32 norm output.
    w = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(torch.nn.functional.linear(autocast, w), torch.nn.functional.linear(plain, w))


def test_activation_dtype_only_narrows_fp32_under_autocast():
    x = torch.zeros(2)
    assert activation_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert activation_dtype(x) == torch.bfloat16
        assert activation_dtype(x.double()) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert activation_dtype(x) == torch.float32


def test_fp8_qkv_and_fc1_receive_bf16_and_their_dgrad_is_bf16_under_bf16():
    """A training iteration of the tiny FP8 model under --bf16: every qkv and fc1 Fp8Linear gets a BF16 input and
    returns a BF16 dx; the residual stream (the blocks' inputs) stays FP32."""
    trainer = Trainer(parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", train_iters=1, eval_iters=0,
                                             lr_warmup_iters=0)))
    seen: dict[str, list] = {}

    def record(name):
        def hook(module, args, kwargs=None):
            seen.setdefault(name, []).append(args[0].dtype)
        return hook

    def record_dx(name):
        def hook(module, grad_input, grad_output):
            seen.setdefault(f"{name} dx", []).append(grad_input[0].dtype)
        return hook

    layers = {n: m for n, m in trainer.model.named_modules() if isinstance(m, Fp8Linear)}
    targets = {n: m for n, m in layers.items() if n.endswith(("linear_qkv", "linear_fc1"))}
    assert len(targets) == 2 * 2  # two blocks
    for name, module in targets.items():
        module.register_forward_pre_hook(record(name))
        module.register_full_backward_hook(record_dx(name))
    blocks = [m for n, m in trainer.model.named_modules() if type(m).__name__ == "TransformerLayer"]
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(record(f"block {i}"))
    trainer.train()
    for name in targets:
        assert set(seen[name]) == {torch.bfloat16}, (name, seen[name])
        assert set(seen[f"{name} dx"]) == {torch.bfloat16}, (name, seen[f"{name} dx"])
    assert blocks and all(set(seen[f"block {i}"]) == {torch.float32} for i in range(len(blocks)))
