"""Fp8AdamW's compiled update is compiled at start-up (megatron/optimizer/fp8_adam_warmup.py): the warm-up leaves
the optimizer as it was, and the steps that follow compile nothing more (every chunk length, the ragged tails
included, hits the graphs the warm-up built)."""
import pytest
import torch
from torch import nn

from megatron.optimizer import fp8_adam
from megatron.optimizer.fp8_adam import Fp8AdamW
from megatron.optimizer.fp8_adam_warmup import warm_up_fp8_adam


def _frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def test_after_the_warm_up_training_steps_compile_nothing(monkeypatch):
    monkeypatch.setattr(fp8_adam, "_CHUNK", 512)  # 24x100 = 2400 elements: 4 chunks and a 352 tail
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 100), nn.Tanh(), nn.Linear(100, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = Fp8AdamW(model.parameters(), lr=1e-2, compile=True)
    seconds = warm_up_fp8_adam(opt)
    if opt.runs_eager:
        pytest.skip("torch.compile is unavailable here (Fp8AdamW fell back to eager)")
    assert seconds is not None and seconds > 0
    assert not opt.state and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    frames = _frames()
    x = torch.randn(16, 24)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert _frames() == frames  # no graph compiled inside the steps
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_nothing_to_warm_up_without_compiled_fp8_states():
    w = nn.Parameter(torch.randn(8, 8))
    assert warm_up_fp8_adam(Fp8AdamW([w])) is None  # compile off
    assert warm_up_fp8_adam(Fp8AdamW([nn.Parameter(torch.randn(8))], compile=True)) is None  # FP32 states only
    assert warm_up_fp8_adam(torch.optim.AdamW([w])) is None
