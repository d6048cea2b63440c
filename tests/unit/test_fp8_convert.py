"""convert_to_fp8: which linears are swapped, what stays high precision, printing, training end to end."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.fp8 import Fp8Linear, Fp8Recipe, convert_to_fp8, fp8_optimizer_step
from tests.support.fp8_reference import TinyGPT

LINEARS = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]


def _names(layers: range, linears: list[str] = LINEARS) -> list[str]:
    return [f"decoder.layers.{i}.{n}" for i in layers for n in linears]


def test_converts_exactly_the_decoder_linears(caplog: pytest.LogCaptureFixture) -> None:
    model = TinyGPT()
    before = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    with caplog.at_level(logging.INFO, logger="megatron.fp8.convert"):
        names = convert_to_fp8(model, Fp8Recipe())
    assert names == _names(range(2))
    assert "converted 8/9 linear layers to FP8" in caplog.text
    assert type(model.output_layer) is nn.Linear  # LM head stays high precision
    assert type(model.embedding.word_embeddings) is nn.Embedding
    assert all(type(m) is nn.RMSNorm for n, m in model.named_modules() if "layernorm" in n)
    # Same Parameter objects (so device, dtype, requires_grad are kept) and same state_dict keys.
    assert all(p is before[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    text = str(model)  # identical layers print once, as "(0-1): 2 x _Layer(...)"
    assert text.count("Fp8Linear(") == 4 and "(0-1): 2 x" in text and "scaling=delayed" in text
    assert "(output_layer): Linear(" in text


def test_keeps_requires_grad_dtype_and_is_idempotent() -> None:
    model = TinyGPT().to(torch.bfloat16)
    model.decoder.layers[0].mlp.linear_fc1.weight.requires_grad_(False)
    convert_to_fp8(model, Fp8Recipe())
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    assert isinstance(fc1, Fp8Linear) and fc1.weight.dtype == torch.bfloat16 and not fc1.weight.requires_grad
    assert convert_to_fp8(model, Fp8Recipe()) == []  # already converted


def test_first_last_layers_bf16_and_mlp_fc2_bf16() -> None:
    model = TinyGPT(layers=4)
    assert convert_to_fp8(model, Fp8Recipe(first_last_layers_bf16=1)) == _names(range(1, 3))
    assert type(model.decoder.layers[0].mlp.linear_fc1) is nn.Linear
    assert type(model.decoder.layers[3].self_attention.linear_qkv) is nn.Linear
    model = TinyGPT(layers=4)
    names = convert_to_fp8(model, Fp8Recipe(mlp_fc2_bf16=True))
    assert names == _names(range(4), LINEARS[:3])
    assert all(type(layer.mlp.linear_fc2) is nn.Linear for layer in model.decoder.layers)


def test_module_filter() -> None:
    model = TinyGPT()
    names = convert_to_fp8(model, Fp8Recipe(), module_filter=lambda fqn, m: "self_attention" in fqn)
    assert names == _names(range(2), LINEARS[:2])


def test_amax_group_is_stored_on_the_modules() -> None:
    model = TinyGPT()
    marker = object()
    convert_to_fp8(model, Fp8Recipe(), amax_group=marker)
    assert all(m.fp8.amax_group is marker for m in model.modules() if isinstance(m, Fp8Linear))


def test_rejects_a_model_without_decoder_layers() -> None:
    with pytest.raises(ValueError, match="decoder.layers"):
        convert_to_fp8(nn.Sequential(nn.Linear(4, 4)), Fp8Recipe())


def _train(model: nn.Module, steps: int, micro_batches: int = 2, fp8: bool = True) -> list[float]:
    """AdamW on a fixed set of 2 micro-batches (so the loss can fall fast), under bf16 autocast when `fp8`
    (the FP8 model, or a BF16 control), else in fp32."""
    torch.manual_seed(0)
    data = torch.randint(0, 128, (micro_batches, 4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        total = 0.0
        for mb in range(micro_batches):
            tokens = data[mb]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp8):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if fp8:
            fp8_optimizer_step(model)
        losses.append(total)
    return losses


@pytest.mark.isa_sensitive
def test_fp8_training_tracks_fp32_training() -> None:
    torch.manual_seed(0)
    base = TinyGPT()
    fp8_model = copy.deepcopy(base)
    convert_to_fp8(fp8_model, Fp8Recipe(amax_history_len=4, amax_compute_algo="max", first_last_layers_bf16=0))
    bf16_model = copy.deepcopy(base)
    ref = _train(base, steps=10, fp8=False)
    bf16 = _train(bf16_model, steps=10)  # plain nn.Linear under the same autocast: the run's BF16 noise
    got = _train(fp8_model, steps=10)
    assert got[-1] < got[0] - 1.0  # it learns (memorises the two micro-batches; starts near ln 128)
    # Tracks fp32 training within FP8's rounding: E5M2 gradients have a rounding unit 2^5 times BF16's, so the
    # FP8 - FP32 gap may reach 32x the BF16 - FP32 gap of the same steps (x2 for the spread of one value).
    noise = max(abs(b - r) for b, r in zip(bf16, ref))
    assert 0 < abs(got[-1] - ref[-1]) <= 2 * 32 * noise, (got[-1], ref[-1], noise)


def test_gpt_model_conversion() -> None:
    from megatron.config import LLAMA, ModelConfig
    from megatron.model import gpt

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         ffn_hidden_size=128, seq_length=32, max_position_embeddings=32,
                         padded_vocab_size=128, kv_channels=16, **LLAMA)
    torch.manual_seed(0)
    model = gpt.GPTModel(config)
    reference = copy.deepcopy(model)
    names = convert_to_fp8(model, Fp8Recipe(first_last_layers_bf16=0))
    assert names == _names(range(2))
    assert type(model.output_layer) is nn.Linear
    tokens = torch.randint(0, 128, (2, 32))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    fp8_optimizer_step(model)
    assert abs(loss.item() - reference(tokens, labels=tokens).mean().item()) < 0.02
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
