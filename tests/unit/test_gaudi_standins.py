"""The Gaudi path on the CPU, end to end through megatron's own backend selection: an FP8 layer's forward and backward
and a short training run on the stand-ins of Habana's ops (tests/support/fake_hpu.py), with `select_backend` seeing
the CPU tensors as the hpu device they stand for (`fake_hpu.select_as_hpu`). A wrong E4M3 limit (OCP's 448 where
Gaudi2 has 240) or an inverted scale convention (scales where the GEMM takes their inverses) makes these checks fail.

Accuracy bounds, from the formats: with round-to-nearest each operand element carries a relative error of at most u
(half a grid step: 2**-4 in E4M3, 2**-3 in E5M2). A product a b then errs by a b (alpha + beta + alpha beta); for
independent zero-mean errors over a sum of independent products the noise power is at most u_a**2 + u_b**2 +
u_a**2 u_b**2 times the signal power, so SQNR >= -10 log10 of that: 21.1 dB for E4M3 x E4M3 (fprop), 17.1 dB for
E5M2 x E4M3 (dgrad, wgrad). Using u**2 as each error's variance (uniform rounding error has u**2 / 3) leaves about
5 dB of room. Against the emulated backend given Gaudi2's limits (the same casts; only the GEMMs' fp32 rounding
differs) the bound is fp32's: each of K <= 512 accumulation steps and each scale-inverse product rounds once
(2**-24), so SQNR >= 20 log10(2**24 / (K + 2)) = 90 dB.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear, Fp8Recipe, backends, formats
from megatron.fp8.stats import sqnr_db
from megatron.training.loop import pretrain
from tests.support import fake_hpu
from tests.support.config import tiny_argv

TOKENS, K, N = (4, 64), 512, 256
STEPS = 3  # delayed scaling: the first step scales from the current amax, the later ones from the history


def _bound_db(u_a: float, u_b: float) -> float:
    return -10 * math.log10(u_a**2 + u_b**2 + u_a**2 * u_b**2)


E4M3_U, E5M2_U = 2.0**-4, 2.0**-3
BOUNDS = {"y": _bound_db(E4M3_U, E4M3_U), "dx": _bound_db(E5M2_U, E4M3_U), "dW": _bound_db(E5M2_U, E4M3_U)}
FP32_BOUND = 20 * math.log10(2**24 / (K + 2))


@pytest.fixture
def gaudi(monkeypatch):
    """(the stand-in ops, the names of the backends megatron's selection chose)."""
    ops = fake_hpu.install(monkeypatch)
    return ops, fake_hpu.select_as_hpu(monkeypatch)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=g) * 0.02
    x = torch.randn(*TOKENS, K, generator=g)
    dy = torch.randn(*TOKENS, N, generator=g)  # a fixed output gradient: the same dy whatever y came out
    return weight, x, dy


def _reference() -> dict[str, torch.Tensor]:
    weight, x, dy = (t.double() for t in _inputs())
    return {"y": x @ weight.t(), "dx": dy @ weight, "dW": dy.reshape(-1, N).t() @ x.reshape(-1, K)}


def _layer_run(recipe: Fp8Recipe) -> dict[str, torch.Tensor]:
    """y, dx and dW of the last of STEPS forward-backward passes of one Fp8Linear."""
    weight, x, dy = _inputs()
    layer = Fp8Linear(K, N, bias=False, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(weight)
    for _ in range(STEPS):
        layer.weight.grad = None
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
    return {"y": y.detach(), "dx": xi.grad, "dW": layer.weight.grad}


def _sqnr(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: sqnr_db(got[name], reference[name]) for name in reference}


@pytest.mark.parametrize("choice", ["auto", "hpu"])
def test_fp8_layer_on_the_stand_ins_through_select_backend(gaudi, choice) -> None:
    ops, chosen = gaudi
    got = _layer_run(Fp8Recipe(backend=choice))
    assert chosen and set(chosen) == {"hpu"}
    assert ops.calls.count("fp8_gemm_v2") == 3 * STEPS and ops.calls.count("cast_to_fp8_v2") >= 2 * STEPS
    accuracy = _sqnr(got, _reference())
    assert all(accuracy[name] > BOUNDS[name] for name in BOUNDS), (accuracy, BOUNDS)
    # The same casts on the emulated backend, which megatron gives Gaudi2's limits on an hpu device: equal up to the
    # GEMMs' fp32 rounding, so a transpose, layout or scale error of the HPU path shows here long before it could hide
    # in FP8 noise.
    emulated = _layer_run(Fp8Recipe(backend="emulated"))
    assert chosen[-1] == "emulated"
    agreement = _sqnr(got, emulated)
    assert all(db > FP32_BOUND for db in agreement.values()), agreement


def test_every_fp8_format_on_an_hpu_device_has_gaudi2s_limits(monkeypatch) -> None:
    """The layers' backends, auto or forced (the emulation too), and Fp8AdamW's moments: E4M3 240 on an hpu device,
    448 on the CPU."""
    from megatron.optimizer.fp8_state_quant import moment_format

    fake_hpu.install(monkeypatch)
    monkeypatch.setattr(backends, "_make", backends._make.__wrapped__)  # uncached: made with the stand-ins
    for choice in ("auto", "hpu", "emulated"):
        backend = backends.select_backend(choice, torch.device("hpu"))
        assert backends.backend_format_spec(backend, "e4m3").max == 240.0, choice
    assert backends.backend_format_spec(backends.select_backend("emulated", "cpu"), "e4m3").max == 448.0
    assert moment_format("e4m3", 0, formats.format_backend_of("hpu")).max == 240.0
    assert moment_format("e4m3", 0, formats.format_backend_of("cpu")).max == 448.0


def test_ocp_e4m3_limit_on_gaudi_fails(gaudi, monkeypatch) -> None:
    """Negative control: Gaudi2's E4M3 limit in megatron's format table set to OCP's 448. The layer scales its
    operands to 448 and the stand-in cast refuses values that would be inf on a Gaudi2."""
    monkeypatch.setattr(formats, "_GAUDI2_E4M3_MAX", 448.0)
    with pytest.raises(AssertionError, match="beyond the Gaudi2 maximum 240"):
        _layer_run(Fp8Recipe())


def test_inverted_scale_convention_fails(gaudi, monkeypatch) -> None:
    """Negative control: the HPU backend handing fp8_gemm_v2 the quantization scales instead of their inverses.
    Every one of y, dx and dW falls below its accuracy bound."""
    monkeypatch.setattr(backends, "_dequantization_factor", lambda scale: scale.float().reshape(()))
    accuracy = _sqnr(_layer_run(Fp8Recipe()), _reference())
    assert all(accuracy[name] < BOUNDS[name] for name in BOUNDS), accuracy


def test_training_run_selects_the_gaudi_backend(gaudi) -> None:
    """pretrain with `--fp8-backend auto`: every FP8 layer of the model gets HpuBackend from megatron's selection, every
    GEMM runs on the stand-ins, and the model learns (the margin of tests/unit/test_fp8_backends_e2e.py)."""
    ops, chosen = gaudi
    iters = 8
    argv = tiny_argv("--bf16", "--fp8-format", "hybrid", "--fp8-backend", "auto", hidden_size=72,
                     ffn_hidden_size=200, train_iters=iters, eval_iters=0, lr_warmup_iters=0)
    losses = pretrain(parse_config(argv)).losses
    assert chosen and set(chosen) == {"hpu"}
    assert ops.calls.count("fp8_gemm_v2") >= 8 * 3 * iters  # 8 FP8 linears x 3 GEMMs per micro-batch
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.3, losses
