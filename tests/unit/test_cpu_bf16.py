"""CPU BF16 autocast GEMMs as FP32 GEMMs on BF16-rounded operands (megatron/cpu_bf16.py).

The reference is the BF16 arithmetic in float64: operands rounded to BF16, exact products and sums, one rounding
to BF16. An FP32 GEMM of K terms differs from the exact sum by at most gamma_K * sum|a||b| with
gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, Thm 3.5; any
summation order), and the final rounding to BF16 adds at most half a BF16 ulp of the result. So
|out - ref| <= ulp_bf16(out) / 2 + gamma_K * (|A| @ |B|) holds on any CPU. The same GEMM on *unrounded*
operands violates it (the negative control), so the test sees a kernel that forgot to round.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron import cpu_bf16

U32 = 2.0 ** -24


def gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of BF16 numbers at |x| (8 significant bits), for normal values."""
    e = torch.floor(torch.log2(x.abs().double().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def within_bound(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|out - exact BF16 GEMM| minus the bound; <= 0 everywhere when out is right."""
    a64, b64 = a.bfloat16().double(), b.bfloat16().double()
    ref = a64 @ b64
    bound = bf16_ulp(out) / 2 + gamma(a.shape[-1]) * (a64.abs() @ b64.abs())
    return (out.double() - ref).abs() - bound


@pytest.fixture
def emulated():
    with cpu_bf16.use_mode("fp32"):
        yield


def test_mm_matches_float64_bf16_arithmetic(emulated):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 384, generator=g) * 3
    b = torch.randn(384, 48, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = {"mm": a @ b, "linear": F.linear(a, b.t()), "addmm": torch.addmm(torch.zeros(48), a, b),
                "bmm": torch.bmm(a[None], b[None])[0]}
    for name, out in outs.items():
        assert out.dtype == torch.bfloat16, name
        assert within_bound(out, a, b).max() <= 0, name
    # Negative control: the unrounded operands' exact product is outside the bound somewhere.
    unrounded = (a.double() @ b.double()).to(torch.bfloat16)
    assert (unrounded.double() - outs["mm"].double()).abs().max() > 0
    a64, b64 = a.double(), b.double()
    wrong = (a64 @ b64 - a.bfloat16().double() @ b.bfloat16().double()).abs()
    assert (wrong - bf16_ulp(outs["mm"]) / 2 - gamma(384) * (a64.abs() @ b64.abs())).max() > 0


def test_backward_is_the_bf16_backward(emulated):
    """dA = bf16(dY) @ bf16(B)^T rounded to BF16, then to the leaf's FP32; likewise dB."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(32, 96, generator=g, requires_grad=True)
    b = torch.randn(96, 40, generator=g, requires_grad=True)
    dy = torch.randn(32, 40, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = a @ b
    y.backward(dy.bfloat16())
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    assert within_bound(a.grad, dy, b.detach().t()).max() <= 0
    assert within_bound(b.grad, a.detach().t(), dy).max() <= 0


def test_attention_rounds_inputs_and_output(emulated):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    r = [t.bfloat16().double() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*r, is_causal=True)
    # FP32 softmax attention on exact BF16 inputs: rows are convex combinations of v, so the FP32 error is a
    # few u32 of max|v| (far below a BF16 ulp of it); the output rounding adds half a BF16 ulp.
    slack = bf16_ulp(out) / 2 + 64 * U32 * r[2].abs().amax()
    assert ((out.double() - ref).abs() - slack).max() <= 0


def test_native_mode_is_torchs_kernel():
    """use_mode('native') keeps BF16 operands (what torch's autocast does): same bound, BF16 GEMM."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 8, generator=g)
    with cpu_bf16.use_mode("native"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_bf16.emulates_bf16_gemms()
        out = a @ b
    assert out.dtype == torch.bfloat16
    assert within_bound(out, a, b).max() <= 0


def test_compiled_graph_uses_the_emulation(emulated):
    """Under torch.compile the autocast region traces through the registered kernels: the ATen graph's mm
    multiplies FP32 tensors (BF16-rounded), and the result matches the BF16 arithmetic."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w) * 2  # an exact epilogue: the bound below still applies to out / 2

    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(8, 32, generator=g), torch.randn(32, 16, generator=g)
    torch._dynamo.reset()
    out = torch.compile(f, backend=aot_autograd(fw_compiler=keep))(a, b)
    assert out.dtype == torch.bfloat16
    assert within_bound(out / 2, a, b).max() <= 0
    mms = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert mms and all(x.meta["val"].dtype == torch.float32 for n in mms for x in n.args[:2])


def test_inductor_keeps_the_operand_rounding(emulated):
    """Compiled with inductor, the emulated GEMM equals the eager one bit for bit: inductor drops a BF16 round
    trip inside a fused kernel unless it emulates precision casts, and the GEMM then multiplies unrounded operands
    (here the product x * 1.0001 is fused with its rounding)."""
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x * 1.0001) @ w

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 64, generator=g), torch.randn(64, 32, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(f)(x, w)
    assert torch.equal(compiled, f(x, w))
    assert within_bound(compiled, x * 1.0001, w).max() <= 0


@pytest.mark.parametrize("env, isa, fast, expected", [
    ("native", None, False, "native"), ("fp32", None, True, "fp32"), ("", None, True, "native"),
    ("auto", "AVX2", True, "fp32"), ("auto", "AVX2_VNNI", True, "fp32"), ("auto", "AVX10_1_512", True, "native"),
    ("auto", "avx512_core_bf16", True, "native"), (None, None, False, "fp32"),
])
def test_mode_choice(monkeypatch, env, isa, fast, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: fast)
    monkeypatch.setattr(cpu_bf16.os, "uname", lambda: type("U", (), {"machine": "x86_64"})())
    for var, value in ((cpu_bf16.ENV_VAR, env), ("ONEDNN_MAX_CPU_ISA", isa), ("DNNL_MAX_CPU_ISA", None)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert cpu_bf16.decide_mode() == expected


def test_unknown_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_bf16.ENV_VAR, "bf16")
    decided = cpu_bf16.decided_at_import(cpu_bf16.decide_mode, cpu_bf16.CpuBf16ConfigError)
    assert decided is None  # a bad value is reported later, by the mode function
    monkeypatch.setattr(cpu_bf16, "_MODE", decided)
    with pytest.raises(cpu_bf16.CpuBf16ConfigError, match="MEGATRON_CPU_BF16_GEMM='bf16'.*native.*fp32"):
        cpu_bf16.cpu_bf16_gemm_mode()


@pytest.fixture
def gemms_native(monkeypatch):
    """BF16 GEMMs as torch runs them (no use_mode), with the attention kernel registered (what `install()` does)."""
    monkeypatch.setattr(cpu_bf16, "_MODE", "native")
    monkeypatch.setattr(cpu_bf16, "_forced", None)
    cpu_bf16._register((cpu_bf16._ATTENTION,))


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("mode, seq, fp32", [("auto", 16, True), ("fp32", 16, True), ("native", 16, False),
                                             ("auto", 2 * cpu_bf16.FP32_ATTENTION_MAX_WORK // 8, False),
                                             ("fp32", 2 * cpu_bf16.FP32_ATTENTION_MAX_WORK // 8, True)])
def test_training_attention_runs_in_fp32_on_rounded_operands_and_evaluation_in_bf16(gemms_native, monkeypatch, mode,
                                                                                     seq, fp32):
    """Where autograd differentiates it, CPU BF16 autocast attention is the FP32 kernel on the BF16-rounded q/k/v with
    its output rounded to BF16, forward and gradients bit for bit: under `auto` (the default) for sequence x head
    dim up to FP32_ATTENTION_MAX_WORK, under `fp32` at any length; under no_grad (evaluation) it is torch's BF16
    kernel. `native` keeps torch's BF16 kernel for training too."""
    monkeypatch.setattr(cpu_bf16, "_ATTENTION_MODE", mode)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, seq, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 1, seq, 8, generator=g, requires_grad=True) for _ in range(2))
    dy = torch.randn(1, 2, seq, 8, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _attention(q, k, v)
        with torch.no_grad():
            evaluated = _attention(q, k, v)
    out.backward(dy)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if fp32:
        ref = _attention(*(t.bfloat16().float() for t in leaves)).bfloat16()
    else:
        ref = _attention(*(t.bfloat16() for t in leaves))
    ref.backward(dy)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for mine, theirs in zip((q, k, v), leaves):
        assert torch.equal(mine.grad, theirs.grad)
    assert torch.equal(evaluated, _attention(*(t.detach().bfloat16() for t in (q, k, v))))
    if fp32:  # the control: the two kernels differ on these inputs
        assert not torch.equal(out, evaluated)


@pytest.mark.parametrize("env, expected", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("native", "native"),
                                           ("FP32", "fp32")])
def test_attention_mode_choice(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(cpu_bf16.ATTENTION_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cpu_bf16.ATTENTION_ENV_VAR, env)
    assert cpu_bf16.decide_attention_mode() == expected


def test_unknown_attention_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_bf16.ATTENTION_ENV_VAR, "bf16")
    monkeypatch.setattr(cpu_bf16, "_ATTENTION_MODE", None)
    with pytest.raises(cpu_bf16.CpuBf16ConfigError, match="MEGATRON_CPU_BF16_ATTENTION='bf16'.*native.*fp32"):
        cpu_bf16.cpu_bf16_attention_mode()


def test_compile_cache_keys_name_the_modes(monkeypatch):
    """The modes change what a compiled graph computes from the same traced code, so they are part of torch.compile's
    cache key (after the user's own tag): a graph cached in one mode is not loaded in another."""
    from torch.compiler import config

    with config.patch(cache_key_tag=config.cache_key_tag):  # restored after (monkeypatch would delete the entry)
        _check_cache_tags(monkeypatch, config)


def _check_cache_tags(monkeypatch, config) -> None:
    monkeypatch.setenv("TORCH_COMPILE_CACHE_KEY_TAG", "mine")
    monkeypatch.setattr(cpu_bf16, "_MODE", "native")
    monkeypatch.setattr(cpu_bf16, "_ATTENTION_MODE", "auto")
    monkeypatch.setattr(cpu_bf16, "_forced", None)
    assert cpu_bf16.tag_compile_cache() == "megatron-cpu-bf16:gemm=native,attention=auto"
    assert config.cache_key_tag == "mine|megatron-cpu-bf16:gemm=native,attention=auto"
    with cpu_bf16.use_mode("fp32"):
        assert config.cache_key_tag == "mine|megatron-cpu-bf16:gemm=fp32,attention=auto"
    assert config.cache_key_tag == "mine|megatron-cpu-bf16:gemm=native,attention=auto"
    monkeypatch.setattr(cpu_bf16, "_ATTENTION_MODE", "native")
    monkeypatch.delenv("TORCH_COMPILE_CACHE_KEY_TAG")
    cpu_bf16.tag_compile_cache()
    assert config.cache_key_tag == "megatron-cpu-bf16:gemm=native,attention=native"
