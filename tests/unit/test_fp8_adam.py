"""Fp8AdamW: parity with torch.optim.AdamW, FP8 numerics of the moments, memory, state dicts, flags."""
from __future__ import annotations

import io
from typing import Callable, List

import pytest
import torch
from torch import nn

from megatron.fp8.stats import sqnr_db
from megatron.optimizer.fp8_adam import Fp8AdamW
from megatron.optimizer.fp8_state_quant import dequantize, moment_format, quantize


# ------------------------------------------------------------------ a small learnable task
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))


def _task():
    """Noisy teacher regression: the loss plateaus at a known level (noise variance 0.01) instead of 0,
    so a relative gap between optimizers is meaningful."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 32, generator=g)
    w1, w2 = torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 8, generator=g) / 8**0.5
    y = torch.tanh(x @ w1) @ w2 + 0.1 * torch.randn(4096, 8, generator=g)
    return x, y


def _train(make_opt: Callable, steps: int = 300) -> List[float]:
    model, (x, y) = _mlp(), _task()
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 4096, (128,), generator=g)
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fp32_states_reproduce_torch_adamw():
    ref = _train(lambda p: torch.optim.AdamW(p, lr=3e-3), steps=50)
    ours = _train(lambda p: Fp8AdamW(p, lr=3e-3, m_dtype="fp32", v_dtype="fp32"), steps=50)
    assert max(abs(a - b) / a for a, b in zip(ref, ours)) < 1e-4


# The loss-curve comparison that used to stand here (end loss within 5% of AdamW's) passed with a v
# that could not shrink; the measurements that can fail are in test_fp8_adam_numerics.py.


# ------------------------------------------------------------------ numerics of the moments
def _updates(steps: int = 60, **kwargs) -> torch.Tensor:
    """Per-step updates of a 64x256 matrix whose rows see gradients spanning 4.5 decades
    (v spans 9 decades = 30 binades: inside E5M2's range per tensor, far outside E4M3's)."""
    rows = torch.logspace(-4.5, 0, 64).unsqueeze(1)
    p = nn.Parameter(torch.zeros(64, 256))
    opt = Fp8AdamW([p], lr=1e-3, weight_decay=0.0, **kwargs)
    g = torch.Generator().manual_seed(3)
    ups = []
    for _ in range(steps):
        p.grad = (torch.randn(64, 256, generator=g) + 0.3) * rows
        before = p.detach().clone()
        opt.step()
        ups.append(p.detach() - before)
    return torch.stack(ups)


def test_v_in_e4m3_is_worse_than_e5m2():
    ref = _updates(m_dtype="fp32", v_dtype="fp32")
    e5m2 = sqnr_db(_updates(v_dtype="e5m2"), ref)
    e4m3 = sqnr_db(_updates(v_dtype="e4m3"), ref)
    assert e5m2 > 15.0, e5m2
    assert e5m2 - e4m3 > 8.0, (e5m2, e4m3)  # measured ~19 dB vs ~6 dB


def test_blockwise_at_least_as_accurate_as_per_tensor():
    g = torch.Generator().manual_seed(0)  # the data is the test's own, whatever ran before it
    x = torch.randn(64, 256, generator=g) * torch.logspace(-10, 2, 64).unsqueeze(1)  # rows of very different scale
    for dtype in ("e4m3", "e5m2"):
        per_tensor = dequantize(*quantize(x, moment_format(dtype, 0)), x.numel()).view_as(x)
        blockwise = dequantize(*quantize(x, moment_format(dtype, 128)), x.numel()).view_as(x)
        # Overall, the largest rows dominate the error, and there both keep the format's relative precision: which
        # one rounds them better is chance (blockwise from 0.95 dB worse to better, over 200 seeds of this data).
        assert sqnr_db(blockwise, x) >= sqnr_db(per_tensor, x) - 1.5
        # small rows: per-tensor scaling flushes them, blocks keep them
        assert sqnr_db(blockwise[:8], x[:8]) > sqnr_db(per_tensor[:8], x[:8]) + 10
    ref = _updates(m_dtype="fp32", v_dtype="fp32")
    assert sqnr_db(_updates(block_size=128), ref) >= sqnr_db(_updates(), ref) - 0.5


def test_padding_of_last_block():
    x = torch.randn(1000)  # 7 full blocks of 128 and one of 104
    q, s = quantize(x, moment_format("e4m3", 128))
    assert q.numel() == 1024 and s.numel() == 8 and q.dtype == torch.float8_e4m3fn
    assert sqnr_db(dequantize(q, s, 1000), x) > 25


def test_stochastic_rounding_is_unbiased():
    fmt = moment_format("e4m3", 0)
    x = torch.full((200_001,), 1.0 + 1 / 32)  # between the E4M3 neighbours 1.0 and 1.125 (after scaling)
    x[0] = 448.0  # fixes the scale at 1
    noise = torch.rand(x.numel(), generator=torch.Generator().manual_seed(0))
    sr = dequantize(*quantize(x, fmt, noise), x.numel())[1:]
    rtn = dequantize(*quantize(x, fmt), x.numel())[1:]
    assert set(sr.unique().tolist()) == {1.0, 1.125}
    assert abs(sr.mean().item() - x[1].item()) < 4 * 0.0625 / 200_000**0.5  # within ~4 sigma
    assert rtn.mean().item() == 1.0  # nearest rounding is biased by 1/32


@pytest.mark.parametrize("kwargs", [{}, {"block_size": 128}, {"m_dtype": "fp32"}, {"stochastic_rounding": False}])
def test_zeros_and_tiny_values_stay_finite_and_bounded(kwargs):
    torch.manual_seed(0)
    p = nn.Parameter(torch.zeros(16, 64))
    ref_p = nn.Parameter(torch.zeros(16, 64))
    opt = Fp8AdamW([p], lr=1e-3, weight_decay=0.0, **kwargs)
    ref = Fp8AdamW([ref_p], lr=1e-3, weight_decay=0.0, m_dtype="fp32", v_dtype="fp32")
    big = torch.zeros(16, 64)
    big[0, 0] = 1e4  # one huge element sets the scale: v of the others (1e-6**2) underflows E5M2
    grads = [torch.zeros(16, 64), torch.full((16, 64), 1e-30), torch.full((16, 64), 1e-40)]
    grads += [big + 1e-6 * torch.randn(16, 64) for _ in range(10)]
    grads += [big] * 10  # small gradients stop: m decays while their v was stored as 0
    for g in grads:
        before = p.detach().clone()
        p.grad, ref_p.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        step = (p.detach() - before).abs()
        assert torch.isfinite(p).all()
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.isfinite(dequantize(opt.state[p][name], opt.state[p].get(name + "_scale_inv"),
                                             p.numel())).all()
        # the 1/sqrt(v) floor keeps every step within Adam's own bound (~lr), never m / eps
        assert step.max().item() <= 2e-3, step.max().item()
    # the dominant element, never near underflow, follows exact Adam
    assert abs(p[0, 0].item() - ref_p[0, 0].item()) < 0.02 * abs(ref_p[0, 0].item())


# ------------------------------------------------------------------ rule, memory, groups
def _big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 256))


def _one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 256)).pow(2).mean().backward()
    opt.step()


def test_state_bytes_per_param():
    model = _big_model()
    n = sum(p.numel() for p in model.parameters())
    adamw = torch.optim.AdamW(model.parameters())
    _one_step(model, adamw)
    adamw_bytes = sum(t.nbytes for s in adamw.state.values() for k, t in s.items() if k != "step")
    for block_size, limit in ((0, 2.05), (128, 2.15)):
        model = _big_model()
        opt = Fp8AdamW(model.parameters(), block_size=block_size)
        _one_step(model, opt)
        ours = sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
        assert ours == opt.state_nbytes()
        assert adamw_bytes / n == pytest.approx(8.0)
        assert 2.0 <= ours / n < limit, ours / n  # 1-D params keep 8 bytes: 3k of 265k elements


def test_param_groups_and_1d_rule():
    model = _big_model()
    lin0, norm, lin2 = model[0], model[1], model[2]
    opt = Fp8AdamW([{"params": [lin0.weight, lin0.bias, norm.weight]},
                    {"params": [norm.bias], "fp8_states": True, "lr": 1e-4},
                    {"params": [lin2.weight, lin2.bias], "fp8_states": False}], m_dtype="e4m3", v_dtype="e5m2")
    _one_step(model, opt)
    dtypes = {name: (opt.state[p]["exp_avg"].dtype, opt.state[p]["exp_avg_sq"].dtype) for name, p in [
        ("lin0.w", lin0.weight), ("lin0.b", lin0.bias), ("norm.w", norm.weight), ("norm.b", norm.bias),
        ("lin2.w", lin2.weight), ("lin2.b", lin2.bias)]}
    fp8, fp32 = (torch.float8_e4m3fn, torch.float8_e5m2), (torch.float32, torch.float32)
    assert dtypes == {"lin0.w": fp8, "lin0.b": fp32, "norm.w": fp32, "norm.b": fp8, "lin2.w": fp32,
                      "lin2.b": fp32}
    s = opt.state_summary()
    assert (s.fp8_tensors, s.fp8_params, s.fp32_tensors) == (2, 256 * 512 + 512, 4)
    assert "e4m3" in str(s) and "e5m2" in str(s)


# ------------------------------------------------------------------ state dicts
def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("kwargs", [{}, {"block_size": 128}, {"stochastic_rounding": False}])
def test_exact_resume(kwargs):
    straight = _big_model()
    opt = Fp8AdamW(straight.parameters(), **kwargs)
    _run(straight, opt, 5, seed=0)
    _run(straight, opt, 5, seed=1)

    first = _big_model()
    opt1 = Fp8AdamW(first.parameters(), **kwargs)
    _run(first, opt1, 5, seed=0)
    model_sd, opt_sd = _roundtrip(first.state_dict()), _roundtrip(opt1.state_dict())
    resumed = _big_model()
    resumed.load_state_dict(model_sd)
    opt2 = Fp8AdamW(resumed.parameters(), **kwargs)
    opt2.load_state_dict(opt_sd)
    assert opt2.state[resumed[0].weight]["exp_avg"].dtype == torch.float8_e4m3fn
    _run(resumed, opt2, 5, seed=1)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs", [{}, {"block_size": 128}, {"block_size": 0}, {"stochastic_rounding": False}])
def test_step_does_not_depend_on_the_chunk_length(monkeypatch, kwargs):
    """The update runs in chunks (2^20 elements on CPU, 2^26 on accelerators, `_chunk_elements`); weights and
    FP8 moments after 3 steps are the same bits with 384-element chunks (many, with ragged tails: 256 x 512 is
    341 of them and a tail) as with one chunk per tensor."""
    from megatron.optimizer import fp8_adam

    results = []
    for chunk in (384, 1 << 20):
        monkeypatch.setattr(fp8_adam, "_CHUNK", chunk)
        model = _big_model()
        opt = Fp8AdamW(model.parameters(), **kwargs)
        _run(model, opt, 3, seed=0)
        results.append([t.clone() for t in model.parameters()]
                       + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)])
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b)


def test_chunks_are_larger_on_accelerators():
    """A chunk is one kernel launch: on a GPU 2^20 elements would be host-bound (docs/fp8_adam.md)."""
    from megatron.optimizer.fp8_adam import _chunk_elements

    assert _chunk_elements(torch.device("cpu"), 128) == 1 << 20
    assert _chunk_elements(torch.device("cuda"), 128) == 1 << 26
    assert _chunk_elements(torch.device("cuda"), 96) % 96 == 0 and _chunk_elements(torch.device("cpu"), 0) == 1 << 20


def test_load_torch_adamw_state_converts():
    model = _big_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _run(model, adamw, 3, seed=0)
    opt = Fp8AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(_roundtrip(adamw.state_dict()))
    w = model[0].weight
    st, ref = opt.state[w], adamw.state[w]
    assert st["exp_avg"].dtype == torch.float8_e4m3fn and st["exp_avg_sq"].dtype == torch.float8_e5m2
    assert float(st["step"]) == 3.0
    assert sqnr_db(dequantize(st["exp_avg"], st["exp_avg_scale_inv"], w.numel()).view_as(w), ref["exp_avg"]) > 25
    assert sqnr_db(dequantize(st["exp_avg_sq"], st["exp_avg_sq_scale_inv"], w.numel()).view_as(w),
                   ref["exp_avg_sq"]) > 15
    assert "amsgrad" not in opt.param_groups[0]
    _run(model, opt, 2, seed=1)  # and it keeps training
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_load_other_block_size_and_dtype_converts():
    model = _big_model()
    src = Fp8AdamW(model.parameters(), block_size=0)
    _run(model, src, 3, seed=0)
    dst = Fp8AdamW(model.parameters(), block_size=128, m_dtype="bf16")
    dst.load_state_dict(_roundtrip(src.state_dict()))
    w = model[0].weight
    a, b = src.state[w], dst.state[w]
    assert b["exp_avg"].dtype == torch.bfloat16 and b["exp_avg_sq_scale_inv"].numel() == w.numel() // 128
    assert sqnr_db(dequantize(b["exp_avg_sq"], b["exp_avg_sq_scale_inv"], w.numel()),
                   dequantize(a["exp_avg_sq"], a["exp_avg_sq_scale_inv"], w.numel())) > 15
    sd = src.state_dict()
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"][:1000]  # a moment of another tensor
    with pytest.raises(ValueError, match="does not fit"):
        dst.load_state_dict(sd)


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kwargs,flag", [
    ({"m_dtype": "fp16"}, "--fp8-optimizer-m-dtype"),
    ({"v_dtype": "E5M2x"}, "--fp8-optimizer-v-dtype"),
    ({"block_size": -1}, "--fp8-optimizer-block-size"),
    ({"block_size": 12.5}, "--fp8-optimizer-block-size"),
    ({"betas": (0.9, 1.0)}, "--adam-beta2"),
])
def test_bad_arguments_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        Fp8AdamW([nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_rejects_non_fp32_master_weights():
    with pytest.raises(ValueError, match="FP32 master weights"):
        Fp8AdamW([nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))])


# ------------------------------------------------------------------ torch.compile
def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken_compile(fn, **_):
        def raise_(*args, **kwargs):
            raise RuntimeError("no compiler here")
        return raise_
    monkeypatch.setattr(torch, "compile", broken_compile)
    model_a, model_b = _big_model(), _big_model()
    eager, compiled = Fp8AdamW(model_a.parameters()), Fp8AdamW(model_b.parameters(), compile=True)
    compiled.direct_calls = False  # the CPU's direct graphs (test_fp8_adam_one_call.py) use no torch.compile
    _run(model_a, eager, 2, seed=0)
    _run(model_b, compiled, 2, seed=0)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)


@pytest.mark.isa_sensitive  # generated kernels follow the ISA: CI runs it with AVX2 forced too
@pytest.mark.parametrize("block_size", [0, 128])
def test_compiled_matches_eager(block_size):
    """20 steps of fixed gradients (no feedback through the model), compiled vs eager.

    Both kernels evaluate the same fp32 expressions and draw the same stochastic-rounding noise (the
    counter-based hash of seed, parameter, step and element, inside the kernel); fusion and FMA contraction may
    still move a pre-rounding value by a few fp32 ulps (say <= 8 * 2^-23 relative). An FP8 rounding decision flips only
    if its boundary falls inside that interval; boundaries are >= 2^-4 apart relative to the value
    (E4M3; E5M2: 2^-3), so P(flip) <= 8 * 2^-23 * 2^4 = 2^-16 per element, moment and step: <= 6e-4 of
    the elements over 20 steps and two moments. A flip changes an element's later updates by up to a
    fraction of lr, so it shows; every other element agrees to fp32 noise. Asserted: at most 1% of the
    elements differ by more than steps * lr * 2^-10 (far above fp32 noise, far below a flip's effect),
    and the L1 difference is < 1% of the L1 parameter change. The first CPU compile takes ~5-25 s.
    """
    steps, lr = 20, 1e-3
    model_a, model_b = _big_model(), _big_model()
    eager = Fp8AdamW(model_a.parameters(), lr=lr, block_size=block_size)
    compiled = Fp8AdamW(model_b.parameters(), lr=lr, block_size=block_size, compile=True)
    init = [p.detach().clone() for p in model_a.parameters()]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            a.grad = torch.randn(a.shape, generator=g) * 1e-2
            b.grad = a.grad.clone()
        eager.step()
        compiled.step()
    if compiled.runs_eager:
        pytest.skip("torch.compile is unavailable here (Fp8AdamW fell back to eager)")
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(model_a.parameters(), model_b.parameters())])
    change = torch.cat([(a - i).abs().flatten() for a, i in zip(model_a.parameters(), init)])
    assert (diff > steps * lr * 2**-10).float().mean().item() <= 0.01
    assert diff.sum().item() < 0.01 * change.sum().item()


def test_moments_take_the_devices_fp8_limits():
    """Gaudi2's E4M3 maximum is 240, not OCP's 448: moments of parameters on an HPU are scaled to it (the format
    follows the parameters' device, `megatron.fp8.formats.format_backend_of`), so no block's largest m clips."""
    from megatron.fp8.formats import format_backend_of

    assert format_backend_of("hpu") == "hpu" and format_backend_of("cpu") == format_backend_of("cuda") == "cpu"
    w = torch.nn.Parameter(torch.randn(64, 64))
    assert Fp8AdamW([w]).m_format.max == 448.0
    gaudi = Fp8AdamW([w], lr=1e-3, format_backend="hpu", block_size=128, compile=True)
    assert gaudi.m_format.max == 240.0 and gaudi.v_format.max == 57344.0
    assert gaudi._kernel is None  # no inductor on Gaudi: the update runs eagerly (lazy mode builds the graph)
    for _ in range(3):
        w.grad = torch.randn(64, 64) * 1e3
        gaudi.step()
    m = gaudi.state[w]["exp_avg"]
    assert m.dtype == torch.float8_e4m3fn and m.float().abs().max() <= 240.0
