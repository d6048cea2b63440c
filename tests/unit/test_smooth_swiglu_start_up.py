"""Smooth-SwiGLU's channel form in eager blocks: the start-up compiles its channel maxima and scales once for every
shape (`smooth_swiglu.warm_up_channel_scales`), and the forward takes that graph instead of ~40 eager ops on
[F]-sized vectors and an eager column reduction. The same bits as the eager functions (max and powers of two are
exact); nothing compiles inside an iteration; tensor parallelism and compiled blocks keep the functions."""
from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import SmoothSwiGLUGranularity
from megatron.fp8 import cpu_gemm, fused
from megatron.model import smooth_swiglu
from megatron.model.smooth_swiglu import SmoothSwiGLU, channel_maxima, channel_split_scales

BF16 = torch.bfloat16


@pytest.fixture
def graphs(monkeypatch):
    """This test's own start-up graphs (other tests see none)."""
    made: dict = {}
    monkeypatch.setattr(smooth_swiglu, "_START_UP_GRAPHS", made)
    return made


def _fc1_out(shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 200.0  # an outlier channel
    x[0, 0, 5] = 0.0
    return x.to(BF16)


def _run(module: SmoothSwiGLU, fc1_out: torch.Tensor, fc2: nn.Linear) -> list[torch.Tensor]:
    """The output, fc1_out's gradient and fc2's weight gradient of one forward and backward."""
    x = fc1_out.clone().requires_grad_()
    fc2.weight.grad = None
    with torch.autocast("cpu", dtype=BF16):  # as --bf16 runs it: fc2's GEMM in BF16, its weight in fp32
        y = module(x, fc2)
    y.float().sum().backward()
    return [y.detach(), x.grad, fc2.weight.grad]


def test_the_start_up_graph_gives_the_functions_bits_and_compiles_nothing_later(graphs):
    from torch._dynamo.utils import counters

    fc2 = nn.Linear(48, 16, bias=False)
    module = SmoothSwiGLU(SmoothSwiGLUGranularity.CHANNEL)
    shapes = [(2, 8, 96), (3, 5, 96), (1, 40, 96)]
    reference = [_run(module, _fc1_out(s, i), fc2) for i, s in enumerate(shapes)]
    smooth_swiglu.warm_up_channel_scales(torch.device("cpu"), BF16)
    assert list(graphs) == [("cpu", BF16)]
    before = int(counters["stats"]["unique_graphs"])
    calls = []
    graph = graphs[("cpu", BF16)]
    graphs[("cpu", BF16)] = lambda h2d, split: calls.append(h2d.shape) or graph(h2d, split)
    for i, s in enumerate(shapes):
        for got, want in zip(_run(module, _fc1_out(s, i), fc2), reference[i]):
            assert torch.equal(got, want)
    assert calls == [(s[0] * s[1], s[2] // 2) for s in shapes]
    assert int(counters["stats"]["unique_graphs"]) == before  # every shape took the start-up's graph
    h = F.silu(_fc1_out(shapes[0], 0).float()[..., :48]).to(BF16)
    assert all(torch.equal(a, b) for a, b in zip(graph(h.reshape(-1, 48), module.split),
                                                  channel_split_scales(channel_maxima(h), module.split)))


def test_tensor_parallelism_keeps_the_functions(graphs, monkeypatch):
    """The split's scalars are max-reduced over the TP group between the maxima and the scales."""
    smooth_swiglu.warm_up_channel_scales(torch.device("cpu"), BF16)
    graphs[("cpu", BF16)] = lambda *args: pytest.fail("the start-up graph was taken with a TP group")
    reduced = []
    monkeypatch.setattr(smooth_swiglu, "_max_over_group", lambda values, group: reduced.append(group) or values)
    module = SmoothSwiGLU(SmoothSwiGLUGranularity.CHANNEL)
    module.tp_group = "tp"
    _run(module, _fc1_out((2, 8, 96), 0), nn.Linear(48, 16, bias=False))
    assert reduced and set(reduced) == {"tp"}


@pytest.mark.parametrize("switches,expected", [
    (("--torch-compile", "off"), True),
    (("--torch-compile", "on"), False),  # the blocks are compiled: Smooth-SwiGLU is traced into them
])
def test_the_start_up_line_names_the_channel_scales_where_blocks_run_eagerly(caplog, monkeypatch, graphs, switches,
                                                                              expected):
    from megatron.arguments import parse_config
    from megatron.training.parallelize import log_cpu_fp8_gemms
    from tests.support.config import tiny_argv

    monkeypatch.setattr(fused, "_warmed_up", set())
    monkeypatch.setattr(fused, "_eager_ready", set())
    argv = tiny_argv("--fp8-format", "hybrid", "--bf16", "--smooth-swiglu", *switches)
    with caplog.at_level(logging.INFO, logger="megatron"), cpu_gemm.use_mode("bf16"):
        log_cpu_fp8_gemms(parse_config(argv), torch.device("cpu"))
    line = caplog.records[-1].getMessage()
    also = r" \(and Smooth-SwiGLU's channel scales\)" if expected else ""
    assert re.fullmatch(rf"> torch.compile: the FP8 value conversions of the emulated GEMMs{also} compiled in "
                        r"[\d.]+ s, before the first iteration", line), line
    assert list(graphs) == ([("cpu", BF16)] if expected else [])
