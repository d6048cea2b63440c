"""The FP8 recipe: a small frozen description of *what* FP8 training does.

The recipe says which formats, how scales are chosen and which GEMMs run in FP8; `convert_to_fp8`
and `Fp8Linear` (elsewhere in this package) decide *where* it applies. Defaults follow Megatron-LM's
flags (`--fp8-amax-history-len 1`, `--fp8-amax-compute-algo most_recent`, `--fp8-margin 0`).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class Fp8Format(str, enum.Enum):
    HYBRID = "hybrid"  # E4M3 forward (activations, weights), E5M2 backward (gradients)
    E4M3 = "e4m3"  # E4M3 everywhere


class Fp8Scaling(str, enum.Enum):
    DELAYED = "delayed"  # scale from an amax history of previous steps
    TENSORWISE = "tensorwise"  # current scaling: scale from this tensor's amax now


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
    format: Fp8Format = Fp8Format.HYBRID
    scaling: Fp8Scaling = Fp8Scaling.DELAYED
    amax_history_len: int = 1
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.MOST_RECENT
    margin: int = 0
    power_of_two_scales: bool = False
    fp8_wgrad: bool = True
    backend: Fp8Backend = Fp8Backend.AUTO
    first_last_layers_bf16: int = 0
    mlp_fc2_bf16: bool = False
    grad_stochastic_rounding: bool = False

    def __post_init__(self) -> None:
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

    def to_dict(self) -> dict[str, object]:
        """Plain dict (enums as their string values): safe for `torch.load(weights_only=True)` and JSON."""
        return {f.name: (v.value if isinstance(v, enum.Enum) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> "Fp8Recipe":
        """Inverse of `to_dict`; unknown keys raise (a newer checkpoint), missing keys take defaults."""
        return cls(**values)  # __post_init__ turns strings back into enums
