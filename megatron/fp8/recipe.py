"""The FP8 recipe: a small frozen description of *what* FP8 training does.

The recipe says which formats, how scales are chosen and which GEMMs run in FP8; `convert_to_fp8`
and `Fp8Linear` (elsewhere in this package) decide *where* it applies. Defaults follow Megatron-LM's
flags (`--fp8-amax-history-len 1`, `--fp8-amax-compute-algo most_recent`, `--fp8-margin 0`).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from megatron.flagspec import FP8, Flag, flag
from megatron.fp8.quantize import Tile


class Fp8Format(str, enum.Enum):
    HYBRID = "hybrid"  # E4M3 forward (activations, weights), E5M2 backward (gradients)
    E4M3 = "e4m3"  # E4M3 everywhere


class Fp8Scaling(str, enum.Enum):
    DELAYED = "delayed"  # scale from an amax history of previous steps
    TENSORWISE = "tensorwise"  # current scaling: scale from this tensor's amax now
    # Fine-grained current scaling: one scale per tile of each GEMM operand, along the GEMM's contraction
    # dimension (see `Fp8Recipe.tiles` and "Fine-grained recipes" in docs/fp8.md).
    ROWWISE = "rowwise"  # one scale per row of each operand (torchao's axiswise)
    BLOCKWISE = "blockwise"  # 1x128 tiles for activations and gradients, 128x128 blocks for weights (DeepSeek-V3)
    MXFP8 = "mxfp8"  # 1x32 tiles with power-of-two (E8M0) scales, OCP MX

    @property
    def fine_grained(self) -> bool:
        return self in (Fp8Scaling.ROWWISE, Fp8Scaling.BLOCKWISE, Fp8Scaling.MXFP8)


# (activation and gradient tile, weight tile) of each fine-grained recipe; the last dimension is the GEMM's
# contraction dimension, 0 the whole dimension. A weight tile that is square serves fprop and dgrad alike.
_TILES = {
    Fp8Scaling.ROWWISE: (Tile(1, 0), Tile(1, 0)),
    Fp8Scaling.BLOCKWISE: (Tile(1, 128), Tile(128, 128)),
    Fp8Scaling.MXFP8: (Tile(1, 32), Tile(1, 32)),
}


class Fp8Gemm(str, enum.Enum):
    """The three GEMMs of a linear layer y = x W^T."""
    FPROP = "fprop"  # y = x W^T
    DGRAD = "dgrad"  # dx = dy W
    WGRAD = "wgrad"  # dW = dy^T x


# Fast accumulation (`_scaled_mm(use_fast_accum=True)`): on Hopper the FP8 tensor cores then keep partial sums in
# their own reduced-precision accumulator for the whole K loop instead of promoting them to FP32 registers at
# intervals; faster, and less accurate as K grows. Transformer Engine and torchao use it for the forward GEMM
# only; dgrad and wgrad (long K: the tokens of a batch for wgrad) keep the promoted ("split") accumulation.
DEFAULT_FAST_ACCUM = (Fp8Gemm.FPROP,)


def parse_fast_accum(value: "str | list | tuple | set") -> tuple:
    """`--fp8-fast-accum`'s value ("fprop,dgrad", "none", "all") or a collection of GEMM names as a tuple of
    `Fp8Gemm` in fprop, dgrad, wgrad order; ValueError naming the flag otherwise."""
    if isinstance(value, str):
        names = {"none": [], "all": [g.value for g in Fp8Gemm]}.get(value.strip(), value.split(","))
    else:
        names = list(value)
    try:
        chosen = {Fp8Gemm(n.strip() if isinstance(n, str) else n) for n in names}
    except ValueError:
        raise ValueError(f"--fp8-fast-accum {value!r}: give a comma-separated list of fprop, dgrad, wgrad, or "
                         f"none or all (default fprop)") from None
    return tuple(g for g in Fp8Gemm if g in chosen)


class AmaxComputeAlgo(str, enum.Enum):
    MAX = "max"
    MOST_RECENT = "most_recent"


class Fp8Backend(str, enum.Enum):
    AUTO = "auto"
    SCALED_MM = "scaled_mm"  # torch._scaled_mm: sm89+ GPUs, and CPU (where it runs too, for end-to-end tests)
    CUDA = "scaled_mm"  # the earlier name: an alias of SCALED_MM (Fp8Backend("cuda") is SCALED_MM too)
    HPU = "hpu"  # habana_frameworks FP8 ops
    EMULATED = "emulated"  # real FP8 casts, GEMM on the dequantized values

    @classmethod
    def _missing_(cls, value: object) -> "Fp8Backend | None":
        # `--fp8-backend cuda` and recipes saved before the rename.
        return cls.SCALED_MM if value == "cuda" else None


@dataclass(frozen=True)
class Fp8Recipe:
    format: Fp8Format = flag(
        "--fp8-format", group=FP8, default=Fp8Format.HYBRID, cli_default=None, choices=["e4m3", "hybrid"],
        derived=True, help="turns FP8 linears on",
        more=[Flag(("--fp8-hybrid",), FP8, action="store_true", default=False,
                   help="legacy alias of --fp8-format hybrid"),
              Flag(("--fp8-e4m3",), FP8, action="store_true", default=False, help="legacy alias of --fp8-format e4m3")])
    scaling: Fp8Scaling = flag(
        "--fp8-recipe", group=FP8, default=Fp8Scaling.DELAYED, choices=[s.value for s in Fp8Scaling],
        help="delayed / tensorwise: one scale per tensor; rowwise, blockwise (1x128 activations, 128x128 weights), "
             "mxfp8 (1x32, power-of-two scales): current scales per tile (docs/fp8.md)")
    amax_history_len: int = flag("--fp8-amax-history-len", group=FP8, default=1)
    amax_compute_algo: AmaxComputeAlgo = flag("--fp8-amax-compute-algo", group=FP8,
                                              default=AmaxComputeAlgo.MOST_RECENT, choices=["max", "most_recent"])
    margin: int = flag("--fp8-margin", group=FP8, default=0)
    power_of_two_scales: bool = flag("--fp8-power-of-two-scales", group=FP8, default=False,
                                     help="round every FP8 scale down to a power of two (exact rescaling)")
    fp8_wgrad: bool = flag("--no-fp8-wgrad", group=FP8, default=True, negate=True,
                           help="run the weight-gradient GEMM in high precision")
    backend: Fp8Backend = flag("--fp8-backend", group=FP8, default=Fp8Backend.AUTO,
                               choices=["auto", "scaled_mm", "cuda", "hpu", "emulated"],
                               help="scaled_mm (alias cuda): torch._scaled_mm, on sm89+ GPUs and on the CPU")
    first_last_layers_bf16: int = flag("--fp8-first-last-layers-bf16", group=FP8, default=0,
                                       help="keep N blocks at each end in BF16")
    mlp_fc2_bf16: bool = flag("--fp8-mlp-fc2-bf16", group=FP8, default=False,
                              help="keep only the fc2 GEMM in BF16 (ablation)")
    grad_stochastic_rounding: bool = flag("--fp8-grad-stochastic-rounding", group=FP8, default=False,
                                          help="round gradients to E5M2 stochastically instead of to nearest")
    # the GEMMs (Fp8Gemm) that use fast accumulation
    fast_accum: tuple = flag(
        "--fp8-fast-accum", group=FP8, default=DEFAULT_FAST_ACCUM, cli_default=None, derived=True, metavar="GEMMS",
        help="GEMMs whose FP8 kernel accumulates in the tensor cores' fast, less precise accumulator "
             "(torch._scaled_mm use_fast_accum): comma-separated fprop, dgrad, wgrad, or none, all (default: fprop, "
             "as Transformer Engine and torchao). The emulation and Gaudi accumulate in FP32 either way, as do "
             "--fp8-recipe blockwise's GEMMs of 128x128 weight tiles (the sm90 kernel has no fast accumulation)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "fast_accum", parse_fast_accum(self.fast_accum))
        # Accept the enums' string values too (from `from_dict`, or callers passing "hybrid").
        for name, kind in (("format", Fp8Format), ("scaling", Fp8Scaling),
                           ("amax_compute_algo", AmaxComputeAlgo), ("backend", Fp8Backend)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")
        if self.first_last_layers_bf16 < 0:
            raise ValueError(f"--fp8-first-last-layers-bf16 must be >= 0, got {self.first_last_layers_bf16}")

    def fast_accum_for(self, gemm: Fp8Gemm) -> bool:
        """Whether `gemm` uses fast accumulation (the GPU kernels' `use_fast_accum`)."""
        return gemm in self.fast_accum

    @property
    def tiles(self) -> tuple[Tile, Tile] | None:
        """(activation/gradient tile, weight tile) of a fine-grained recipe; None for per-tensor scaling."""
        return _TILES.get(self.scaling)

    @property
    def pow2_block_scales(self) -> bool:
        """Whether block scales are powers of two: always under MXFP8 (E8M0), else `power_of_two_scales`."""
        return self.power_of_two_scales or self.scaling is Fp8Scaling.MXFP8

    def check_tensor_parallel(self, tp_size: int, sharded: dict[str, int]) -> None:
        """ValueError unless every tensor-parallel piece holds whole tiles.

        `sharded` maps a description of each dimension that tensor parallelism splits (naming its flags) to its
        full size. A tile is computed on one rank's piece, so a tile length that does not divide the piece
        makes tiles the TP=1 model does not have (a tile straddling two shards, cut in two). Rowwise scales
        span the whole local row and are exempt: on a row-parallel GEMM they cover the local shard of K
        (documented in docs/fp8.md: no collective, numerics differ from TP=1 by that).
        """
        if self.tiles is None or tp_size == 1 or self.scaling is Fp8Scaling.ROWWISE:
            return
        act, weight = self.tiles
        length = max(act.cols, weight.rows, weight.cols)
        for what, size in sharded.items():
            if size % tp_size or (size // tp_size) % length:
                raise ValueError(
                    f"--fp8-recipe {self.scaling.value} uses tiles of {length} along every GEMM dimension, but "
                    f"{what} = {size} split over --tensor-model-parallel-size {tp_size} gives pieces of "
                    f"{size / tp_size:g}, not a multiple of {length}: a tile would straddle two shards. Choose "
                    f"sizes whose TP pieces are multiples of {length}, or --fp8-recipe rowwise/tensorwise")

    def to_dict(self) -> dict[str, object]:
        """Plain dict (enums as their string values): safe for `torch.load(weights_only=True)` and JSON."""
        def plain(v: object) -> object:
            if isinstance(v, tuple):
                return [g.value for g in v]
            return v.value if isinstance(v, enum.Enum) else v
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> "Fp8Recipe":
        """Inverse of `to_dict`; unknown keys raise (a newer checkpoint), missing keys take defaults."""
        return cls(**values)  # __post_init__ turns strings back into enums


# The FP8 controller's actions, least costly first (megatron/training/fp8_autoheal.py).
AUTOHEAL_ACTIONS = ("margin", "current", "smooth", "bf16")


@dataclass(frozen=True)
class Fp8AutohealConfig:
    """The FP8 controller's rules (megatron/training/fp8_autoheal.py); `enabled` is --fp8-autoheal."""

    enabled: bool = flag(
        "--fp8-autoheal", group=FP8, default=False,
        help="at log iterations, repair the scaling of an FP8 tensor that keeps clipping: more margin, then current "
             "scaling, Smooth-SwiGLU for fc2, BF16 (docs/stability.md)")
    # clipped fraction of a tensor's values that counts against it at a log iteration
    clip_threshold: float = flag("--fp8-autoheal-clip-threshold", group=FP8, default=1e-3,
                                 help="clipped fraction of a tensor's values that counts against it")
    # fraction of a tensor's nonzero values flushed to 0 that counts against it once it is current-scaled (one
    # outlier squeezing the rest of the tensor below E4M3's smallest subnormal)
    flush_threshold: float = flag(
        "--fp8-autoheal-flush-threshold", group=FP8, default=1e-2,
        help="fraction of a current-scaled tensor's nonzero values flushed to 0 that counts against it")
    # consecutive log iterations in trouble before the controller acts: 1, because the statistics sample one
    # iteration per log interval and the clipping that slows training shows at single log points (docs/stability.md)
    patience: int = flag("--fp8-autoheal-patience", group=FP8, default=1,
                         help="consecutive log iterations over the threshold before acting")
    max_margin: int = flag("--fp8-autoheal-max-margin", group=FP8, default=4,
                           help="the most extra margin (powers of two) one tensor may get")
    undo_after: int = flag("--fp8-autoheal-undo-after", group=FP8, default=0,
                           help="clean log iterations after which an extra margin is lowered by one (0: never)")
    # the rungs it may climb, in this order
    actions: tuple[str, ...] = flag(
        "--fp8-autoheal-actions", group=FP8, default=AUTOHEAL_ACTIONS, cli_default=None, derived=True,
        help="comma-separated rungs the controller may climb, in order: margin,current,smooth,bf16 (default: those "
             "that apply to the recipe and model)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(self.actions))
        unknown = [a for a in self.actions if a not in AUTOHEAL_ACTIONS]
        checks = ((0 < self.clip_threshold < 1, f"--fp8-autoheal-clip-threshold must be in (0, 1), got "
                                                f"{self.clip_threshold}"),
                  (0 < self.flush_threshold < 1, f"--fp8-autoheal-flush-threshold must be in (0, 1), got "
                                                 f"{self.flush_threshold}"),
                  (not unknown and self.actions, f"--fp8-autoheal-actions: unknown {unknown or 'empty list'}; "
                                                 f"pick from {','.join(AUTOHEAL_ACTIONS)}"),
                  (self.patience >= 1, f"--fp8-autoheal-patience must be >= 1, got {self.patience}"),
                  (1 <= self.max_margin <= 16, f"--fp8-autoheal-max-margin must be in [1, 16], got {self.max_margin}"),
                  (self.undo_after >= 0, f"--fp8-autoheal-undo-after must be >= 0, got {self.undo_after}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
