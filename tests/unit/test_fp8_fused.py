"""The compiled FP8 quantization (megatron/fp8/fused.py) against its eager reference (quantize.py).

The fused functions perform the same fp32 operations as the eager ones (a multiply, a clamp, a cast with
round-to-nearest-even, the same `compute_scale`), so the comparisons are bitwise: FP8 tensors compared as
bytes (NaN as NaN), scales and amaxes exactly, and a 50-step training run loss for loss. Each distinct
shape compiles once (a few seconds on 2 cores), so the tests share shapes.
"""
from __future__ import annotations

import logging

import pytest
import torch

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear, Fp8Recipe, fp8_optimizer_step, fused, set_fused_quantization
from megatron.fp8.formats import Fp8Dtype, format_spec
from megatron.fp8.quantize import Tile, compute_scale, quantize, quantize_tiles
from megatron.training.fp8_hooks import Fp8Hooks
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.logs import LogLines

E4M3, E5M2 = format_spec(Fp8Dtype.E4M3), format_spec(Fp8Dtype.E5M2)


def _bytes(q: torch.Tensor) -> torch.Tensor:
    """The FP8 bit patterns, every NaN as one pattern (a NaN's sign bit carries nothing: the eager cast writes
    0x7F, the compiled one 0xFF, for the same NaN input)."""
    return torch.where(torch.isnan(q.float()), torch.full_like(q.view(torch.uint8), 0x7F), q.view(torch.uint8))


def _eager_tensor(x, previous, valid, delayed, spec, margin, pow2):
    amax = x.abs().amax().float()
    current = compute_scale(amax, spec.max, margin, pow2, previous=previous)
    scale = torch.where(valid, previous, current) if delayed else current
    return quantize(x, scale, spec), scale, amax


def _sample(dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-6, 3, 96)  # 9 binades across the columns
    return x.to(dtype)


@pytest.mark.parametrize("spec,delayed,valid,pow2", [
    (E4M3, False, False, False), (E5M2, True, True, False), (E4M3, True, False, True)])
def test_quantize_tensor_bitwise(spec, delayed, valid, pow2) -> None:
    x = _sample()
    previous = torch.tensor(0.37)  # a delayed scale that clips the large columns
    valid_t = torch.tensor(valid)
    q, values, scale, amax = fused.quantize_tensor(x, previous, valid_t, delayed, spec.max, 1, pow2,
                                                   spec.torch_dtype, torch.float32)
    q_ref, scale_ref, amax_ref = _eager_tensor(x, previous, valid_t, delayed, spec, 1, pow2)
    assert torch.equal(_bytes(q), _bytes(q_ref))
    assert torch.equal(values, q_ref.float())
    assert torch.equal(scale, scale_ref) and torch.equal(amax, amax_ref)


@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
def test_values_without_the_fp8_tensor_are_the_same_values(values_dtype) -> None:
    """`keep_q=False` (the emulated GEMMs' dy, whose FP8 tensor feeds nothing): no FP8 tensor is made, and the
    values, scale and amax are those of the full quantization."""
    x, previous, valid = _sample(), torch.tensor(0.37), torch.tensor(True)
    args = (x, previous, valid, True, E5M2.max, 0, False, E5M2.torch_dtype, values_dtype)
    q, values, scale, amax = fused.quantize_tensor(*args, keep_q=False)
    q_ref, values_ref, scale_ref, amax_ref = fused.quantize_tensor(*args)
    assert q is None and q_ref is not None
    assert torch.equal(values, values_ref) and torch.equal(values, q_ref.to(values_dtype))
    assert torch.equal(scale, scale_ref) and torch.equal(amax, amax_ref)


def test_nonfinite_inputs_match_eager() -> None:
    x = _sample()
    x[3, 5], x[7, 1] = float("inf"), float("nan")
    previous, valid = torch.tensor(2.0), torch.tensor(False)
    q, values, scale, amax = fused.quantize_tensor(x, previous, valid, False, E4M3.max, 0, False, E4M3.torch_dtype,
                                                   torch.bfloat16)
    q_ref, scale_ref, amax_ref = _eager_tensor(x, previous, valid, False, E4M3, 0, False)
    assert torch.equal(_bytes(q), _bytes(q_ref))  # NaN stays NaN, inf saturates, as eager
    # the GEMM's values (compiled: rounded in fp32 arithmetic, megatron/fp8/grid.py) too
    assert torch.equal(torch.isnan(values), torch.isnan(q_ref.float()))
    assert torch.equal(values.nan_to_num(), q_ref.to(torch.bfloat16).nan_to_num())
    assert torch.isnan(amax) and torch.isnan(amax_ref)
    assert torch.equal(scale, scale_ref) and scale.item() == 2.0  # the previous scale is kept


def test_known_scale_with_column_scale_bitwise() -> None:
    w = _sample(torch.float32)
    c = torch.logspace(-3, 3, 96)
    amax = fused.column_scaled_amax(fused.column_maxima(w), c)
    assert torch.equal(amax, (w * c).abs().amax())
    scale = compute_scale(amax, E4M3.max)
    q, values = fused.quantize_known(w, scale, E4M3.max, E4M3.torch_dtype, torch.bfloat16, column_scale=c)
    q_ref = quantize(w * c, scale, E4M3)
    assert torch.equal(_bytes(q), _bytes(q_ref)) and torch.equal(values, q_ref.to(torch.bfloat16))


@pytest.mark.parametrize("tile", [Tile(1, 32), Tile(32, 32)])
def test_tiles_bitwise(tile) -> None:
    x = _sample()[:, :80]  # ragged: 80 columns are not a multiple of 32
    got = fused.quantize_tiles(x, tile, E4M3, 0, tile.rows == 1)
    ref = quantize_tiles(x, tile, E4M3, 0, tile.rows == 1)
    assert torch.equal(_bytes(got.data), _bytes(ref.data))
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.amax, ref.amax)


def test_gemm_epilogue_bitwise() -> None:
    out = _sample(torch.float32) * 1e3
    a_scale, b_scale = torch.tensor(3.7), torch.tensor(0.011)  # not powers of two: the division rounds
    for dtype in (torch.bfloat16, torch.float32):
        got = fused.scale_output(out, a_scale, b_scale, dtype)
        assert torch.equal(got, (out / (a_scale * b_scale)).to(dtype))
        assert torch.equal(fused.scale_output(out, a_scale, b_scale, dtype, compiled=False), got)


def _linear_run(scaling: str, stats: bool, fused_quantization: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin = Fp8Linear(96, 64, bias=False, recipe=Fp8Recipe(scaling=scaling))
    lin.fp8.configure(stats_enabled=stats, fused_quantization=fused_quantization)
    x = _sample(torch.float32).requires_grad_(True)
    out = []
    for _ in range(3):  # the first step uses current amaxes, later ones the delayed scales
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        (y.float() * torch.linspace(-1, 1, 64)).square().sum().backward()
        out += [y.detach().float(), x.grad.clone(), lin.weight.grad.clone()]
        x.grad = lin.weight.grad = None
        fp8_optimizer_step(lin)
    out += [lin.fp8_amax_history.clone(), lin.fp8_scale.clone()]
    if stats:
        out += [lin.fp8.stats.counts.clone(), lin.fp8.stats.amax.clone()]
    return out


@pytest.mark.parametrize("scaling,stats", [("delayed", True), ("tensorwise", False)])
def test_fp8_linear_fused_equals_eager(scaling: str, stats: bool) -> None:
    eager = _linear_run(scaling, stats, False)
    compiled = _linear_run(scaling, stats, True)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def _mlp_losses(fused_quantization: bool, steps: int = 50) -> list[float]:
    """A tiny FP8 MLP (two 32x32 Fp8Linears, SiLU, delayed scaling) fitted with AdamW for `steps` steps."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Fp8Linear(32, 32, bias=False, recipe=Fp8Recipe()) for _ in range(2))
    assert set_fused_quantization(layers, fused_quantization) == 2
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layers[1](torch.nn.functional.silu(layers[0](x)))
        loss = (out.float() - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for layer in layers:
            fp8_optimizer_step(layer)
        losses.append(loss.item())
    return losses


def test_mlp_losses_fused_equal_eager_over_50_steps() -> None:
    """The issue asks for 1e-4 relative over 50 steps; bitwise-equal quantization gives equal losses, which is
    what is asserted (the full model through `pretrain` is the slow test below)."""
    eager = _mlp_losses(False)
    compiled = _mlp_losses(True)
    assert eager[-1] < 0.9 * eager[0]  # it trains
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled))
    assert worst == 0.0, f"largest relative loss difference {worst:.2e} (issue bound 1e-4)"


@pytest.mark.slow
def test_training_losses_fused_equal_eager_through_the_cli_default() -> None:
    """A tiny FP8 model (1 layer, Smooth-SwiGLU: every fused path) trained FUSED_MIN_ITERS (100) steps through
    `pretrain` with `--torch-compile off` and with the CPU default `auto`, which at that length compiles the FP8
    quantization and leaves the blocks eager: losses equal (~30 compilations of distinct operand shapes: ~40 s
    on 2 cores, hence slow)."""
    from megatron.model.compile import FUSED_MIN_ITERS

    def argv(mode: str) -> list[str]:
        return tiny_argv("--fp8-format", "hybrid", "--smooth-swiglu", "--torch-compile", mode, num_layers=1,
                         hidden_size=32, num_attention_heads=2, num_key_value_heads=1, seq_length=16,
                         micro_batch_size=2, global_batch_size=2, train_iters=FUSED_MIN_ITERS, eval_interval=1000,
                         eval_iters=0, log_interval=FUSED_MIN_ITERS)

    eager = pretrain(parse_config(argv("off"))).losses
    with LogLines() as handler:
        compiled = pretrain(parse_config(argv("auto"))).losses
    assert any("the FP8 quantization compiled in" in line for line in handler.lines), handler.lines[:20]
    assert len(eager) == len(compiled) == FUSED_MIN_ITERS
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled))
    assert worst == 0.0, f"largest relative loss difference {worst:.2e} (issue bound 1e-4)"


def test_fusion_is_per_model() -> None:
    """Two models in one process keep their own setting (it was a process-wide switch that a compiled training
    run left on for every later model)."""
    a, b = (torch.nn.Sequential(Fp8Linear(32, 32, bias=False), Fp8Linear(32, 32, bias=False)) for _ in range(2))
    assert set_fused_quantization(a, True) == 2
    assert all(m.fp8.fused_quantization for m in a) and not any(m.fp8.fused_quantization for m in b)
    assert set_fused_quantization(torch.nn.Linear(2, 2), True) == 0


def test_compile_failure_warns_once_and_falls_back(caplog) -> None:
    def data_dependent(x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # a host read: fullgraph compilation refuses it
            return x * 2
        return x

    wrapped = fused.CompiledOrEager(data_dependent)
    x = torch.ones(4)
    with caplog.at_level(logging.WARNING, logger="megatron.fp8.fused"):
        assert torch.equal(wrapped(x), x * 2)
        assert torch.equal(wrapped(x), x * 2)
    assert wrapped.failed
    assert sum("using the eager path" in r.getMessage() for r in caplog.records) == 1


def test_statistics_recorded_only_in_logging_iterations() -> None:
    config = parse_config(tiny_argv("--fp8-format", "hybrid", "--log-fp8-stats"))
    from megatron.model import GPTModel

    model = GPTModel(config.model)
    hooks = Fp8Hooks(model, config.fp8, None, stats=True)
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert all(m.fp8.stats_enabled for m in linears)  # the first iteration: its number is not known yet
    for iteration, next_logs in [(1, False), (3, False), (4, True), (5, False), (9, True)]:
        hooks.log_values(iteration, 5)
        assert all(m.fp8.stats_enabled is next_logs for m in linears), iteration


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_scaled_amax_from_column_maxima_is_the_full_pass_bitwise(dtype) -> None:
    """max |W diag(c)| from W's column maxima (a [K] product) equals the reduction of the whole product, bit for
    bit, over many draws with signs, wide exponent ranges and rounding-sensitive scales; an inf or NaN in W
    still reaches the amax."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        w = (torch.randn(37, 53, generator=gen) * torch.exp2(torch.randint(-20, 20, (37, 53), generator=gen))).to(dtype)
        c = (torch.rand(53, generator=gen) + 0.5) * torch.exp2(torch.randint(-8, 8, (53,), generator=gen).float())
        c = torch.where(torch.rand(53, generator=gen) < 0.1, -c, c)
        full = (w.float() * c).abs().amax()
        assert torch.equal(fused.column_scaled_amax(fused.column_maxima(w), c), full)
    w = torch.ones(4, 3, dtype=dtype)
    w[1, 2] = float("inf")
    assert fused.column_scaled_amax(fused.column_maxima(w), torch.ones(3)).isinf()
    w[2, 0] = float("nan")
    assert fused.column_scaled_amax(fused.column_maxima(w), torch.ones(3)).isnan()


def test_a_dynamic_graph_compiled_on_a_small_input_runs_its_loops_on_every_thread() -> None:
    """Inductor's C++ code decides at compile time whether a loop runs in parallel, from the size it compiles
    for: a dynamic graph (Fp8AdamW's update, the FP8 upcasts) warmed up on a small input ran every later call, of
    any size, on one core, and its on-disk cache entry is not keyed on that size. `CompiledOrEager` compiles its
    dynamic graphs with `cpp.dynamic_threads`: each loop an OpenMP region, its threads decided when it runs."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with inductor_config.patch(fx_graph_cache=False):
            wrapped = fused.CompiledOrEager(lambda x: x * 3.0 + 1.0, "a test function", dynamic=True)
            out, code = run_and_get_code(wrapped, torch.arange(8.0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, torch.arange(8.0) * 3.0 + 1.0)
    assert "#pragma omp parallel" in "\n".join(code)
