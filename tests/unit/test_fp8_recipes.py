"""Fine-grained FP8 recipes (rowwise, blockwise, mxfp8) beside tensorwise and delayed.

Quantization against an independent float64 reference (tile amaxes, scales, the half-ulp rounding bound);
the MXFP8 exponent rule (no block clips, where the OCP spec's floor rule does); the layer's three GEMMs against
a float64 composition of the tile layouts each GEMM must use (with the wrong wgrad layout as negative
control); SQNR per recipe on Gaussian, heavy-tailed and K-outlier inputs; backends, TP validation, statistics
and checkpoints; each recipe training through the CLI tracking BF16. TP=2 tracking TP=1 per recipe (2 spawned
processes) is in tests/e2e/test_fp8_recipes_launch.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear, Fp8Recipe, Fp8Scaling, fp8_optimizer_step, fp8_state_dict, load_fp8_state_dict
from megatron.fp8 import collect_fp8_stats, enable_fp8_stats
from megatron.fp8 import stats as fp8_stats
from megatron.fp8.accuracy import fprop_operands, recipe_specs, wgrad_layout_sqnr
from megatron.fp8.backends import CudaScaledMmBackend, EmulatedBackend, select_backend
from megatron.fp8.formats import format_spec
from megatron.fp8.quantize import Tile, compute_scale, dequantize_tiles, from_e8m0, quantize_tiles, to_e8m0
from megatron.fp8.stats import sqnr_db
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.flags import FINE_RECIPES as FINE
from tests.support.training import assert_resume_is_exact

E4M3, E5M2 = format_spec("e4m3"), format_spec("e5m2")


def _reference_tiles(x: torch.Tensor, tile: Tile, spec, pow2: bool):
    """Per element, in float64 by explicit loops over the tile grid: the tile's scale."""
    rows, cols = x.shape
    r, c = (tile.rows or rows), (tile.cols or cols)
    scale = torch.empty(rows, cols, dtype=torch.float64)
    x64 = x.double()
    for i in range(0, rows, r):
        for j in range(0, cols, c):
            amax = float(x64[i:i + r, j:j + c].abs().max())
            s = spec.max / amax if amax > 0 else 1.0
            if pow2 and amax > 0:
                s = 2.0 ** math.floor(math.log2(s))
                # float64 log2 may also round onto the binade edge: the largest power of two that fits.
                while amax * s > spec.max:
                    s /= 2
            scale[i:i + r, j:j + c] = s
    return scale


def _half_ulp(y: torch.Tensor, spec) -> torch.Tensor:
    """Half the FP8 grid spacing at |y| (float64), subnormals included."""
    a = y.abs().clamp_min(spec.min_normal)
    return torch.exp2(torch.floor(torch.log2(a)) - spec.mantissa_bits).clamp_min(spec.min_subnormal) / 2


@pytest.mark.parametrize("tile", [Tile(1, 0), Tile(1, 128), Tile(128, 128), Tile(1, 32), Tile(0, 0)],
                         ids=["rowwise", "1x128", "128x128", "1x32", "tensor"])
@pytest.mark.parametrize("spec", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
def test_round_trip_within_half_ulp_of_its_tile_scale(tile, spec, pow2):
    g = torch.Generator().manual_seed(0)
    # Ragged shapes (partial tiles at both edges), magnitudes spread over 8 binades by row and column.
    x = torch.randn(200, 300, generator=g) * torch.exp2(torch.randint(-4, 4, (200, 1), generator=g).float()) \
        * torch.exp2(torch.randint(-4, 4, (1, 300), generator=g).float())
    x[5, :] = 0  # zero tiles keep scale 1 and stay 0
    q = quantize_tiles(x, tile, spec, power_of_two=pow2)
    ref_scale = _reference_tiles(x, tile, spec, pow2)
    r, c = tile.resolve(tuple(x.shape))
    got_scale = q.scale.double().repeat_interleave(r, 0).repeat_interleave(c, 1)[:200, :300]
    assert torch.allclose(got_scale, ref_scale, rtol=2.0**-23, atol=0)
    back = dequantize_tiles(q).double()
    bound = _half_ulp(x.double() * ref_scale, spec) / ref_scale
    if not pow2:  # the fp32 division of the dequantization rounds once more
        bound = bound + x.double().abs() * 2.0**-23
    assert (back - x.double()).abs().le(bound).all()
    assert (back[5] == 0).all()


def test_mxfp8_exponent_never_clips_where_the_spec_floor_does():
    """Blocks whose amax mantissa lies above 448's (1.75 x 2^8): the OCP rule X = 2^(floor(log2 amax) - 8)
    maps the amax to 1.9 x 256 = 486 > 448 (clipped); ours rounds the exponent up, to <= 448."""
    g = torch.Generator().manual_seed(1)
    exps = torch.randint(-20, 20, (64,), generator=g).float()
    blocks = torch.rand(64, 32, generator=g) * torch.exp2(exps)[:, None]
    blocks[:, 0] = 1.9 * torch.exp2(exps)  # the amax, mantissa 1.9 > 1.75
    q = quantize_tiles(blocks, Tile(1, 32), E4M3, power_of_two=True)
    amax = blocks.double().abs().amax(dim=1)
    ours = amax * q.scale.double().squeeze(1)
    assert ours.le(448).all() and ours.gt(224).all()  # no clip, and within one binade of the range
    spec_scale = torch.exp2(8 - torch.floor(torch.log2(amax)))
    assert (amax * spec_scale).gt(448).all()  # negative control: the spec's floor clips every such block
    # Random blocks over a wide range: none clips, every E8M0 scale is a power of two inside 2^-127..2^127.
    x = torch.randn(512, 1024, generator=g) * torch.exp2(torch.randint(-30, 30, (512, 1), generator=g).float())
    q = quantize_tiles(x, Tile(1, 32), E4M3, power_of_two=True)
    scaled = x.double().reshape(512, 32, 32) * q.scale.double()[:, :, None]
    assert scaled.abs().le(448).all()
    m, _ = torch.frexp(q.scale)
    assert (m == 0.5).all() and q.scale.ge(2.0**-127).all() and q.scale.le(2.0**127).all()


def test_e8m0_bytes_round_trip_and_mxfp8_saves_them():
    scales = torch.cat([torch.exp2(torch.arange(-127, 128, dtype=torch.float32)), torch.tensor([float("nan")])])
    codes = to_e8m0(scales)
    assert codes.dtype == torch.uint8 and codes[-1] == 255 and codes[:-1].tolist() == list(range(254, -1, -1))
    assert torch.equal(from_e8m0(codes)[:-1], scales[:-1]) and torch.isnan(from_e8m0(codes)[-1])
    saved = []
    layer = Fp8Linear(64, 32, bias=False, recipe=Fp8Recipe(scaling="mxfp8"))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(40, 64, requires_grad=True))
    assert [t.dtype for t in saved[:2]] == [torch.float8_e4m3fn, torch.uint8]  # x^T and one byte per tile
    assert saved[1].shape == (64, 2)  # 64 rows of x^T, 40 tokens in two 1x32 tiles


def test_power_of_two_scale_is_exact_at_binade_edges():
    """amax values one fp32 ulp around target / 2^k, where fp32 division and log2 round across the edge."""
    k = torch.arange(-30, 30, dtype=torch.float32)
    edge = 448.0 * torch.exp2(k)
    amax = torch.cat([torch.nextafter(edge, torch.zeros_like(edge)), edge, torch.nextafter(edge, edge * 2)])
    s = compute_scale(amax, 448.0, power_of_two=True)
    product = amax.double() * s.double()
    assert product.le(448).all() and product.gt(224).all()


def _layer_case(scaling: str, backend: str = "emulated"):
    torch.manual_seed(0)
    layer = Fp8Linear(192, 160, bias=False, recipe=Fp8Recipe(scaling=scaling, backend=backend))
    x = torch.randn(3, 50, 192, requires_grad=True)  # 150 tokens: partial tiles along the tokens too
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    return layer, x, y, dy


@pytest.mark.parametrize("scaling", FINE)
def test_layer_gemms_use_the_tiles_of_their_contraction_axis(scaling):
    """y, dx and dW equal float64 products of the operands quantized along each GEMM's contraction axis:
    fprop along K, dgrad along N (W^T; blockwise transposes its square blocks), wgrad along the tokens (x^T,
    the saved second layout). Negative control: x's fprop layout (along K) gives another dW."""
    layer, x, y, dy = _layer_case(scaling)
    recipe = layer.fp8.recipe
    act, wt = recipe.tiles
    e4m3, _, grad = recipe_specs(recipe)
    x2, dy2, w = x.detach().reshape(-1, 192), dy.reshape(-1, 160), layer.weight.detach()

    def fq(t, tile, spec):
        return dequantize_tiles(quantize_tiles(t, tile, spec, power_of_two=recipe.pow2_block_scales)).double()

    w_dgrad = fq(w, wt, e4m3).t() if wt.rows == wt.cols else fq(w.t(), wt, e4m3)
    expected = {
        "y": fq(x2, act, e4m3) @ fq(w, wt, e4m3).t(),
        "dx": fq(dy2, act, grad) @ w_dgrad.t(),
        "dw": fq(dy2.t(), act, grad) @ fq(x2.t(), act, e4m3).t(),
    }
    got = {"y": y.reshape(-1, 160), "dx": x.grad.reshape(-1, 192), "dw": layer.weight.grad}
    for name in expected:  # fp32 GEMMs of exact operands: ~K fp32 roundings
        assert sqnr_db(got[name], expected[name]) > 110, name
    wrong = fq(dy2.t(), act, grad) @ fq(fq(x2, act, e4m3).float().t(), act, e4m3).t()
    if scaling != "mxfp8":  # power-of-two requantization of FP8 values is (nearly) lossless, see docs
        assert sqnr_db(got["dw"], wrong) < 80


def test_rowwise_scaled_mm_equals_the_emulation():
    """`torch._scaled_mm` with [M, 1] x [1, N] factors (on the CPU here; sm90 on GPUs) against the emulation."""
    layer_e, xe, ye, _ = _layer_case("rowwise", "emulated")
    layer_s, xs, ys, _ = _layer_case("rowwise", "scaled_mm")
    assert isinstance(layer_s.fp8.backend(xs.device), CudaScaledMmBackend)
    for a, b in ((ys, ye), (xs.grad, xe.grad), (layer_s.weight.grad, layer_e.weight.grad)):
        assert sqnr_db(a, b) > 110


def test_backend_selection_per_recipe():
    assert isinstance(select_backend("scaled_mm", "cpu", "blockwise"), EmulatedBackend)  # logged, emulated
    assert isinstance(select_backend("scaled_mm", "cpu", "mxfp8"), EmulatedBackend)
    assert isinstance(select_backend("auto", "cpu", "blockwise"), EmulatedBackend)
    for scaling in FINE:
        with pytest.raises(ValueError, match=f"--fp8-recipe {scaling} is not supported on Gaudi"):
            select_backend("hpu", "cpu", scaling)


def _sqnr_inputs(g):
    m, k = 256, 1024
    gaussian = torch.randn(m, k, generator=g)
    heavy = torch.distributions.StudentT(3.0).sample((m, k))
    outliers = torch.randn(m, k, generator=g)
    channels = torch.randperm(k, generator=g)[:4]
    outliers[:, channels] *= 1e5
    return gaussian, heavy, outliers, channels


def test_sqnr_per_recipe():
    """Every recipe keeps each operand within the E4M3 half-ulp (relative 2^-4, >= 24.1 dB per operand, so
    >= 21.0 dB for a product of two) on Gaussian and heavy-tailed inputs. With outlier channels along K (1e5x,
    as SwiGLU's), the non-outlier channels' contribution x[:, rest] W[:, rest]^T keeps its resolution only
    where the outliers' scales do not reach: blockwise and MXFP8 beat tensorwise by >= 3 dB."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    gaussian, heavy, outliers, channels = _sqnr_inputs(g)
    w = torch.randn(256, 1024, generator=g) * 0.02
    rest = torch.ones(1024, dtype=torch.bool)
    rest[channels] = False
    scores = {}
    for scaling in ("tensorwise",) + FINE:
        recipe = Fp8Recipe(scaling=scaling)
        for name, x in (("gaussian", gaussian), ("heavy", heavy)):
            xq, wq = fprop_operands(x, w, recipe)
            assert sqnr_db(xq.double() @ wq.double().t(), x.double() @ w.double().t()) > 21.0, (scaling, name)
        xq, wq = fprop_operands(outliers, w, recipe)
        scores[scaling] = sqnr_db(xq[:, rest].double() @ wq[:, rest].double().t(),
                                  outliers[:, rest].double() @ w[:, rest].double().t())
    assert scores["blockwise"] >= scores["tensorwise"] + 3, scores
    assert scores["mxfp8"] >= scores["tensorwise"] + 3, scores


def test_smooth_swiglu_parts_per_recipe():
    """The outlier MLP of megatron/model/swiglu_outliers.py at a 1e5x aligned channel: fc2's output on the
    other channels (`fwd others`, the outlier's term dropped after quantization, also in tiled GEMMs; were it
    kept, the SQNR would be far below 0 dB) collapses under tensorwise plain FP8, and channel smoothing
    restores it; blockwise tiles keep it without smoothing (>= 3 dB above tensorwise, within 3 dB of smoothed)."""
    from megatron.model import swiglu_outliers as so

    mlp, _, measured = so.outlier_mlp(so.OutlierSetup(tokens=512), 1e5)
    score = {(recipe, variant): so.part_sqnr(mlp, measured, variant, Fp8Recipe(scaling=recipe))["fwd others"]
             for recipe in ("tensorwise", "blockwise") for variant in (so.PLAIN, so.CHANNEL)}
    assert score["tensorwise", so.CHANNEL] > score["tensorwise", so.PLAIN] + 10, score
    assert score["blockwise", so.PLAIN] > score["tensorwise", so.PLAIN] + 3, score
    assert score["blockwise", so.PLAIN] > score["blockwise", so.CHANNEL] - 3 > 15, score


@pytest.mark.parametrize("scaling", ("rowwise", "blockwise"))
def test_saved_second_layout_beats_requantizing_the_fprop_layout(scaling):
    """The wgrad choice (tiled.py): x^T quantized from x against requantized fprop FP8 (rounds twice)."""
    g = torch.Generator().manual_seed(3)
    x = torch.distributions.StudentT(3.0).sample((512, 512))
    dy = torch.randn(512, 256, generator=g)
    score = wgrad_layout_sqnr(x, dy, Fp8Recipe(scaling=scaling))
    assert score["second_layout"] > score["requantized"] + 0.3, score


def test_tensor_parallel_tiles_must_not_straddle_shards():
    with pytest.raises(ValueError, match="--fp8-recipe blockwise uses tiles of 128.*--tensor-model-parallel-size 2"):
        parse_config(tiny_argv(tensor_model_parallel_size=2, fp8_format="hybrid", fp8_recipe="blockwise"),
                     world_size=2)
    with pytest.raises(ValueError, match="--num-key-value-heads x --kv-channels.*not a multiple of 32"):
        parse_config(tiny_argv(tensor_model_parallel_size=2, fp8_format="hybrid", fp8_recipe="mxfp8"),
                     world_size=2)
    parse_config(tiny_argv(tensor_model_parallel_size=2, fp8_format="hybrid", fp8_recipe="rowwise"), world_size=2)
    parse_config(tiny_argv(fp8_format="hybrid", fp8_recipe="blockwise"), world_size=1)  # TP=1: partial tiles


def test_stats_summarize_clipping_per_tile():
    """Current tile scales report no clipping: fp32 fp8_max / amax puts many tiles' amax an fp32 ulp above
    448 (which rounds to 448 anyway), so the count starts half an FP8 ulp above the max (`clip_threshold`)."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, bias=False, recipe=Fp8Recipe(scaling="blockwise"))
    enable_fp8_stats(layer)
    for _ in range(20):
        layer(torch.randn(10, 64)).sum().backward()
    stats = collect_fp8_stats(layer)
    for role in ("input", "weight", "grad_output"):
        assert stats[f"fp8/{role}/clipped_block_frac"] == 0 and stats[f"fp8/{role}/clipped_frac"] == 0, stats
    assert fp8_stats.clip_threshold(E4M3) == 464 and fp8_stats.clip_threshold(E5M2) == 61440
    # A grid of scales too large for 2 of its 4 tiles: per-tile and per-value fractions.
    enable_fp8_stats(layer)
    t = torch.ones(2, 256)
    scale = torch.tensor([[1.0, 1000.0], [1.0, 1000.0]])
    layer.fp8.stats.record(0, t, quantize_tiles(t, Tile(1, 128), E4M3).data, scale, E4M3, tile=Tile(1, 128))
    stats = collect_fp8_stats(layer)
    assert stats["fp8/input/clipped_block_frac"] == 0.5 and stats["fp8/input/clipped_frac"] == 0.5


@pytest.mark.parametrize("scaling", FINE)
def test_checkpoint_state_round_trips(scaling):
    layer, *_ = _layer_case(scaling)
    model = torch.nn.Sequential(layer)
    fp8_optimizer_step(model)
    state = fp8_state_dict(model, layer.fp8.recipe)
    fresh = torch.nn.Sequential(Fp8Linear(192, 160, bias=False, recipe=layer.fp8.recipe))
    load_fp8_state_dict(fresh, layer.fp8.recipe, state)
    assert torch.equal(fresh[0].fp8_amax_history, layer.fp8_amax_history)
    with pytest.raises(ValueError, match="scaling: saved"):
        load_fp8_state_dict(fresh, Fp8Recipe(scaling="tensorwise"), state)


@pytest.mark.parametrize("scaling", ("blockwise", "mxfp8"))
def test_cli_resume_is_exact(tmp_path, scaling):
    """Save at iteration 4 and resume: the same losses and weights bit for bit as the uninterrupted run (the
    FP8 state of a current-scaling recipe saves and loads through the checkpoint)."""
    fp8 = ("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", scaling)
    assert_resume_is_exact(tmp_path, fp8, 4, train_iters=8, eval_interval=4, hidden_dropout=0.1)


def test_each_recipe_trains_and_tracks_bf16():
    """20 iterations through the CLI. FP8's distance from BF16 is bounded as in test_fp8_training: by
    2 x 32 x BF16's distance from FP32 (E5M2 rounds with 2^5 times BF16's unit); every recipe learns, and
    Smooth-SwiGLU composes with each: it trains as close. Twenty iterations amplify each rounding
    chaotically (the gaps differ between CPUs whose BF16 GEMMs accumulate differently), so that finer scales
    add no error is asserted per GEMM, in float64, by test_sqnr_per_recipe."""
    def run(*switches):
        return pretrain(parse_config(tiny_argv(*switches, train_iters=20)))

    def distance(a, b) -> float:
        return sum(abs(x - y) for x, y in zip(a.losses[-10:], b.losses[-10:], strict=True)) / 10

    fp32, bf16 = run(), run("--bf16")
    noise = distance(bf16, fp32)
    bound = 2 * 32 * noise
    gaps = {}
    for scaling in ("tensorwise",) + FINE:
        fp8 = run("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", scaling)
        gaps[scaling] = distance(fp8, bf16)
        assert gaps[scaling] < bound, (scaling, gaps, bound)
        assert fp8.losses[-1] < fp8.losses[0] - 1.5
    for scaling in FINE:
        smooth = run("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", scaling, "--smooth-swiglu")
        assert distance(smooth, bf16) < bound, (scaling, distance(smooth, bf16), bound)


# ------------------------------------------------------------------------------- GPU (scripts/gpu_check.py)
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("shape", [(1024, 512, 256), (320, 300, 67)], ids=["aligned", "ragged"])
@pytest.mark.parametrize("scaling", FINE)
def test_gpu_recipe_matches_the_emulation(scaling, shape, fmt):
    """On the GPU: rowwise through torch._scaled_mm (sm90: [M, 1] x [1, N] factors), blockwise through
    torch.nn.functional.scaled_mm where the installed torch has its BlockWise types (sm90), MXFP8 emulated
    (logged); y, dx, dW equal the emulated backend's within bf16 output rounding (2^-9 relative per element,
    ~54 dB; 40 dB leaves room for accumulation order). Ragged sizes exercise the kernels' padding. The sm90
    blockwise kernel takes E4M3 x E4M3 only: under hybrid, dgrad and wgrad (E5M2 gradients) are emulated; no
    kernel call may be refused and fall back."""
    from megatron.fp8 import backends
    from megatron.fp8.backends import scaled_mm_supports

    backends.KERNEL_REFUSALS.clear()
    device = torch.device("cuda")
    k, n, tokens = shape
    results = {}
    for backend in ("auto", "emulated"):
        torch.manual_seed(0)
        layer = Fp8Linear(k, n, bias=False, recipe=Fp8Recipe(format=fmt, scaling=scaling, backend=backend),
                          device=device)
        x = torch.randn(4, tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(torch.randn_like(y))
        results[backend] = (layer.fp8.backend(device).name, y, x.grad, layer.weight.grad)
    expected = "scaled_mm" if scaled_mm_supports(Fp8Scaling(scaling), device) else "emulated"
    assert results["auto"][0] == expected
    if scaling == "rowwise" and torch.cuda.get_device_capability() >= (9, 0):
        assert expected == "scaled_mm"
    for got, ref in zip(results["auto"][1:], results["emulated"][1:]):
        assert sqnr_db(got.float(), ref.float()) > 40
    assert not backends.KERNEL_REFUSALS
