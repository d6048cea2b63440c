"""megatron/fp8/cat_casts.py: the FP8 cast and amax of a concatenation, made on its parts, give the same bits (the
compiled block's backward is checked in test_fp8_traced_graph.py)."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from megatron.fp8.cat_casts import CastThroughCat
from megatron.fp8.fused import _quantize_tensor
from tests.support.fp8_traced import amaxes_reading_a_cat

E5M2, E5M2_MAX = torch.float8_e5m2, 57344.0
AMAX = torch.ops.aten.amax.default


def _swiglu_grad_cast(y, dh, scale, valid, *, known_valid=True):
    """SwiGLU's backward into [gate | up] (a concatenation), then dy's fused cast as fc1's traced backward makes it."""
    gate, up = y.float().chunk(2, -1)
    s = torch.sigmoid(gate)
    g_gate = (dh.float() * up * s * (1 + gate * (1 - s))).to(torch.bfloat16)
    g_up = (dh.float() * gate * s).to(torch.bfloat16)
    dy = torch.cat([g_gate, g_up], -1)
    _, values, used, amax = _quantize_tensor(dy, scale, valid, True, E5M2_MAX, 0, False, E5M2, torch.bfloat16,
                                             known_valid, False)
    return values, used, amax


def _graph(fn, *args):
    """`fn` as inductor's post-grad graphs spell it (decomposed aten ops with fake values)."""
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _inputs(special: bool):
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(24, 64, generator=g) * 3).bfloat16()
    dh = (torch.randn(24, 32, generator=g) * 2.0 ** torch.randint(-20, 12, (24, 32), generator=g)).bfloat16()
    if special:  # beyond E5M2's range once scaled, -0, an inf and a NaN
        dh[0, :4] = torch.tensor([1e30, -1e30, -0.0, float("inf")])
        dh[3, 5] = float("nan")
    return y, dh, torch.tensor(4.0), torch.tensor(True)


@pytest.mark.parametrize("known_valid", [True, False])
@pytest.mark.parametrize("special", [False, True])
def test_cast_and_amax_on_the_parts_give_the_same_bits(known_valid, special):
    """The rewritten graph's values, scale and amax equal the original graph's bit for bit (NaN as NaN), with the
    history's scale and with the scale waiting for the amax (the first step); no amax reads the concatenation."""
    args = _inputs(special)
    fn = lambda *a: _swiglu_grad_cast(*a, known_valid=known_valid)  # noqa: E731
    original, rewritten = _graph(fn, *args), _graph(fn, *args)
    CastThroughCat()(rewritten.graph)
    rewritten.recompile()
    assert [n for n in rewritten.graph.nodes if n.target is AMAX] and amaxes_reading_a_cat(rewritten.graph) == 0
    assert amaxes_reading_a_cat(original.graph) == 1  # control: the pass did it
    for want, got in zip(original(*args), rewritten(*args)):
        assert want.dtype == got.dtype
        assert torch.equal(want.view(torch.int16) if want.dtype == torch.bfloat16 else want,
                           got.view(torch.int16) if got.dtype == torch.bfloat16 else got) or \
            (want.isnan().all() and got.isnan().all()), (want, got)


def _unchanged(fn, *args) -> bool:
    gm = _graph(fn, *args)
    before = [n.target for n in gm.graph.nodes]
    CastThroughCat()(gm.graph)
    return [n.target for n in gm.graph.nodes] == before


def test_a_concatenation_read_with_another_tensor_of_views_or_off_the_cpu_is_left_alone():
    """A pointwise reader that also reads a full tensor from elsewhere (a residual) keeps the concatenation; so do
    parts that no pointwise op makes (views, inputs), and a graph on another device than the CPU (here `meta`); the
    same cast and amax of pointwise parts on CPU is the control."""
    def with_residual(a, b, r):
        c = torch.cat([a * 2, b * 2], -1) + r
        return c.abs().amax(), c * 2

    def cast(a, b):
        c = torch.cat([a * 2, b * 2], -1)
        return c.abs().amax(), c * 2

    def cast_of_views(a, b):
        c = torch.cat([a.t(), b.t()], -1)
        return c.abs().amax(), c * 2

    assert _unchanged(with_residual, torch.randn(4, 3), torch.randn(4, 5), torch.randn(4, 8))
    assert _unchanged(cast_of_views, torch.randn(3, 4), torch.randn(5, 4))
    assert _unchanged(cast, torch.randn(4, 3, device="meta"), torch.randn(4, 5, device="meta"))
    assert not _unchanged(cast, torch.randn(4, 3), torch.randn(4, 5))
