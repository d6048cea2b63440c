"""The state of one FP8 linear layer and what is done with it: the core the autograd functions work on.

`Fp8LayerState` is everything an FP8 linear's GEMMs need besides their tensors: the recipe; the per-role scaling
buffers (`scaling.py`: amax history, scale, validity, the step's running amax), which the owning `Fp8Linear`
registers as its non-persistent buffers and binds here (`bind`, again after `.to()`); what is cached per
optimizer step (the FP8 weight, W's column maxima); which delayed scales are known to be valid; the settings
that model-level functions and the FP8 controller change (`Fp8LayerSettings`, frozen, through `configure` only:
fused quantization, tracing, statistics, per-call weights under ZeRO-3, extra margins, current-scaled roles, high
precision); and the counters tests and benchmarks read. The autograd functions (`per_tensor.py`, with its
traced caller `traced.py`, and `tiled.py`) receive a state and tensors, never the module; `Fp8Linear`
(`linear.py`) is an `nn.Linear` that owns a state and dispatches to them.

The weight is passed in at each call, not held: under ZeRO-3 it exists only while gathered, and the per-step
caches are keyed on its version counter and storage (`weight_storage_key`).

Which tensors are recorded: only training uses (`training=True` from the caller) feed the step's running amax,
so an evaluation between two steps does not change the next step's scales (a resumed run equals an
uninterrupted one).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron import comm
from megatron.fp8 import cpu_gemm, fused
from megatron.fp8 import stats as fp8_stats
from megatron.fp8.backends import STATELESS_BACKENDS, Backend, backend_format_spec, select_backend
from megatron.fp8.formats import Fp8FormatSpec
from megatron.fp8.gathered import Fp8GatheredWeight
from megatron.fp8.quantize import amax_of, column_scaled, compute_scale, nonfinite_guard
from megatron.fp8.recipe import Fp8Recipe, Fp8Scaling
from megatron.fp8.scaling import Fp8Role, record_step_amax, role_dtypes

BUFFER_NAMES = ("fp8_amax_history", "fp8_scale", "fp8_scale_valid", "fp8_step_amax", "fp8_nonfinite_steps",
                "fp8_step_nonfinite")


def weight_storage_key(weight: torch.Tensor) -> tuple[int, int]:
    """What identifies the weight's current values for the per-step FP8 caches: its version counter (bumped by
    every in-place update) and its storage (replaced by `.to()` or a `.data` assignment)."""
    return weight._version, weight.data_ptr()


@dataclasses.dataclass
class QuantizedWeight:
    """The FP8 weight of one optimizer step (and its transpose, made on first need)."""

    key: tuple[Any, ...] | None
    data: torch.Tensor  # [N, K] FP8
    scale: torch.Tensor
    amax: torch.Tensor
    transposed: torch.Tensor | None = None  # [K, N] FP8, row-major; only for backends that want copies
    values: torch.Tensor | None = None  # the FP8 values in bf16/fp32 (exact); only for the emulated backend
    guarded: torch.Tensor | None = None  # the scale the GEMMs take (`nonfinite_guard`), made on first need
    recorded: bool = False  # its amax is in the step's running amax (once per step is enough: max is idempotent)

    def gemm_scale(self) -> torch.Tensor:
        """The scale multiplied out of the GEMMs: NaN if W held an inf or NaN (made once per cached weight)."""
        if self.guarded is None:
            self.guarded = nonfinite_guard(self.scale, self.amax)
        return self.guarded

    def weight(self, backend: Backend, pow2_scales: bool = False) -> torch.Tensor:
        """Operand for fprop, [N, K]."""
        if backend.name != "emulated":
            return self.data
        # The emulated GEMM upcasts its operands; CPU fp8->float casts are slow, so convert the weight once
        # per step, not twice per micro-batch, into the dtype its GEMM runs in (bf16 with power-of-two scales or
        # BF16 GEMMs, see EmulatedBackend.gemm_nt). Both hold every E4M3/E5M2 value exactly.
        if self.values is None:
            bf16 = pow2_scales or cpu_gemm.values_dtype() == torch.bfloat16
            dtype = torch.bfloat16 if bf16 else torch.float32
            # The compiled conversion where the run made it for every shape (eager converts element by element).
            ready = fused.upcasts_ready(self.data, dtype)
            self.values = fused.upcast(self.data, dtype) if ready else self.data.to(dtype)
        return self.values

    def weight_t(self, backend: Backend, pow2_scales: bool = False) -> torch.Tensor:
        """Operand for dgrad, W^T as [K, N]: a view, or a row-major copy for backends that need one."""
        if not backend.wants_contiguous_operands:
            return self.weight(backend, pow2_scales).t()
        if self.transposed is None:
            self.transposed = self.data.t().contiguous()
        return self.transposed


@dataclasses.dataclass(frozen=True)
class Fp8LayerSettings:
    """What model-level functions and the FP8 controller set on one layer beside its recipe. Frozen: changed only
    by `Fp8LayerState.configure` (a new value, `dataclasses.replace`), so a compiled graph that read a field is
    retraced when it changes."""

    # Quantize through the compiled functions of fused.py (bitwise the eager reference, fewer passes);
    # `set_fused_quantization` sets it for a model from --torch-compile. Off: the eager reference.
    fused_quantization: bool = False
    # Inside a compiled transformer block: traced into its graph (traced.py), or a graph break running the eager
    # path (`set_fp8_tracing`; the fallback when tracing fails, and a benchmark's comparison).
    trace_in_compiled_graph: bool = True
    # Per-call FP8 weight (set under ZeRO-3, where the weight exists only while gathered): no cache across
    # forwards, and none kept from forward to backward, which requantizes.
    weight_per_call: bool = False
    stats_enabled: bool = False  # quantization statistics (stats.py), on in logging iterations
    # Per role: powers of two of margin on top of the recipe's, raised by the FP8 controller
    # (megatron/training/fp8_autoheal.py) for a tensor that keeps clipping; checkpointed with the scaling state.
    extra_margin: tuple[int, int, int] = (0, 0, 0)
    # Per role: cast with its own current amax whatever the recipe (the controller's next step after the margin).
    current_roles: tuple[bool, bool, bool] = (False, False, False)
    # The controller's last resort: the layer runs nn.Linear's GEMM in the compute dtype, no FP8 cast.
    high_precision: bool = False


def _setting(name: str) -> property:
    """A read-only view of one field of `Fp8LayerState.settings`: one spelling to read, `configure` to change."""
    return property(lambda state: getattr(state.settings, name),
                    doc=f"`Fp8LayerSettings.{name}` of this layer (read-only; `Fp8LayerState.configure` changes it)")


class Fp8LayerState:
    """The FP8 state of one linear layer (module docstring)."""

    def __init__(self, recipe: Fp8Recipe, amax_group: Any = None) -> None:
        self.recipe = recipe
        # Process group over which amaxes are max-reduced: every rank holding a piece (TP) or a replica (DP)
        # of the same logical tensor. None = the default group when torch.distributed is initialized.
        self.amax_group = amax_group
        self.settings = Fp8LayerSettings()  # the switches and the controller's overrides (`configure`)
        self.num_updates = 0  # optimizer steps seen by the delayed-scaling update
        self.weight_quantizations = 0  # how often the weight was cast (once per step when cached)
        self.column_maxima_passes = 0  # how often W's column maxima were computed (once per step when cached)
        # How often what was made from the weight was dropped (`forget_weights`: each optimizer step, a changed cast):
        # the key of what is made from it outside this state (FSDP2's FP8 gather scales, fp8_gather.py).
        self.weight_generation = 0
        self.weight_cache: Any = None  # QuantizedWeight, or tiled.TiledWeight under the fine-grained recipes
        # This step's FP8 weight for the traced path (its GEMM operand, scale, amax, W^T as a row-major copy for
        # backends that want one, else None), set outside the compiled graph by `refresh_step_weight` (a compiled
        # block's pre-hook); None: the traced path quantizes per call.
        self.step_weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        # W's column maxima (`column_maxima`), made once per optimizer step for a column-scaled (Smooth-SwiGLU)
        # weight: (weight_storage_key, [K] fp32); `step_column_maxima` is the traced path's copy of them.
        self.column_maxima_cache: tuple[tuple[int, int], torch.Tensor] | None = None
        self.step_column_maxima: torch.Tensor | None = None
        # Per role: the delayed scale is known to be valid (its buffer `fp8_scale_valid` is True, which stays so
        # once set). Learned from the buffer at a step's end (`fp8_optimizer_step`) or by `refresh_scale_validity`
        # until every role is valid, then never read again; a valid role is cast with the history's scale alone.
        self.known_valid: tuple[bool, bool, bool] = (False, False, False)
        self.validity_read_at: int | None = None  # num_updates when the buffer was last read
        self.stats: fp8_stats.Fp8Stats | None = None  # made when statistics are first switched on
        self._rows: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None  # `role_rows`
        self.buffers: dict[str, torch.Tensor] = {}

    fused_quantization = _setting("fused_quantization")
    trace_in_compiled_graph = _setting("trace_in_compiled_graph")
    weight_per_call = _setting("weight_per_call")
    stats_enabled = _setting("stats_enabled")
    extra_margin = _setting("extra_margin")
    current_roles = _setting("current_roles")
    high_precision = _setting("high_precision")

    def configure(self, **changes: Any) -> Fp8LayerSettings:
        """Change settings (`Fp8LayerSettings` fields) of this layer; returns the new settings. A cached FP8 weight
        is dropped when how the weight is cast changes (per-call weights, a role's scaling); statistics switched on
        get their accumulator on the scales' device."""
        old = self.settings
        new = dataclasses.replace(old, **_normalized(changes))
        self.settings = new
        if (new.weight_per_call, new.current_roles) != (old.weight_per_call, old.current_roles):
            self.forget_weights()
        if new.stats_enabled and (self.stats is None or self.stats.device != self.scale.device):
            self.stats = fp8_stats.Fp8Stats(len(Fp8Role), self.scale.device)
        return new

    def cache_weight(self, made: Any) -> None:
        """Keep `made` (a `QuantizedWeight` or `tiled.TiledWeight`) as this step's FP8 weight, unless the weight
        is made per call (ZeRO-3)."""
        if not self.weight_per_call:
            self.weight_cache = made

    def count_update(self) -> None:
        """One scaling update (an optimizer step) seen."""
        self.num_updates += 1

    # --- buffers, formats, backend ------------------------------------------------------------------------------

    def bind(self, buffers: dict[str, torch.Tensor]) -> None:
        """Read the scaling buffers (`BUFFER_NAMES`) from `buffers`: the owning module's own buffer dict, which
        `.to()` and `register_buffer` update in place, so the state always sees the module's current tensors."""
        missing = [name for name in BUFFER_NAMES if name not in buffers]
        if missing:
            raise ValueError(f"FP8 scaling buffers missing: {missing}")
        self.buffers = buffers
        self._rows = None
        self.forget_weights()

    @property
    def scale(self) -> torch.Tensor:
        return self.buffers["fp8_scale"]

    @property
    def scale_valid(self) -> torch.Tensor:
        return self.buffers["fp8_scale_valid"]

    @property
    def step_amax(self) -> torch.Tensor:
        return self.buffers["fp8_step_amax"]

    def backend(self, device: torch.device) -> Backend:
        return select_backend(self.recipe.backend, device, self.recipe.scaling)

    def specs(self, backend: Backend) -> tuple[Fp8FormatSpec, ...]:
        return tuple(backend_format_spec(backend, d) for d in role_dtypes(self.recipe))

    def values_dtype(self, backend: Backend) -> torch.dtype | None | bool:
        """False: quantize eagerly (fusion off, or a backend with its own cast: Gaudi). Else the dtype in which
        the fused kernel also writes the FP8 values for the GEMM: fp32 for the emulated backend (its GEMM runs on
        them; an eager FP8 -> fp32 cast is a slow pass of its own on CPU; bf16 where its GEMMs are BF16 GEMMs,
        megatron/fp8/cpu_gemm.py), None for real FP8 GEMMs."""
        if not self.fused_quantization or backend.name not in STATELESS_BACKENDS:
            return False
        return cpu_gemm.values_dtype() if backend.name == "emulated" else None

    def history_scaled_values(self, role: Fp8Role, backend: Backend, t: torch.Tensor, spec: Fp8FormatSpec,
                              record: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The eager layer's cast of `t` under delayed scaling whose history holds the scale (the steady state):
        (its values for the emulated GEMMs, the scale, its amax) from one compiled pass (`fused.known_values_and_amax`),
        the amax recorded when `record`; None where that does not apply (the caller takes the amax first)."""
        values_dtype = self.eager_values_dtype(backend)
        if not (self.role_delayed(role) and self.known_valid[int(role)]
                and fused.has_known_values(t, spec.torch_dtype, values_dtype)):
            return None
        scale, _ = self.role_rows(role)
        values, amax = fused.known_values_and_amax(t, scale, spec.max, spec.torch_dtype, values_dtype)
        if record:
            self.record_amax(role, amax)
        return values, scale, amax

    def eager_values_dtype(self, backend: Backend) -> torch.dtype | None:
        """The eager layer's (fusion off) cast of an activation or gradient: the dtype of the values the emulated
        GEMMs multiply, which `fused.known_values` writes in one compiled pass for every shape (where the run
        compiled it at start-up) instead of Q(x) that each GEMM then converts again; None for the other backends."""
        return cpu_gemm.values_dtype() if backend.name == "emulated" else None

    def weight_values_dtype(self, backend: Backend) -> torch.dtype | None | bool:
        """`values_dtype` for the weight: bf16 for the emulated GEMM with power-of-two scales (the dtype
        `QuantizedWeight.weight` converts to)."""
        values_dtype = self.values_dtype(backend)
        if values_dtype is not False and values_dtype is not None and (self.recipe.power_of_two_scales
                                                                       or values_dtype == torch.bfloat16):
            return torch.bfloat16
        return values_dtype

    def margin(self, role: Fp8Role) -> int:
        """The role's margin: the recipe's plus what the controller added (`extra_margin`)."""
        return self.recipe.margin + self.extra_margin[int(role)]

    def role_delayed(self, role: Fp8Role) -> bool:
        """Whether the role is cast with its delayed (history) scale: the recipe's delayed scaling, unless the
        controller switched the role to current scaling (`current_roles`)."""
        return self.recipe.scaling is Fp8Scaling.DELAYED and not self.current_roles[int(role)]

    def role_rows(self, role: Fp8Role) -> tuple[torch.Tensor, torch.Tensor]:
        """The role's entries of `fp8_scale` and `fp8_step_amax` as 0-d views, made once per buffer (indexing
        the buffers is a dispatched op each time, and an eager layer indexes them for every tensor it casts)."""
        role = int(role)  # dynamo (torch 2.13) recurses without end indexing a tuple with an IntEnum member
        if torch.compiler.is_compiling():  # traced into a graph: views made there are the graph's, never cached
            return self.scale[role], self.step_amax[role]
        rows = self._rows
        if rows is None or rows[0][0]._base is not self.scale or rows[0][1]._base is not self.step_amax:
            rows = self._rows = tuple((self.scale[r], self.step_amax[r]) for r in range(len(Fp8Role)))
        return rows[role]

    # --- the scaling state ----------------------------------------------------------------------------------------

    def record_amax(self, role: Fp8Role, amax: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """A training use of the role's tensor (`scaling.record_step_amax`); `scale` becomes the role's under
        tensorwise scaling only."""
        scale_row, step_amax_row = self.role_rows(role)
        record_step_amax(step_amax_row, amax, scale_row,
                         scale if self.recipe.scaling is Fp8Scaling.TENSORWISE else None)

    def note_weight_use(self, scale: torch.Tensor, amax: torch.Tensor, training: bool, made: Any = None) -> None:
        """Every training forward records the weight's amax, wherever the FP8 weight was made; a weight cached for
        the step (`made`) records it once (the running max would not change)."""
        if not training or (made is not None and made.recorded):
            return
        self.record_amax(Fp8Role.WEIGHT, amax, scale)
        if made is not None:
            made.recorded = True

    def scale_for(self, role: Fp8Role, amax: torch.Tensor, spec: Fp8FormatSpec, record: bool) -> torch.Tensor:
        """The scale to quantize a tensor of this `amax` with now; `record`: a training use (its amax goes into
        the step's running amax).

        No collective here, also not for current scaling: no FP8 tensor is communicated, so a rank's shard may
        use its own scale (replicated weights get identical scales anyway), and a blocking all-reduce per GEMM
        would cost more than the GEMM for small layers.
        """
        scale_row, _ = self.role_rows(role)
        delayed = self.role_delayed(role)
        if delayed and self.known_valid[int(role)]:  # the history's scale, no arithmetic (steady state)
            if record:
                self.record_amax(role, amax)
            return scale_row
        current = compute_scale(amax, spec.max, self.margin(role), self.recipe.power_of_two_scales,
                                previous=scale_row)
        if record:
            self.record_amax(role, amax, current)
        if not delayed:
            return current
        # Delayed: the scale from previous steps once the history holds one; the current amax before that.
        return torch.where(self.scale_valid[role], scale_row, current)

    def own_amax_scale(self, role: Fp8Role, amax: torch.Tensor, spec: Fp8FormatSpec) -> torch.Tensor:
        """The just-in-time scale of a tensor whose exact amax is known, under every scaling recipe."""
        return compute_scale(amax, spec.max, self.margin(role), self.recipe.power_of_two_scales,
                             previous=self.scale[role])

    def refresh_scale_validity(self) -> None:
        """Eagerly, before a compiled block runs: `known_valid` from the buffer (a device-to-host read, at most
        once per optimizer step while some role's scale is not valid yet: the first steps of a run)."""
        if self.recipe.scaling is not Fp8Scaling.DELAYED or all(self.known_valid):
            return
        if self.validity_read_at != self.num_updates:  # it changes only at a scaling update: one read per step
            self.learn_scale_validity(self.scale_valid.tolist())

    def learn_scale_validity(self, valid: list[bool]) -> None:
        """`known_valid` from values read off `fp8_scale_valid` after this step's update (by
        `refresh_scale_validity`, or for the whole model at once by `fp8_optimizer_step`)."""
        self.known_valid = tuple(bool(v) for v in valid)
        self.validity_read_at = self.num_updates

    def forget_scale_validity(self) -> None:
        """The scaling buffers were written from outside (a checkpoint's FP8 state, a warm-up's restore): read
        their validity again."""
        self.known_valid = (False, False, False)
        self.validity_read_at = None

    # --- quantizing activations and gradients ----------------------------------------------------------------------

    def fused_quantize(self, role: Fp8Role, t: torch.Tensor, spec: Fp8FormatSpec, values_dtype: torch.dtype | None,
                       record: bool, known_valid: bool = False, keep_q: bool = True
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """`scale_for` + `quantize` as one compiled function (fused.py): (Q(t), Q(t) in `values_dtype` or None,
        scale, amax); records the amax (and the tensorwise scale) as `scale_for` does. `known_valid`: the role's
        delayed scale is known to be valid, so the cast needs no amax. `keep_q` False: Q(t) is None where the
        values are made (`fused.quantize_tensor`)."""
        recipe = self.recipe
        delayed = self.role_delayed(role)
        q, values, scale, amax = fused.quantize_tensor(
            t.detach(), self.scale[role], self.scale_valid[role], delayed, spec.max, self.margin(role),
            recipe.power_of_two_scales, spec.torch_dtype, values_dtype, known_valid and delayed, keep_q)
        if record:
            self.record_amax(role, amax, scale)
        return q, values, scale, amax

    def quantize_input(self, backend: Backend, spec: Fp8FormatSpec, x2d: torch.Tensor, input_amax: torch.Tensor | None,
                       values_dtype: torch.dtype | None | bool, record: bool, known_valid: bool = False,
                       keep_q: bool = True
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(Q(x), Q(x) in the emulated GEMM's dtype when the fused kernel wrote it else None, scale, amax);
        records the amax (and the tensorwise scale) when `record`. With `input_amax` (the exact amax of this very
        x) the scale is x's own: current scaling for free. `keep_q` False: Q(x) may be None where the values are
        made (the fused pass without a given amax)."""
        if input_amax is None:
            if values_dtype is not False:
                return self.fused_quantize(Fp8Role.INPUT, x2d, spec, values_dtype, record, known_valid, keep_q)
            return self.eager_cast(Fp8Role.INPUT, backend, x2d, spec, record)
        x_amax = input_amax.float()
        self.scale_for(Fp8Role.INPUT, x_amax, spec, record)  # records the amax (and a tensorwise scale)
        s_x = self.own_amax_scale(Fp8Role.INPUT, x_amax, spec)
        if values_dtype is not False:  # one compiled pass with the known scale
            q_x, v_x = fused.quantize_known(x2d, s_x, spec.max, spec.torch_dtype, values_dtype)
            return q_x, v_x, s_x, x_amax
        return (*self.cast_eagerly(backend, x2d, s_x, spec), s_x, x_amax)

    def eager_cast(self, role: Fp8Role, backend: Backend, t: torch.Tensor, spec: Fp8FormatSpec, record: bool
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(Q(t) or None, its values for the emulated GEMMs or None, scale, amax): the eager layer's cast of an
        activation or gradient (fused quantization off), the amax recorded when `record`. Under delayed scaling's
        steady state one compiled pass gives the values and the amax (`history_scaled_values`); else the amax first,
        then the scale (`scale_for`) and the cast (`cast_eagerly`)."""
        found = self.history_scaled_values(role, backend, t, spec, record)
        if found is not None:
            return (None, *found)
        amax = amax_of(t)
        scale = self.scale_for(role, amax, spec, record)
        return (*self.cast_eagerly(backend, t, scale, spec), scale, amax)

    def cast_eagerly(self, backend: Backend, t: torch.Tensor, scale: torch.Tensor, spec: Fp8FormatSpec
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(None, t's values for the emulated GEMMs) where the start-up made the graphs of `fused.known_values`, else
        (Q(t), None)."""
        values = fused.known_values(t, scale, spec.max, spec.torch_dtype, self.eager_values_dtype(backend))
        return (backend.quantize(t, scale, spec), None) if values is None else (None, values)

    def record_stats(self, role: Fp8Role, t: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     spec: Fp8FormatSpec, tile: Any = None) -> None:
        """Statistics of one quantization, when they are switched on (`fp8_stats.Fp8Stats.record`)."""
        if self.stats_enabled:
            if self.stats is None or self.stats.device != self.scale.device:
                self.stats = fp8_stats.Fp8Stats(len(Fp8Role), self.scale.device)
            self.stats.record(role, t, q, scale, spec, tile, fused=self.fused_quantization)

    # --- the weight ------------------------------------------------------------------------------------------------

    def quantized_weight(self, weight: torch.Tensor, backend: Backend, spec: Fp8FormatSpec) -> QuantizedWeight:
        """This step's FP8 weight: cached (made on the first call after an update), per call under ZeRO-3, or the
        FP8 weight FSDP2 gathered (`Fp8GatheredWeight`, cast on the shards: taken as it is)."""
        if isinstance(weight, Fp8GatheredWeight):
            return QuantizedWeight(None, weight._data, weight._scale, weight._amax)
        key = (*weight_storage_key(weight), backend.name)
        cache = self.weight_cache
        if isinstance(cache, QuantizedWeight) and cache.key == key:
            return cache
        values_dtype = self.weight_values_dtype(backend)
        values = None
        with torch.no_grad():
            if values_dtype is not False:
                # Recorded by `note_weight_use` instead: the cast may happen in an evaluation pass.
                q, values, scale, amax = self.fused_quantize(Fp8Role.WEIGHT, weight, spec, values_dtype, False)
            else:
                amax = amax_of(weight)
                scale = self.scale_for(Fp8Role.WEIGHT, amax, spec, record=False)
                q = backend.quantize(weight, scale, spec)
            self.record_stats(Fp8Role.WEIGHT, weight, q, scale, spec)
        self.weight_quantizations += 1
        made = QuantizedWeight(key, q, scale, amax, values=values)
        self.cache_weight(made)
        return made

    def cast_weight(self, weight: torch.Tensor, backend: Backend, spec: Fp8FormatSpec, scale: torch.Tensor,
                    values_dtype: torch.dtype | None | bool, column_scale: torch.Tensor | None,
                    scaled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(Q(W diag(c)) or Q(W), its values for the GEMM or None) with a known scale: fused, one pass that never
        materializes W diag(c); eager, from `scaled` (W diag(c) when the caller made it already)."""
        if values_dtype is not False:
            return fused.quantize_known(weight, scale, spec.max, spec.torch_dtype, values_dtype,
                                        column_scale=column_scale)
        if scaled is None:
            scaled = weight if column_scale is None else column_scaled(weight, column_scale)
        return backend.quantize(scaled, scale, spec), None

    def requantized_weight(self, weight: torch.Tensor, backend: Backend, spec: Fp8FormatSpec, scale: torch.Tensor,
                           amax: torch.Tensor, column_scale: torch.Tensor | None) -> QuantizedWeight:
        """The forward's FP8 weight (or W diag(c)) made again with its scale: the same values and scale give the
        same bits (the fused and eager casts are bitwise equal, tests/unit/test_fp8_fused.py); a weight FSDP2
        gathered in FP8 is that FP8 weight again. Records nothing."""
        if isinstance(weight, Fp8GatheredWeight):
            return QuantizedWeight(None, weight._data, weight._scale, weight._amax)
        with torch.no_grad():
            q, values = self.cast_weight(weight, backend, spec, scale, self.weight_values_dtype(backend), column_scale)
        return QuantizedWeight(None, q, scale, amax, values=values)

    def quantized_scaled_weight(self, weight: torch.Tensor, backend: Backend, spec: Fp8FormatSpec,
                                column_scale: torch.Tensor, group: Any = None) -> QuantizedWeight:
        """Q(W diag(column_scale)), made for this call only (linear.py, "Per-input-channel weight scale")."""
        with torch.no_grad():
            q, values, scale, amax = self.column_scaled_weight(weight, backend, spec, column_scale, group)
            if self.stats_enabled:
                self.record_stats(Fp8Role.WEIGHT, column_scaled(weight, column_scale), q, scale, spec)
        self.weight_quantizations += 1
        return QuantizedWeight(None, q, scale, amax, values=values)

    def column_scaled_weight(self, weight: torch.Tensor, backend: Backend, spec: Fp8FormatSpec,
                             column_scale: torch.Tensor, group: Any, maxima: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(Q(W diag(c)), its values for the GEMM or None, scale, amax): the scale from its own amax, max-reduced
        over `group`. Fused, the amax comes from W's column maxima (`maxima`, else this step's `column_maxima`)
        and W diag(c) is never materialized: one cast pass per call. The unfused reference materializes W diag(c)
        and reduces it. Records nothing and counts nothing (callers do)."""
        values_dtype = self.weight_values_dtype(backend)
        scaled = None
        if values_dtype is not False:
            amax = fused.column_scaled_amax(self.column_maxima(weight) if maxima is None else maxima, column_scale)
        else:
            scaled = column_scaled(weight.detach(), column_scale)
            amax = amax_of(scaled)
        comm.all_reduce(amax, group, comm.ReduceOp.MAX)  # a no-op without a group
        scale = self.own_amax_scale(Fp8Role.WEIGHT, amax, spec)
        q, values = self.cast_weight(weight, backend, spec, scale, values_dtype, column_scale, scaled=scaled)
        return q, values, scale, amax

    def column_maxima(self, weight: torch.Tensor) -> torch.Tensor:
        """max_i |W_ij| per input channel j ([K], fp32), computed once per optimizer step (keyed like the FP8
        weight cache; per call for a per-call weight, ZeRO-3): what the amax of W diag(c) needs, whatever c."""
        key = weight_storage_key(weight)
        cached = self.column_maxima_cache
        if cached is not None and cached[0] == key and not self.weight_per_call:
            return cached[1]
        with torch.no_grad():
            maxima = fused.column_maxima(weight.detach())
        self.column_maxima_passes += 1
        if not self.weight_per_call:
            self.column_maxima_cache = (key, maxima)
        return maxima

    def uses_step_weight(self, backend: Backend) -> bool:
        """Whether `refresh_step_weight` prepares this layer's FP8 weight (for `backend`, the layer's) for the
        traced path (eagerly, outside the graph; a Smooth-SwiGLU fc2 still makes W diag(c) per call)."""
        return self.takes_traced_path() and backend.name in STATELESS_BACKENDS and not self.weight_per_call

    def takes_traced_path(self) -> bool:
        """The configuration is one the traced path implements (traced.py), whatever the call."""
        recipe = self.recipe
        return (self.trace_in_compiled_graph and self.fused_quantization and recipe.tiles is None
                and not recipe.grad_stochastic_rounding)

    def refresh_step_weight(self, weight: torch.Tensor) -> None:
        """Eagerly, before a compiled block runs (its pre-hook, outside the graph): this step's FP8 weight from the
        per-step cache (quantized once per optimizer step, as the eager layer does), for the traced path to read
        instead of quantizing per call. Only for layers the traced path takes; None for the others."""
        cache = self.weight_cache
        if self.step_weight is not None and cache is not None and cache.key[:2] == weight_storage_key(weight):
            return  # made this step (the key's backend follows the device, which `bind` would have reset)
        backend = self.backend(weight.device)
        traced = self.takes_traced_path() and backend.name in STATELESS_BACKENDS
        if isinstance(weight, Fp8GatheredWeight) and traced:
            # FSDP2 gathered it in FP8 for this call (--fp8-param-gather): the graph takes its bytes as they are,
            # a view of FSDP2's gather buffer, which FSDP2 refills with the same bytes before backward. No copy is
            # made (dgrad's W^T is transposed in the backward graph), so nothing outlives the gather.
            self.step_weight = (weight._data, weight._scale, weight._amax, None)
            return
        if not self.uses_step_weight(backend):
            self.step_weight = None
            return
        with torch.autocast(weight.device.type, enabled=False):
            made = self.quantized_weight(weight, backend, self.specs(backend)[Fp8Role.WEIGHT])
            pow2 = self.recipe.power_of_two_scales
            # dgrad's operand too, once per step: inside the graph it would be transposed per micro-batch.
            transposed = made.weight_t(backend, pow2) if backend.wants_contiguous_operands else None
            self.step_weight = (made.weight(backend, pow2), made.scale, made.amax, transposed)

    def refresh_step_column_maxima(self, weight: torch.Tensor) -> None:
        """Eagerly, before a compiled block runs: this step's column maxima for a column-scaled layer the traced
        path takes (None for the others: the graph then reduces W itself)."""
        backend = self.backend(weight.device)
        self.step_column_maxima = self.column_maxima(weight) if self.uses_step_weight(backend) else None

    def forget_weights(self) -> None:
        """Drop the FP8 weight and W's column maxima; the next forward re-quantizes (after each optimizer step,
        `fp8_optimizer_step`, and when the weight's device changes)."""
        self.weight_generation += 1
        self.weight_cache = None
        self.step_weight = None
        self.column_maxima_cache = self.step_column_maxima = None


def _normalized(changes: dict[str, Any]) -> dict[str, Any]:
    """Settings as their declared types: tuples for the per-role fields (read back from JSON as lists), bools."""
    out = {}
    for name, value in changes.items():
        if name == "extra_margin":
            value = tuple(int(v) for v in value)
        elif name == "current_roles":
            value = tuple(bool(v) for v in value)
        else:
            value = bool(value)
        out[name] = value
    return out
