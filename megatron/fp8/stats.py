"""FP8 quantization statistics: which layer and tensor is clipping, flushing to zero or seeing inf/NaN.

Off by default. `enable_fp8_stats(model, True)` (convert.py) sets a flag on every `Fp8Linear`; only then do the
forward and backward record their quantizations (so disabled statistics cost one attribute check per GEMM,
nothing else). Counts are accumulated in device tensors (`Fp8Stats`) since the last read and moved to the host
once, in `collect_fp8_stats`, which the training loop calls at its log interval.

Per layer and tensor role (input, weight, grad_output):
- `amax`: the largest |x| seen since the last read; `scale`: the scale used most recently;
- `clipped_frac`: fraction of values saturated by the clamp beyond rounding: |x * scale| above fp8_max plus
  half the FP8 grid spacing there (`clip_threshold`; nearer values round to fp8_max anyway);
- `clipped_block_frac`: fraction of scaling blocks (tiles of the fine-grained recipes; the whole tensor per
  quantization otherwise) holding at least one clipped value;
- `flushed_frac`: fraction of *nonzero* values that quantized to 0 (below half the smallest subnormal);
- `nan_count`, `inf_count`: counted on the unquantized tensor, before the clamp hides infinities.
`worst_fp8_layer` names the tensor with the highest clipped fraction, for the log line. Clipping is the
early sign of the outliers that precede an FP8 divergence (the SwiGLU outliers of the paper).
"""
from __future__ import annotations

import math

import torch

from megatron.fp8.formats import Fp8FormatSpec
from megatron.fp8.fused import CompiledOrEager, call_as_compiled
from megatron.fp8.quantize import Tile, amax_of, count_nonfinite, tile_blocks

# Columns of the per-layer count tensor.
_COUNTS = ("clipped", "flushed", "nan", "inf", "numel", "blocks_clipped", "blocks")


def clip_threshold(spec: Fp8FormatSpec) -> float:
    """The scaled magnitude above which the clamp changes a value's FP8 rounding: fp8_max plus half the grid
    spacing at fp8_max (464 for E4M3, 61440 for E5M2). A value between fp8_max and this rounds to fp8_max
    with or without the clamp; current scales (fp8_max / amax in fp32) put a tile's amax an fp32 ulp above
    fp8_max often enough that counting those would report clipping where none loses anything."""
    return spec.max + 2.0 ** (math.floor(math.log2(spec.max)) - spec.mantissa_bits) / 2


# FP8 dtypes whose zeros are exactly the bytes 0x00 and 0x80 (+-0): their zero test reads the byte, not an fp32
# conversion (a slow pass of its own on CPU). The `fnuz` formats use 0x80 for NaN and take the conversion.
_SIGNED_ZERO_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _zero_source(q: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(what `_is_zero` tests for zero, whether that is the FP8 byte)."""
    if q.dtype in _SIGNED_ZERO_FP8:
        return q.view(torch.uint8), True
    return q, False


def _is_zero(zero_source: torch.Tensor, byte_zero: bool) -> torch.Tensor:
    """Elementwise: the quantized value is +-0 (`_zero_source`'s pair)."""
    return (zero_source & 0x7F) == 0 if byte_zero else zero_source.float() == 0


# Below this many elements a quantization's counts are summed in int32 (exact there), at and above it in int64.
_INT32_COUNTS_BELOW = 2**31


def _per_tensor_counts(t: torch.Tensor, zero_source: torch.Tensor, scale: torch.Tensor, limit: float,
                       byte_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row `_COUNTS` adds for one quantization with one scale, as int64; amax): one traceable function, run
    eagerly or compiled into one pass over t (`_FUSED_COUNTS`). Integer counts and a max: the same results either
    way. The counts are summed in int32 below 2**31 elements (exact; vector adds of half the width of int64's)."""
    acc = torch.int32 if t.numel() < _INT32_COUNTS_BELOW else torch.int64
    clipped = ((t.float() * scale).abs() > limit).sum(dtype=acc)
    flushed = ((t != 0) & _is_zero(zero_source, byte_zero)).sum(dtype=acc)
    nan, inf = count_nonfinite(t, acc)
    counts = torch.stack([clipped, flushed, nan, inf]).to(torch.int64)
    numel = torch.full((), t.numel(), dtype=torch.int64, device=t.device)
    extra = torch.stack([numel, (clipped > 0).to(torch.int64), torch.ones_like(numel)])  # one tensor, no blocks
    return torch.cat([counts, extra]), amax_of(t)


# Compiled on first use with dynamic shapes (one kernel for every tensor of a model); eager after a failure.
_FUSED_COUNTS = CompiledOrEager(_per_tensor_counts, "the FP8 statistics", dynamic=True)
# (tensor dtype, zero source dtype, clip threshold) whose graph `warm_up_eager_counts` made at start-up.
_EAGER_READY: set[tuple[torch.dtype, torch.dtype, float]] = set()


@torch.no_grad()
def warm_up_eager_counts(device: torch.device, values_dtype: torch.dtype, activation_specs: set[Fp8FormatSpec],
                         weight_specs: set[Fp8FormatSpec]) -> None:
    """Compile the statistics pass for every shape now, for the eager layer of the CPU bf16 GEMM mode (megatron/fp8/
    fused.py, `known_values`), which counts from the BF16 activations and gradients and their values (in the formats
    of `activation_specs`), and from the FP32 weights and their FP8 bytes (`weight_specs`): its statistics iterations
    then take one compiled pass per quantization instead of about a dozen eager ones, and compile nothing."""
    scale = torch.ones((), device=device)
    variants = [(spec, torch.bfloat16, values_dtype, False) for spec in activation_specs]
    variants += [(spec, torch.float32, torch.uint8, True) for spec in weight_specs]
    for spec, t_dtype, zero_dtype, byte_zero in variants:
        limit = clip_threshold(spec)
        t, zero_source = (torch.zeros(16, 32, dtype=d, device=device) for d in (t_dtype, zero_dtype))
        call_as_compiled(_FUSED_COUNTS, t, zero_source, scale, limit, byte_zero)
        _EAGER_READY.add((t_dtype, zero_dtype, limit))


def _counts(t: torch.Tensor, zero_source: torch.Tensor, scale: torch.Tensor, limit: float, byte_zero: bool,
            fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`_per_tensor_counts`: compiled for a fused layer, through the start-up's graph for an eager layer where
    `warm_up_eager_counts` made one, else eagerly."""
    if fused:
        return _FUSED_COUNTS(t, zero_source, scale, limit, byte_zero)
    if (t.dtype, zero_source.dtype, limit) in _EAGER_READY and t.device.type == "cpu" and not _FUSED_COUNTS.failed:
        return call_as_compiled(_FUSED_COUNTS, t, zero_source, scale, limit, byte_zero)
    return _per_tensor_counts(t, zero_source, scale, limit, byte_zero)


class Fp8Stats:
    """One layer's statistics since the last read, per tensor role, in device tensors (no host read per GEMM)."""

    def __init__(self, n_roles: int, device: torch.device) -> None:
        self.device = device
        self.counts = torch.zeros(n_roles, len(_COUNTS), dtype=torch.int64, device=device)
        self.amax = torch.zeros(n_roles, dtype=torch.float32, device=device)
        self.scale = torch.ones(n_roles, dtype=torch.float32, device=device)

    @torch.no_grad()
    def record(self, role: int, t: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec: Fp8FormatSpec,
               tile: Tile | None = None, fused: bool = False) -> None:
        """Accumulate the statistics of one quantization of `t` (to `q` with `scale`).

        With a `tile`, `scale` is the grid of tile scales: clipping is also counted per tile (a tile with any
        clipped value), and the scale recorded is the smallest one (the tile of the largest amax). `fused`
        (the layer's fused quantization, --torch-compile): one compiled pass per per-tensor quantization.
        """
        limit = clip_threshold(spec)
        if tile is None:
            if t.numel() == 0:
                return
            zero_source, byte_zero = _zero_source(q)
            counts, amax = _counts(t, zero_source, scale.float(), limit, byte_zero, fused)
            self.counts[role] += counts
            self.amax[role] = torch.maximum(self.amax[role], amax)
            self.scale[role] = scale.float()
            return
        blocks_view, _ = tile_blocks(t.float(), tile)
        over = (blocks_view * scale.float()[:, None, :, None]).abs() > limit
        block_over, blocks = over.any(dim=3).any(dim=1), scale.numel()
        recorded_scale = torch.nan_to_num(scale.float(), nan=float("inf")).amin()
        clipped = over.sum()
        flushed = ((t != 0) & _is_zero(*_zero_source(q))).sum()
        nan, inf = count_nonfinite(t)
        numel = torch.full((), t.numel(), dtype=torch.int64, device=t.device)  # fills: no host-to-device copy
        n_blocks = torch.full((), blocks, dtype=torch.int64, device=t.device)
        counts = torch.stack([clipped, flushed, nan, inf, numel, block_over.sum(), n_blocks])
        self.counts[role] += counts.to(torch.int64)
        self.amax[role] = torch.maximum(self.amax[role], amax_of(t))
        self.scale[role] = recorded_scale

    def reset(self) -> None:
        self.counts.zero_()
        self.amax.zero_()


def collect(named: list[tuple[str, Fp8Stats]], role_names: tuple[str, ...], reset: bool = True) -> dict[str, float]:
    """The statistics of `named` layers, keyed `fp8/<layer>/<role>/<metric>`; one host transfer in total. Roles
    that recorded nothing since the last read are left out."""
    if not named:
        return {}
    all_counts = torch.stack([st.counts for _, st in named]).cpu().tolist()
    all_amax = torch.stack([st.amax for _, st in named]).cpu().tolist()
    all_scale = torch.stack([st.scale for _, st in named]).cpu().tolist()
    out: dict[str, float] = {}
    for i, (name, _) in enumerate(named):
        for r, role in enumerate(role_names):
            clipped, flushed, nan, inf, numel, blocks_clipped, blocks = all_counts[i][r]
            if numel == 0:
                continue
            prefix = f"fp8/{name}/{role}" if name else f"fp8/{role}"  # name is "" for a bare layer
            out[f"{prefix}/amax"] = float(all_amax[i][r])
            out[f"{prefix}/scale"] = float(all_scale[i][r])
            out[f"{prefix}/clipped_frac"] = clipped / numel
            out[f"{prefix}/clipped_block_frac"] = blocks_clipped / max(blocks, 1)
            out[f"{prefix}/flushed_frac"] = flushed / numel
            out[f"{prefix}/nan_count"] = float(nan)
            out[f"{prefix}/inf_count"] = float(inf)
    if reset:
        for _, st in named:
            st.reset()
    return out


def sqnr_db(test: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(sum ref^2 / sum (ref - test)^2) in dB, computed in float64;
    inf when equal. The one SQNR of the project (experiments, benchmarks and tests)."""
    reference, test = reference.detach().double(), test.detach().double()
    noise = (test - reference).square().sum()
    return float("inf") if noise == 0 else 10 * math.log10(float(reference.square().sum() / noise))


def worst_fp8_layer(stats: dict[str, float]) -> tuple[str, float] | None:
    """(`<layer>/<role>`, clipped fraction) of the tensor clipping most, or None without statistics."""
    suffix = "/clipped_frac"
    candidates = [(k[len("fp8/"):-len(suffix)], v) for k, v in stats.items()
                  if k.startswith("fp8/") and k.endswith(suffix)]
    if not candidates:
        return None
    return max(candidates, key=lambda kv: kv[1])
