"""The eager FP8 layer in the emulated backend's bf16 mode (megatron/fp8/cpu_gemm.py) casts each activation and
gradient straight to the values its BF16 GEMMs multiply (`fused.known_values`: one compiled pass for every shape,
made at start-up by `fused.warm_up_upcasts`), instead of making Q(x) that every GEMM then converts to BF16 again.

The values are the FP8 numbers themselves, so everything the layer computes is bitwise what the FP8 tensors gave:
the outputs, both gradients, the scaling state and the statistics."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron.fp8 import Fp8Linear, collect_fp8_stats, cpu_gemm, enable_fp8_stats, fp8_optimizer_step, fused
from megatron.fp8 import layer_state, per_tensor
from megatron.fp8 import stats as fp8_stats
from megatron.fp8 import quantize as quantize_module
from megatron.fp8.backends import EmulatedBackend
from megatron.fp8.formats import format_spec
from megatron.fp8.recipe import Fp8Recipe, Fp8Scaling

BF16 = torch.bfloat16


def _inputs(step: int) -> torch.Tensor:
    """bf16 activations with entries far below the rest (they flush to zero in E4M3) and, from the second step on,
    far above (clipped by the delayed scale of the first)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 64, generator=g)
    x[0, :6] = 1e-12
    if step:
        x[1, :3] = 1e4
    return x.to(BF16)


def _ready(monkeypatch, dtypes: set) -> None:
    """The values dtypes whose start-up graphs this process takes as made (`fused.warm_up_upcasts`)."""
    monkeypatch.setattr(fused, "_warmed_up", set(dtypes))
    monkeypatch.setattr(fused, "_eager_ready", set(dtypes))


def _warm_up_counts() -> None:
    e4m3, e5m2 = format_spec("e4m3"), format_spec("e5m2")
    fp8_stats.warm_up_eager_counts(torch.device("cpu"), BF16, {e4m3, e5m2}, {e4m3})


def _train(layer: Fp8Linear, monkeypatch, warmed: bool) -> tuple[list[torch.Tensor], dict, dict]:
    """Three steps of `layer` (delayed scaling: the first step's own scales, then the history's) in bf16 mode:
    the outputs and gradients, the statistics, and how often the GEMMs converted an FP8 activation or gradient, the
    layer made one, read one for its amax alone, or converted its FP8 weight in compiled code."""
    calls = {"upcast": 0, "fp8 activations": 0, "amax passes": 0, "compiled weight conversions": 0}
    real_upcast, real_quantize, real_amax = fused.upcast, EmulatedBackend.quantize, quantize_module.amax_of

    def upcast(q, dtype=torch.float32):
        calls["upcast"] += tuple(q.shape) != (48, 64)  # the weight's, once per step, is counted apart
        calls["compiled weight conversions"] += tuple(q.shape) == (48, 64)
        return real_upcast(q, dtype)

    def quantize(self, x, scale, spec, stochastic_rounding=False):
        calls["fp8 activations"] += x.shape[0] == 32  # the weights are [48, 64]
        return real_quantize(self, x, scale, spec, stochastic_rounding)

    def amax_of(x):
        calls["amax passes"] += x.shape[0] == 32
        return real_amax(x)

    monkeypatch.setattr(fused, "upcast", upcast)
    monkeypatch.setattr(layer_state, "amax_of", amax_of)
    monkeypatch.setattr(per_tensor, "amax_of", amax_of)
    monkeypatch.setattr(EmulatedBackend, "quantize", quantize)
    _ready(monkeypatch, {BF16} if warmed else set())
    monkeypatch.setattr(fp8_stats, "_EAGER_READY", set())
    if warmed:
        _warm_up_counts()
    enable_fp8_stats(layer, True)
    results = []
    with cpu_gemm.use_mode("bf16"):
        for step in range(3):
            x = _inputs(step).requires_grad_()
            with torch.autocast("cpu", dtype=BF16):
                y = layer(x)
            (y.float() * torch.linspace(-1, 1, 48)).sum().backward()
            results += [y.detach(), x.grad, layer.weight.grad.clone(), layer.fp8_scale.clone()]
            layer.weight.grad = None
            fp8_optimizer_step(layer)
    stats = collect_fp8_stats(layer)
    monkeypatch.undo()
    return results, stats, calls


@pytest.mark.isa_sensitive  # compiled graphs against the eager casts, bit for bit: CI reruns it with AVX2 kernels
@pytest.mark.parametrize("scaling", [Fp8Scaling.DELAYED, Fp8Scaling.TENSORWISE])
def test_the_eager_layers_values_pass_gives_the_fp8_tensors_results_bitwise_and_converts_nothing_again(
        monkeypatch, scaling):
    _ready(monkeypatch, set())  # other tests in this process keep the FP8 casts
    fused.warm_up_upcasts(torch.device("cpu"), BF16)  # (the graphs stay compiled; `_train` says which path runs)
    torch.manual_seed(0)
    layer = Fp8Linear(64, 48, bias=False, recipe=Fp8Recipe(scaling=scaling))
    reference, ref_stats, ref_calls = _train(copy.deepcopy(layer), monkeypatch, warmed=False)
    results, stats, calls = _train(layer, monkeypatch, warmed=True)
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got.dtype == want.dtype and torch.equal(got, want), (i % 4, i // 4)
    assert stats == ref_stats
    assert stats["fp8/input/flushed_frac"] > 0  # and clipping under delayed scaling, whose scale lags
    assert (stats["fp8/input/clipped_frac"] > 0) == (scaling is Fp8Scaling.DELAYED)
    # The FP8 path made Q(x) and Q(dy) at each step and converted them in each GEMM; the values path neither.
    assert ref_calls["fp8 activations"] == 6 and ref_calls["upcast"] > 0 and ref_calls["amax passes"] == 6
    # Under delayed scaling the history's scale does not wait for the amax, which the values pass then also gives
    # (every step after the first); a current scale needs the amax first.
    amax_passes = 2 if scaling is Fp8Scaling.DELAYED else 6
    assert calls == {"upcast": 0, "fp8 activations": 0, "amax passes": amax_passes, "compiled weight conversions": 3}
    assert ref_calls["compiled weight conversions"] == 0  # eager's element-by-element conversion before the warm-up


def test_outside_the_bf16_mode_or_before_the_warm_up_the_layer_casts_to_fp8(monkeypatch):
    """`known_values` answers None where no graph was made for the values dtype (exact mode's fp32, or no warm-up)
    or for an input dtype other than the warmed one: the caller then casts to FP8 as before."""
    x, scale = torch.randn(8, 16), torch.ones(())
    _ready(monkeypatch, set())
    assert fused.known_values(x.to(BF16), scale, 448.0, torch.float8_e4m3fn, BF16) is None
    fused.warm_up_upcasts(torch.device("cpu"), BF16)
    assert fused.known_values(x.to(BF16), scale, 448.0, torch.float8_e4m3fn, BF16) is not None
    assert fused.known_values(x, scale, 448.0, torch.float8_e4m3fn, BF16) is None  # fp32 input
    assert fused.known_values(x.to(BF16), scale, 448.0, torch.float8_e4m3fn, torch.float32) is None


def test_the_eager_layer_compiles_nothing_after_the_start_up(monkeypatch):
    """Called as a training step calls them (autocast on, autograd recording, an input that is a view of a 3-D
    activation, the scales rows of the layer's buffers, FP8 statistics on), the start-up's graphs serve every call: no
    compilation inside an iteration (the BF16 GEMMs apply their scales themselves: no epilogue graph)."""
    from torch._dynamo.utils import counters

    _ready(monkeypatch, set())
    monkeypatch.setattr(fp8_stats, "_EAGER_READY", set())
    fused.warm_up_upcasts(torch.device("cpu"), BF16)
    _warm_up_counts()
    graphs = int(counters["stats"]["unique_graphs"])
    torch.manual_seed(0)
    layer = Fp8Linear(64, 48, bias=False, recipe=Fp8Recipe(scaling=Fp8Scaling.DELAYED))
    enable_fp8_stats(layer, True)
    with cpu_gemm.use_mode("bf16"):
        for step in range(3):
            x = torch.randn(4, 8, 64, dtype=BF16, requires_grad=True)
            with torch.autocast("cpu", dtype=BF16):
                layer(x).float().sum().backward()
            fp8_optimizer_step(layer)
    assert layer.fp8.known_valid == (True, True, True)  # the steady state's path ran too
    assert int(counters["stats"]["unique_graphs"]) == graphs


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_the_start_up_compiles_the_eager_layers_graphs_where_they_run_eagerly(caplog, monkeypatch, compile_mode):
    """The FP8 layers run eagerly (`--torch-compile off`): the start-up also makes their casts and, with
    FP8 statistics, statistics pass. Compiled (`on`: fused quantization), it makes the GEMMs' conversions only."""
    import logging
    import re

    from megatron.arguments import parse_config
    from megatron.training.parallelize import log_cpu_fp8_gemms
    from tests.support.config import tiny_argv

    _ready(monkeypatch, set())
    monkeypatch.setattr(fp8_stats, "_EAGER_READY", set())
    argv = tiny_argv("--fp8-format", "hybrid", "--bf16", "--log-fp8-stats", "--torch-compile", compile_mode)
    with caplog.at_level(logging.INFO, logger="megatron"), cpu_gemm.use_mode("bf16"):
        log_cpu_fp8_gemms(parse_config(argv), torch.device("cpu"))
    line = caplog.records[-1].getMessage()
    eager = compile_mode == "off"
    also = r" \(and the eager FP8 layers' statistics\)" if eager else ""
    assert re.fullmatch(rf"> torch.compile: the FP8 value conversions of the emulated GEMMs{also} compiled in "
                        r"[\d.]+ s, before the first iteration", line), line
    e4m3, e5m2 = (fp8_stats.clip_threshold(format_spec(d)) for d in ("e4m3", "e5m2"))
    want = {(BF16, BF16, e4m3), (BF16, BF16, e5m2), (torch.float32, torch.uint8, e4m3)} if eager else set()
    assert fp8_stats._EAGER_READY == want
    assert fused._warmed_up == {BF16} and fused._eager_ready == ({BF16} if eager else set())


def test_inside_a_compiled_block_the_start_up_graphs_change_nothing_in_the_traced_graph(monkeypatch):
    """Traced into an enclosing graph (a compiled transformer block's backward upcasting a saved FP8 input), the
    functions inline their arithmetic as before the warm-up: no detach, grad-mode or autocast region enters the
    block's graph (such a region changed how inductor fused the block's kernels)."""
    import torch._dynamo

    def traced_ops(warmed: set) -> list:
        _ready(monkeypatch, warmed)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append([str(n.target) for n in gm.graph.nodes])
            return gm.forward

        def block(q, out, a_scale, b_scale):
            return fused.upcast(q, BF16).float().sum() + fused.scale_output(out, a_scale, b_scale, BF16, False).sum()

        torch._dynamo.reset()
        q = torch.randn(8, 16).to(torch.float8_e4m3fn)
        with torch.autocast("cpu", dtype=BF16):
            torch.compile(block, backend=backend, fullgraph=True)(q, torch.randn(8, 4, dtype=BF16), torch.ones(()),
                                                                  torch.full((), 2.0))
        return graphs

    assert traced_ops({BF16}) == traced_ops(set())
