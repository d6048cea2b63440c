"""Fp8AdamW's one-call update (`fp8_adam._tensor_step`): a tensor with per-tensor scales that is one chunk takes both
passes (the parameter and the new moments' amaxes, then the moments quantized with them) in one call instead of two.
The bits are those of the two passes, eagerly and compiled; the warm-up compiles the path each parameter takes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.optimizer import fp8_adam
from megatron.optimizer.fp8_adam import Fp8AdamW
from megatron.optimizer.fp8_adam_warmup import _variants, warm_up_fp8_adam

_KEYS = ("exp_avg", "exp_avg_scale_inv", "exp_avg_sq", "exp_avg_sq_scale_inv")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _steps(one_call: bool, compile: bool, monkeypatch, steps: int = 3) -> tuple[list[torch.Tensor], dict]:
    """`steps` updates of one 64 x 48 matrix (stochastic rounding of v on, per-tensor scales) on the path asked for:
    the bits of the weight and of every moment tensor after each step, and the calls of each path."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 48))
    opt = Fp8AdamW([w], lr=1e-2, compile=compile)
    monkeypatch.setattr(opt, "one_call", lambda numel, device, fmts: one_call)
    calls = {"one call": 0, "by chunks": 0}
    call, call_tensor = opt._call, opt._call_tensor

    def by_chunks(*args):
        calls["by chunks"] += 1
        return call(*args)

    def whole(*args):
        calls["one call"] += 1
        return call_tensor(*args)

    monkeypatch.setattr(opt, "_call", by_chunks)
    monkeypatch.setattr(opt, "_call_tensor", whole)
    g = torch.Generator().manual_seed(1)
    bits = []
    for _ in range(steps):
        w.grad = torch.randn(64, 48, generator=g)
        opt.step()
        bits += [_bits(w)] + [_bits(opt.state[w][k]) for k in _KEYS]
    if compile and opt.runs_eager:
        pytest.skip("torch.compile is unavailable here (Fp8AdamW fell back to eager)")
    return bits, calls


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.isa_sensitive)])  # compiled: bitwise
def test_one_call_gives_the_two_passes_bits(monkeypatch, compile):
    reference, ref_calls = _steps(False, compile, monkeypatch)
    got, calls = _steps(True, compile, monkeypatch)
    assert ref_calls == {"one call": 0, "by chunks": 6} and calls == {"one call": 3, "by chunks": 0}
    for i, (a, b) in enumerate(zip(got, reference)):
        assert torch.equal(a, b), (i // 5, ("weight",) + _KEYS)[i % 5]


def test_which_tensors_take_one_call(monkeypatch):
    """Per-tensor scales, one chunk, no shard group; blockwise scales already take one pass per chunk."""
    monkeypatch.setattr(fp8_adam, "_CHUNK", 512)
    w = nn.Parameter(torch.randn(16, 16))
    cpu = torch.device("cpu")
    opt = Fp8AdamW([w])
    fmts = (opt.m_format, opt.v_format)
    assert opt.one_call(512, cpu, fmts) and not opt.one_call(513, cpu, fmts)
    blockwise = Fp8AdamW([w], block_size=128)
    assert not blockwise.one_call(256, cpu, (blockwise.m_format, blockwise.v_format))
    opt.shard_group = object()  # FSDP2: the amaxes are max-reduced between the passes
    assert not opt.one_call(256, cpu, fmts)


def test_the_warm_up_compiles_each_path_the_parameters_take(monkeypatch):
    """A small matrix takes one call, a large one (more than a chunk) the passes by chunks: the warm-up compiles
    both, and the steps compile nothing. Parameters that FSDP2 will shard (its engine sets the shard group after the
    warm-up) take the passes by chunks."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(fp8_adam, "_CHUNK", 512)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 100))  # 8 x 16: one chunk; 100 x 8 = 800: two
    opt = Fp8AdamW(model.parameters(), lr=1e-2, compile=True)
    assert [paths for _, paths in _variants(opt, sharded=False).values()] == [{True, False}]
    assert [paths for _, paths in _variants(opt, sharded=True).values()] == [{False}]
    if warm_up_fp8_adam(opt) is None:
        pytest.skip("torch.compile is unavailable here (Fp8AdamW fell back to eager)")
    frames = int(counters["frames"]["total"])
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
    assert int(counters["frames"]["total"]) == frames


@pytest.mark.parametrize("m_dtype,v_dtype", [("e4m3", "e5m2"), ("fp32", "e5m2"), ("e4m3", "bf16"), ("bf16", "e4m3")])
def test_one_call_keeps_its_outputs_as_the_new_moments(monkeypatch, m_dtype, v_dtype):
    """The one call's outputs become the moments themselves (no copy into fresh tensors), in the layout the passes
    by chunks store (`_new_moment`'s shape, dtype and scale shape), with the same bits."""
    results = {}
    for one_call in (False, True):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(24, 40))
        opt = Fp8AdamW([w], lr=1e-2, m_dtype=m_dtype, v_dtype=v_dtype, compile=False)
        monkeypatch.setattr(opt, "one_call", lambda numel, device, fmts, flag=one_call: flag)
        outputs = []
        call_tensor = opt._call_tensor
        monkeypatch.setattr(opt, "_call_tensor", lambda *args: outputs.append(call_tensor(*args)) or outputs[-1])
        for step in range(2):
            w.grad = torch.randn(24, 40, generator=torch.Generator().manual_seed(step))
            opt.step()
        state = opt.state[w]
        results[one_call] = {k: state[k] for k in _KEYS if k in state}
        if one_call:
            stored = [t for t in outputs[-1][0::2]]
            assert [state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr()] == [t.data_ptr() for t in stored]
    assert results[True].keys() == results[False].keys()
    for key, chunked in results[False].items():
        kept = results[True][key]
        assert (kept.shape, kept.dtype, kept.is_contiguous()) == (chunked.shape, chunked.dtype, True), key
        assert torch.equal(_bits(kept), _bits(chunked)), key


@pytest.mark.isa_sensitive  # two compiled kernels compared bit for bit
def test_on_cpu_one_call_takes_the_direct_graph_with_torch_compiles_bits():
    """Compiled, on the CPU, a tensor updated in one call runs a direct graph (megatron/fp8/direct.py), one for
    every size, built by the warm-up: no dynamo guards or AOTAutograd wrappers per parameter and step. Its bits are
    those of torch.compile's graph (`direct_calls` False) over three steps, for matrices of several shapes (a
    square one first), and the steps compile nothing, neither a direct graph nor a dynamo frame."""
    from torch._dynamo.utils import counters

    shapes = [(40, 40), (64, 48), (7, 9), (33, 2)]
    runs = []
    for direct_calls in (True, False):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(*s)) for s in shapes]
        opt = Fp8AdamW(params, lr=1e-2, compile=True)
        opt.direct_calls = direct_calls
        if warm_up_fp8_adam(opt) is None:
            pytest.skip("torch.compile is unavailable here (Fp8AdamW fell back to eager)")
        built, frames = len(fp8_adam._DIRECT._graphs), int(counters["frames"]["total"])
        g = torch.Generator().manual_seed(1)
        bits = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            bits += [_bits(p) for p in params] + [_bits(opt.state[p][k]) for p in params for k in _KEYS]
        assert len(fp8_adam._DIRECT._graphs) == built and int(counters["frames"]["total"]) == frames
        runs.append(bits)
    if fp8_adam._tensor_step_direct not in fp8_adam._DIRECT:
        pytest.skip("this torch has no torch._inductor.standalone_compile: every call takes torch.compile's graph")
    assert all(torch.equal(a, b) for a, b in zip(*runs))
