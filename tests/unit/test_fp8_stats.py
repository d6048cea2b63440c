"""FP8 statistics: off by default, clipped / flushed fractions, inf/NaN counts, reset, worst layer."""
from __future__ import annotations

import pytest
import torch

from megatron.fp8 import Fp8Recipe, collect_fp8_stats, convert_to_fp8, enable_fp8_stats, fp8_optimizer_step, \
    worst_fp8_layer
from tests.support.fp8_reference import TinyGPT

FC1 = "decoder.layers.0.mlp.linear_fc1"
QKV = "decoder.layers.1.self_attention.linear_qkv"


def _model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT()
    convert_to_fp8(model, Fp8Recipe())
    return model


def test_disabled_by_default_and_no_buffers() -> None:
    model = _model()
    model(torch.randint(0, 128, (2, 16))).sum().backward()
    assert collect_fp8_stats(model) == {}
    assert model.decoder.layers[0].mlp.linear_fc1.fp8.stats is None  # nothing was even allocated


def test_clipping_flushing_and_nonfinite_counts() -> None:
    model = _model()
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    enable_fp8_stats(model)
    x = torch.randn(4, 64)
    fc1(x)
    fp8_optimizer_step(model)  # the delayed input scale now fits |x| <= amax(x)
    stats = collect_fp8_stats(model)
    assert stats[f"fp8/{FC1}/input/clipped_frac"] == 0.0
    assert stats[f"fp8/{FC1}/weight/amax"] == fc1.weight.abs().max().item()
    # 1 huge outlier (clips), 1e-9-scale values (flush to zero), one inf, one NaN.
    y = x.clone()
    y[0, 0] = 1e4
    y[1] = 1e-9
    y[2, 0] = float("inf")
    y[3, 0] = float("nan")
    fc1(y)
    stats = collect_fp8_stats(model)
    n = y.numel()
    assert stats[f"fp8/{FC1}/input/clipped_frac"] == 2 / n  # the outlier and the inf
    assert stats[f"fp8/{FC1}/input/flushed_frac"] == 64 / n
    assert stats[f"fp8/{FC1}/input/inf_count"] == 1 and stats[f"fp8/{FC1}/input/nan_count"] == 1
    assert stats[f"fp8/{FC1}/input/scale"] == fc1.fp8_scale[0].item()
    # Reset on read; layers that did not run are absent.
    assert collect_fp8_stats(model) == {}


def test_every_role_of_every_layer_and_worst_layer() -> None:
    model = _model()
    enable_fp8_stats(model)
    model(torch.randint(0, 128, (2, 16))).square().mean().backward()
    stats = collect_fp8_stats(model, reset=False)
    roles = {k.split("/")[2] for k in stats}
    assert roles == {"input", "weight", "grad_output"}
    assert len({k.split("/")[1] for k in stats}) == 8
    assert worst_fp8_layer(stats) is not None and worst_fp8_layer({}) is None
    stats[f"fp8/{QKV}/grad_output/clipped_frac"] = 0.25
    assert worst_fp8_layer(stats) == (f"{QKV}/grad_output", 0.25)
    enable_fp8_stats(model, False)
    collect_fp8_stats(model)
    model(torch.randint(0, 128, (2, 16)))
    assert collect_fp8_stats(model) == {}


def test_the_compiled_statistics_pass_counts_what_the_eager_one_counts() -> None:
    """With fused quantization (--torch-compile) one compiled pass records a per-tensor quantization's statistics:
    the same counts and amax as the eager pass (integer counts and a max: exact), for fp32 and bf16 tensors, E4M3
    and E5M2, with outliers, values that flush, infs and NaNs, and two shapes through one dynamic-shape kernel."""
    from megatron.fp8.formats import format_spec
    from megatron.fp8.quantize import quantize
    from megatron.fp8.stats import _FUSED_COUNTS, Fp8Stats

    torch.manual_seed(3)
    for dtype, fmt, shape in ((torch.float32, "e4m3", (48, 64)), (torch.bfloat16, "e5m2", (32, 80))):
        spec = format_spec(fmt)
        t = (torch.randn(shape) * 3).to(dtype)
        t[0, :5] = torch.tensor([1e5, -1e5, 1e-9, float("inf"), float("nan")]).to(dtype)
        t[1, :7] = 0
        scale = torch.tensor(spec.max / 20.0)
        q = quantize(t.float().nan_to_num(posinf=0.0), scale, spec)
        eager, fused = Fp8Stats(3, t.device), Fp8Stats(3, t.device)
        eager.record(1, t, q, scale, spec)
        fused.record(1, t, q, scale, spec, fused=True)
        assert torch.equal(eager.counts, fused.counts), (dtype, eager.counts, fused.counts)
        assert torch.equal(eager.amax.nan_to_num(), fused.amax.nan_to_num()) and torch.equal(eager.scale, fused.scale)
        assert eager.counts[1, 0] >= 3 and eager.counts[1, 1] >= 1 and eager.counts[1, 2] == 1  # clipped, flushed, NaN
    assert _FUSED_COUNTS.compiled is not None and not _FUSED_COUNTS.failed  # compiled, no fallback to eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_counts_are_isnan_and_isinf_eagerly_and_compiled(dtype) -> None:
    """`count_nonfinite` tests NaN as x != x and inf as |x| == inf (comparisons inductor vectorizes): the counts of
    torch.isnan and torch.isinf, with +-inf, NaN, the format's largest finite values, zeros and subnormals."""
    from megatron.fp8.quantize import count_nonfinite

    info = torch.finfo(dtype)
    x = torch.randn(37, 41).to(dtype)
    specials = [float("nan"), float("inf"), -float("inf"), info.max, -info.max, 0.0, -0.0, info.tiny / 4]
    x.view(-1)[:len(specials) * 3:3] = torch.tensor(specials).to(dtype)
    assert (int(torch.isnan(x).sum()), int(torch.isinf(x).sum())) == (1, 2)
    compiled = torch.compile(count_nonfinite, dynamic=True, fullgraph=True)
    for t in (x, x[:5, :7], x[3:, 2:]):  # shapes through one dynamic graph
        want = (int(torch.isnan(t).sum()), int(torch.isinf(t).sum()))
        assert tuple(int(c) for c in count_nonfinite(t)) == want
        assert tuple(int(c) for c in compiled(t)) == want


@pytest.mark.parametrize("int32_below", [2**31, 0])
def test_one_quantizations_row_is_its_counts_numel_and_one(monkeypatch, int32_below) -> None:
    """The statistics pass returns the whole row one quantization adds ([clipped, flushed, nan, inf, numel, clipped
    tensors, quantizations]); its counts summed in int32 below `_INT32_COUNTS_BELOW` elements, in int64 above (here
    forced for every size): the same row either way, eagerly and compiled."""
    from megatron.fp8 import stats as stats_module
    from megatron.fp8.formats import format_spec
    from megatron.fp8.quantize import quantize

    monkeypatch.setattr(stats_module, "_INT32_COUNTS_BELOW", int32_below)
    spec = format_spec("e4m3")
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(40, 24, generator=g) * 3).to(torch.bfloat16)
    t[0, :6] = torch.tensor([1e5, -1e5, 1e-9, float("inf"), -float("inf"), float("nan")]).to(torch.bfloat16)
    scale = torch.tensor(spec.max / 20.0)
    q = quantize(t.float().nan_to_num(posinf=0.0, neginf=0.0), scale, spec)
    zero_source, byte_zero = stats_module._zero_source(q)
    y = t.float() * scale
    clipped = int((y.abs() > stats_module.clip_threshold(spec)).sum())
    flushed = int(((t != 0) & (q.view(torch.uint8) & 0x7F == 0)).sum())
    want = [clipped, flushed, 1, 2, t.numel(), 1, 1]
    assert clipped >= 2 and flushed >= 1
    eager = stats_module._per_tensor_counts(t, zero_source, scale, stats_module.clip_threshold(spec), byte_zero)
    torch._dynamo.reset()
    compiled = torch.compile(stats_module._per_tensor_counts, dynamic=True, fullgraph=True)(
        t, zero_source, scale, stats_module.clip_threshold(spec), byte_zero)
    for counts, _ in (eager, compiled):
        assert counts.dtype == torch.int64 and counts.tolist() == want
