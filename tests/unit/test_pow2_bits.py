"""Powers of two from the fp32 bit pattern (megatron/dtypes.py), which the power-of-two FP8 scales, MXFP8's E8M0
codes and Smooth-SwiGLU's scales use instead of frexp/ldexp: equal to torch's frexp/ldexp bit for bit over every
binade (subnormals, 0, inf, NaN included), with integer ops only."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.dtypes import exp2_int, frexp_fp32, ldexp_fp32


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    mantissas = torch.rand(20000, generator=g) + 0.5
    binades = torch.arange(-150, 128).repeat_interleave(72)[:20000].float()
    x = mantissas * torch.exp2(binades) * torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0)
    edges = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.4e-45, -1.4e-45, 1.1754942e-38, 1.17549435e-38,
             3.4028235e38, 448.0, 240.0, 57344.0, 0.5, 1.0, 2.0 ** -126, 2.0 ** -127]
    return torch.cat([x, torch.tensor(edges)]).float()


def test_frexp_is_torchs_bit_for_bit():
    x = _values()
    m, e = torch.frexp(x)
    m2, e2 = frexp_fp32(x)
    finite = ~x.isnan()
    assert torch.equal(m.view(torch.int32)[finite], m2.view(torch.int32)[finite]) and m2[~finite].isnan().all()
    assert e2.dtype == torch.int32 and torch.equal(e, e2)


def test_exp2_and_ldexp_are_torchs_bit_for_bit():
    k = torch.arange(-200, 200)
    assert torch.equal(exp2_int(k), torch.ldexp(torch.ones(k.shape), k.float()))
    x = _values()
    shifts = torch.randint(-126, 127, x.shape, generator=torch.Generator().manual_seed(1))
    want, got = torch.ldexp(x, shifts.float()), ldexp_fp32(x, shifts)
    assert torch.equal(want.view(torch.int32)[~want.isnan()], got.view(torch.int32)[~want.isnan()])


def test_only_integer_and_elementwise_ops():
    """No frexp, ldexp, log2 or pow: what any backend with int32 tensors runs."""
    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    x = _values()
    shifts = torch.arange(x.numel()) % 200 - 100
    with Record():
        frexp_fp32(x)
        ldexp_fp32(x, shifts)
    assert not seen & {"frexp", "ldexp", "log2", "pow", "exp2"}, seen
