"""The emulated FP8 GEMMs' two CPU modes (megatron/fp8/cpu_gemm.py): `exact` rounds once, `bf16` runs BF16 GEMMs
in --bf16 runs, which apply the scales to their FP32 accumulator before rounding once, eager and traced alike.

The operands are FP8 values that are small integers times a power of two, and K is small, so every partial sum is
exact in FP32 whatever the summation order: the accumulator is the same number in a BF16 and an FP32 GEMM on any
CPU, and each mode's output is a function of it that the test computes in float64."""
from __future__ import annotations

import re

import pytest
import torch

from megatron.fp8 import Fp8Linear, cpu_gemm, set_fused_quantization
from megatron.fp8.backends import EmulatedBackend
from megatron.fp8.recipe import Fp8Recipe, Fp8Scaling

BF16 = torch.bfloat16


def _operands(m: int = 16, k: int = 32, n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 values in [-15, 15] (integers: exact in E4M3 and BF16); |accumulator| <= 32 * 225 < 2^24."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-15, 16, (m, k), generator=g).float().to(torch.float8_e4m3fn)
    b = torch.randint(-15, 16, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    return a, b


def _acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double().t()


def _gemm(mode: str, a, b, s_a: float, s_b: float, out_dtype, run_dtype, pow2: bool) -> torch.Tensor:
    with cpu_gemm.use_mode(mode):
        return EmulatedBackend().gemm_nt(a, torch.tensor(s_a), b, torch.tensor(s_b), out_dtype, pow2,
                                         run_dtype=run_dtype)


def test_exact_mode_rounds_once():
    a, b = _operands()
    want = (_acc(a, b) / (3.0 * 5.0)).to(BF16)  # one rounding of the exact result (float64 holds it)
    assert torch.equal(_gemm("exact", a, b, 3.0, 5.0, BF16, BF16, False), want)
    assert torch.equal(_gemm("exact", a, b, 3.0, 5.0, torch.float32, BF16, False),
                       (_acc(a, b).float() / torch.tensor(15.0)))


def test_bf16_mode_with_power_of_two_scales_is_the_single_rounding():
    a, b = _operands()
    want = (_acc(a, b) / (4.0 * 8.0)).to(BF16)
    assert torch.equal(_gemm("bf16", a, b, 4.0, 8.0, BF16, BF16, True), want)


def _factor(s_a: float, s_b: float) -> torch.Tensor:
    """1 / (s_a s_b) in FP32 arithmetic."""
    return torch.tensor(1.0) / (torch.tensor(s_a) * torch.tensor(s_b))


def _traced(mode: str, *args) -> torch.Tensor:
    """`_gemm` as the layer traced into a compiled block runs it (dynamo's trace, run without inductor)."""
    return torch.compile(lambda: _gemm(mode, *args), backend="eager", fullgraph=True)()


@pytest.mark.isa_sensitive  # where addmm applies alpha depends on the kernel the ISA picks
def test_bf16_mode_applies_other_scales_inside_the_gemm_and_rounds_once():
    """The BF16 GEMM's FP32 accumulator times 1 / (s_a s_b) in FP32, rounded once to BF16 (addmm's alpha);
    within one BF16 unit in the last place of the single rounding of the exact result, and not the two roundings of
    a BF16 output divided afterwards (these operands hit cases where those differ)."""
    a, b = _operands(64, 32, 64)
    acc = _acc(a, b)
    got = _gemm("bf16", a, b, 3.0, 5.0, BF16, BF16, False)
    assert torch.equal(got, (acc.float() * _factor(3.0, 5.0)).to(BF16))
    single = (acc / 15.0).to(BF16)
    ulp = torch.finfo(BF16).eps * single.double().abs().clamp_min(torch.finfo(BF16).tiny)
    assert ((got.double() - single.double()).abs() <= ulp).all()
    assert not torch.equal(got, (acc.to(BF16).double() / 15.0).to(BF16))


@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
def test_bf16_mode_traced_into_a_compiled_graph_gives_the_eager_bits(out_dtype):
    """Traced (the scales cannot be read as numbers in a graph), the GEMM is the custom op
    `megatron::scaled_bf16_gemm`, which the compiled graph calls: the eager single rounding, inductor included."""
    a, b = _operands(64, 32, 64)
    eager = _gemm("bf16", a, b, 3.0, 5.0, out_dtype, BF16, False)
    assert torch.equal(_traced("bf16", a, b, 3.0, 5.0, out_dtype, BF16, False), eager)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes})
        return gm.forward

    torch.compile(lambda: _gemm("bf16", a, b, 3.0, 5.0, out_dtype, BF16, False), backend=backend, fullgraph=True)()
    assert "megatron.scaled_bf16_gemm.default" in graphs[0], graphs
    inductor = torch.compile(lambda x, y: _gemm("bf16", x, y, 3.0, 5.0, out_dtype, BF16, False) * 2)(a, b)
    assert torch.equal(inductor, eager * 2)


@pytest.mark.isa_sensitive
def test_bf16_mode_rounds_wgrads_result_to_bf16():
    """Wgrad (FP32 output) in a --bf16 run keeps 8 significant bits: the scaled accumulator rounded once to BF16."""
    a, b = _operands()
    acc = _acc(a, b)
    got = _gemm("bf16", a, b, 3.0, 5.0, torch.float32, BF16, False)
    assert got.dtype == torch.float32
    assert torch.equal(got, (acc.float() * _factor(3.0, 5.0)).to(BF16).float())
    assert not torch.equal(got, acc.float() / 15.0)  # the accumulator needs more than 8 significant bits here


@pytest.mark.parametrize("s_a", [float("nan"), float("inf")])
def test_bf16_mode_with_a_non_finite_scale_gives_non_finite_outputs(s_a):
    """The layer's non-finite guard makes a scale NaN; a NaN factor makes every output NaN. An infinite scale
    (a product beyond FP32) is a factor of zero, as the division gives."""
    a, b = _operands()
    for out_dtype in (BF16, torch.float32):
        got = _gemm("bf16", a, b, s_a, 5.0, out_dtype, BF16, False)
        if s_a != s_a:
            assert got.isnan().all()
        else:
            assert torch.equal(got, torch.zeros_like(got))


def test_dequantization_factor_is_fp32_arithmetic():
    for s_a, s_b in ((3.0, 5.0), (448.0 / 7.3, 57344.0 / 0.011), (2.0 ** 60, 2.0 ** 70), (1e-30, 1e-20)):
        want = _factor(s_a, s_b).item()
        assert cpu_gemm.dequantization_factor(torch.tensor(s_a), torch.tensor(s_b)) == want


def test_runs_without_bf16_keep_fp32_gemms_in_bf16_mode():
    a, b = _operands()
    for out_dtype in (torch.float32, BF16):
        assert torch.equal(_gemm("bf16", a, b, 3.0, 5.0, out_dtype, torch.float32, False),
                           _gemm("exact", a, b, 3.0, 5.0, out_dtype, torch.float32, False))


def test_a_bf16_runs_fp8_layer_takes_the_bf16_gemms():
    """An Fp8Linear with fused quantization under BF16 autocast: in bf16 mode its FP8 values are kept in BF16 and
    its wgrad is a BF16-rounded accumulator times 1 / (s_dy s_x) (power-of-two scales: exact), so dW times the
    scales is a BF16 number; forward and dgrad are single roundings either way (within summation order)."""
    torch.manual_seed(0)
    recipe = Fp8Recipe(scaling=Fp8Scaling.TENSORWISE, power_of_two_scales=True)
    layer = Fp8Linear(64, 48, bias=False, recipe=recipe)
    set_fused_quantization(layer, True)
    x = torch.randn(32, 64).bfloat16()  # what a --bf16 model hands its FP8 layers
    outputs = {}
    for mode in ("exact", "bf16"):
        layer.weight.grad = None
        xi = x.clone().requires_grad_()
        with cpu_gemm.use_mode(mode), torch.autocast("cpu", dtype=BF16):
            y = layer(xi)
            y.float().square().sum().backward()
        outputs[mode] = y.detach(), xi.grad, layer.weight.grad.clone()
        assert layer.fp8.values_dtype(layer.fp8.backend(x.device)) == cpu_gemm.values_dtype()
    (y_e, dx_e, dw_e), (y_b, dx_b, dw_b) = outputs["exact"], outputs["bf16"]
    assert y_b.dtype == dx_b.dtype == BF16
    eps = torch.finfo(BF16).eps  # one unit in the last place of a BF16 number v is at most eps * |v|
    for got, want in ((y_b, y_e), (dx_b, dx_e)):
        assert ((got.double() - want.double()).abs() <= eps * want.double().abs()).all()
    # Power-of-two scales: dW = bf16(accumulator) / 2^k, a BF16 number; the exact mode's FP32 dW is not.
    assert torch.equal(dw_b.bfloat16().float(), dw_b)
    assert not torch.equal(dw_e.bfloat16().float(), dw_e)
    assert ((dw_b.double() - dw_e.double()).abs() <= 2.0 ** -8 * dw_e.double().abs()).all()


def test_in_bf16_mode_wgrad_takes_the_forwards_bf16_values_instead_of_converting_the_fp8_input_again():
    """The eager layer (fused quantization) in bf16 mode saves x's FP8 values in BF16 for wgrad, as a compiled block
    does, instead of Q(x) to convert again in backward: every saved [tokens, K] tensor is BF16 and on the E4M3 grid
    (x itself is not), none is FP8. The exact mode keeps saving Q(x)."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 48, bias=False, recipe=Fp8Recipe(scaling=Fp8Scaling.TENSORWISE))
    set_fused_quantization(layer, True)
    x = torch.randn(32, 64).bfloat16().requires_grad_()
    saved = {}
    for mode in ("bf16", "exact"):
        found = saved[mode] = []
        with cpu_gemm.use_mode(mode), torch.autocast("cpu", dtype=BF16), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: found.append(t) or t, lambda t: t):
            layer(x).float().sum().backward()
    activations = [t for t in saved["bf16"] if tuple(t.shape) == (32, 64)]
    assert activations and all(t.dtype == BF16 for t in activations), [t.dtype for t in activations]
    on_grid = [torch.equal(t.float().to(torch.float8_e4m3fn).float(), t.float()) for t in activations]
    assert all(on_grid) and not torch.equal(x.float().to(torch.float8_e4m3fn).float(), x.float())
    assert torch.float8_e4m3fn in [t.dtype for t in saved["exact"] if tuple(t.shape) == (32, 64)]


@pytest.mark.parametrize("vendor,flags,cap,want", [
    ("GenuineIntel", {"amx_bf16", "avx512f"}, None, "bf16"),
    ("GenuineIntel", {"avx512f", "avx512_bf16"}, None, "exact"),
    ("AuthenticAMD", {"avx512f", "avx512_bf16"}, None, "bf16"),
    ("AuthenticAMD", {"avx512f", "avx512_bf16"}, "AVX512_CORE", "exact"),
    ("AuthenticAMD", {"avx512f", "avx512_bf16"}, "AVX512_CORE_BF16", "bf16"),
    ("AuthenticAMD", {"avx512f", "avx2"}, None, "exact"),
    ("GenuineIntel", {"amx_bf16", "avx512f"}, "AVX512_CORE", "exact"),
    ("GenuineIntel", {"amx_bf16", "avx512f"}, "AVX512_CORE_AMX", "bf16")])
def test_auto_takes_bf16_gemms_where_they_are_faster(monkeypatch, vendor, flags, cap, want):
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert cpu_gemm.decide_mode() == want


def test_the_environment_overrides_and_a_bad_value_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"amx_bf16"})
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "exact")
    assert cpu_gemm.decide_mode() == "exact"
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "fp16")
    with pytest.raises(ValueError, match=r"^MEGATRON_CPU_FP8_GEMM='fp16' is not one of auto, exact, bf16: [^\n]*$"):
        cpu_gemm.decide_mode()


def test_the_startup_line_says_the_mode_and_how_to_change_it(monkeypatch):
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"amx_bf16"})
    with cpu_gemm.use_mode("bf16"):
        line = cpu_gemm.describe()
    assert "BF16 GEMMs" in line and "this CPU has fast BF16 GEMMs" in line
    assert "MEGATRON_CPU_FP8_GEMM=exact" in line
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    with cpu_gemm.use_mode("exact"):
        line = cpu_gemm.describe()
    assert "FP32 GEMMs rounded once" in line and "no AMX-BF16 on this CPU, nor AVX512-BF16" in line
    assert "MEGATRON_CPU_FP8_GEMM=bf16" in line


def test_an_fp8_run_on_cpu_logs_the_mode_at_start_up(caplog):
    import logging

    from megatron.arguments import parse_config
    from megatron.training.parallelize import log_cpu_fp8_gemms
    from tests.support.config import tiny_argv

    with caplog.at_level(logging.INFO, logger="megatron"), cpu_gemm.use_mode("exact"):
        log_cpu_fp8_gemms(parse_config(tiny_argv("--fp8-format", "hybrid")), torch.device("cpu"))
        log_cpu_fp8_gemms(parse_config(tiny_argv()), torch.device("cpu"))  # no FP8: no line
        assert [r.getMessage() for r in caplog.records] == [
            cpu_gemm.describe(), "> torch.compile: the FP8 value conversions of the emulated GEMMs compile on first "
            "use, one graph per operand shape (in the first iterations)"]


def test_in_bf16_mode_the_value_conversions_compile_at_start_up_for_every_shape(caplog, monkeypatch):
    """BF16 GEMMs (CPUs with AMX): one dynamic graph per FP8 format and layout, compiled by the start-up line, serves
    every weight and activation shape: the conversions of the first iterations compile nothing more."""
    import logging

    from torch._dynamo.utils import counters

    from megatron.arguments import parse_config
    from megatron.fp8 import fused
    from megatron.training.parallelize import log_cpu_fp8_gemms
    from tests.support.config import tiny_argv

    monkeypatch.setattr(fused, "_warmed_up", set())  # other tests keep the per-shape graphs
    monkeypatch.setattr(fused, "_eager_ready", set())
    with caplog.at_level(logging.INFO, logger="megatron"), cpu_gemm.use_mode("bf16"):
        log_cpu_fp8_gemms(parse_config(tiny_argv("--fp8-format", "hybrid", "--bf16")), torch.device("cpu"))
    assert re.fullmatch(r"> torch.compile: the FP8 value conversions of the emulated GEMMs compiled in [\d.]+ s, "
                        r"before the first iteration", caplog.records[-1].getMessage())
    graphs = int(counters["stats"]["unique_graphs"])  # counted where the fused functions compile (frames are not)
    with torch.no_grad():
        for shape in ((64, 48), (200, 72), (4096, 8)):
            for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
                q = torch.randn(shape).to(fp8)
                assert torch.equal(fused.upcast(q, torch.bfloat16), q.to(torch.float32).to(torch.bfloat16))
                assert torch.equal(fused.upcast(q.t(), torch.bfloat16), q.t().to(torch.float32).to(torch.bfloat16))
    assert int(counters["stats"]["unique_graphs"]) == graphs
