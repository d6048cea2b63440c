"""Fp8AdamW: decoupled-weight-decay Adam whose two moments are *stored* in FP8.

What it does (FP8_SPEC section 4): between steps the first moment m lives in E4M3 and the second
moment v in E5M2 as real 1-byte tensors, each with FP32 scales (one per tensor, or one per block of
`block_size` elements of the flattened tensor). Each step dequantizes m and v, runs the AdamW update in
FP32 on the FP32 master weights, and requantizes m and v with scales from their fresh amax. State is
~2 bytes per parameter (+ 8 bytes per block of scales) instead of AdamW's 8.

Which tensors get FP8 states is a rule, not a guess: matrices (`p.ndim >= 2`) do; 1-D tensors (norm
weights, biases: few elements, and the paper keeps them in FP32) keep FP32 states. A param group may
carry `"fp8_states": True/False` to override the rule for its parameters. `state_summary()` returns
the counts for the startup log line.

Numerics of v (why E5M2, and what happens at the bottom of its range):
- v = EMA(g^2) spans many orders of magnitude inside one tensor, and the update divides by sqrt(v).
  E5M2 with a scale from the current amax represents v down to amax * 2**-32 (32 binades); E4M3 only
  down to amax * 2**-18, which is why v in E4M3 fails (the paper's finding; see the tests).
- We store v itself, not sqrt(v): sqrt(v) would double the range but also double the relative error
  of the update (2 mantissa bits on sqrt(v) instead of on v), and the range of E5M2 per block is
  already enough when underflow is handled as follows.
- A v element below its block's flush threshold is stored as 0 while m may not be 0 (m has its own
  scale). Dividing by sqrt(0) + eps would give an update of m / 1e-8: a blow-up. Exact Adam keeps
  |m| <= C * sqrt(v) (Cauchy-Schwarz on the two EMAs, C ~ 7 for betas 0.9/0.999), so the update is
  bounded by ~C * lr. We therefore floor the *denominator* where v was stored as 0 at the largest value
  that could have been flushed (min_subnormal / 2 * scale_inv for round-to-nearest, min_subnormal *
  scale_inv for stochastic rounding). The true v was at most that, so the step can only be smaller
  than exact Adam's, and the C * lr bound survives underflow. The floor is not written back into v
  (it would freeze tiny v's at the threshold for ever). An all-zero block has scale_inv 0: no floor.
- eps enters as in torch.optim.AdamW: denom = sqrt(v_hat) + eps, after the floor.
- v is requantized with stochastic rounding by default (`stochastic_rounding=True`); m with round-to-
  nearest. Why: E5M2 has 2 mantissa bits, so a grid step is 12.5-25% of the value. With beta2 = 0.95 a
  decaying v shrinks by 5% per step (0.1% at 0.999): less than half a step, so round-to-nearest puts it
  back where it was, while an increase by a large g^2 sticks. The error is one-sided: v can grow but
  not shrink, and the update is systematically too small (0.72-0.89x AdamW's at beta2 0.95; a row that
  saw one gradient burst and then zeros kept 20x its exact v; docs/fp8_adam.md). Stochastic rounding
  is unbiased (E[q] = x), so every decay survives on average. Its noise is a random walk damped by
  beta2, and its variance per step is proportional to the step's change (a value on the grid that
  moves by d rounds away with probability d / ulp), so the stored v stays close to the exact one
  (update within 1-3% of AdamW's, the burst row within 2%; measured against sqrt(v), COAT's range
  expansion and error feedback, see docs/fp8_adam.md). m needs no such help: beta1 = 0.9 moves it by
  10% of (g - m) per step, more than half an E4M3 step (<= 6.25%), and its errors have no sign
  preference; stochastic rounding of m only adds noise (measured). The noise is counter-based
  (`counter_uniform`: a hash of a fixed seed, the parameter's ordinal, the step and the element index,
  computed in int32 tensors whose every value stays below 2**31, so it needs no 64-bit integers on any device),
  drawn inside the update kernel: data-parallel replicas stay identical, resume is exact with no
  generator state to save, and the compiled kernel draws exactly the eager kernel's noise (a
  torch.Generator stream costs more than the whole fused update on CPU and cannot enter a compiled
  region). `stochastic_rounding=False` (`--no-fp8-optimizer-stochastic-rounding`) restores round-to-nearest.

Compilation: `compile=True` (the training default, `--no-fp8-optimizer-compile` turns it off) runs the
per-chunk update through torch.compile: one fused pass per chunk (C++ on CPU, Triton on GPU) instead of
~20 eager ops. A compile failure falls back to eager with a warning. On CPU a tensor updated in one call (per-tensor
scales, one chunk) runs a direct graph instead (megatron/fp8/direct.py: one graph for every size, no per-call
guards), built by the start-up's warm-up; `direct_calls = False` keeps torch.compile's.

State dict: plain tensors/ints/floats/strings (FP8 tensors included), loadable with
`torch.load(weights_only=True)`. Loading converts: a torch.optim.AdamW state (FP32 moments), or one of
ours written with another block size or dtype, is dequantized and requantized into this optimizer's
formats; a state whose layout matches is copied bit for bit (exact resume). Shapes that do not fit the
parameter, and AMSGrad/maximize states, raise ValueError.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from megatron import comm
from megatron.fp8.formats import format_backend_of
from megatron.fp8.direct import DirectGraphs
from megatron.fp8.fused import CompiledOrEager
from megatron.optimizer import fp8_adam_shards as shards
from megatron.partitioned import full_numel, full_shape
from megatron.optimizer.fp8_state_quant import (
    MomentDtype, MomentFormat, block_layout, counter_uniform, dequantize, dequantize_with_floor, moment_format,
    quantize, state_nbytes, storage_numel, u32_halves,
)

logger = logging.getLogger(__name__)

_MOMENTS = ("exp_avg", "exp_avg_sq")
_FP32 = moment_format(MomentDtype.FP32)
# Fixed seed of the stochastic-rounding noise: identical on every rank (see module docstring).
_SR_SEED = 0x5EED
_MASK64 = (1 << 64) - 1
# torch.optim.AdamW group options that mean nothing here (dropped when loading its state dict).
_FOREIGN_GROUP_KEYS = {"amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                       "decoupled_weight_decay", "fp8_states"}


@dataclass(frozen=True)
class Fp8StateSummary:
    """How many tensors/elements keep low-precision states, for the startup log line."""

    m_format: str
    v_format: str
    fp8_tensors: int
    fp8_params: int
    fp32_tensors: int
    fp32_params: int

    def __str__(self) -> str:
        return (f"Fp8AdamW: m={self.m_format} v={self.v_format} states for {self.fp8_tensors} tensors "
                f"({self.fp8_params:,} params); FP32 states for {self.fp32_tensors} tensors "
                f"({self.fp32_params:,} params)")


def _chunk_step(param: Optional[torch.Tensor], grad: torch.Tensor,
                m_data: torch.Tensor, m_scale_inv: Optional[torch.Tensor],
                v_data: torch.Tensor, v_scale_inv: Optional[torch.Tensor],
                decay: torch.Tensor, step_size: torch.Tensor, bc2_sqrt: torch.Tensor,
                beta1: float, beta2: float, eps: float,
                m_fmt: MomentFormat, v_fmt: MomentFormat, stochastic: bool, requantize: bool,
                m_amax: Optional[torch.Tensor], v_amax: Optional[torch.Tensor],
                start: torch.Tensor, noise_key: Optional[torch.Tensor]):
    """AdamW on one flat chunk of one parameter whose moments are stored in `m_fmt`/`v_fmt`.

    Updates `param` in place unless it is None; returns (m_data, m_scale_inv, v_data, v_scale_inv) if
    `requantize`, else the amax of the new m and v (pass 1 of per-tensor scaling, see `_step_stored`).
    `m_amax`/`v_amax` impose a per-tensor scale; None = the chunk's own per-block amax.
    `noise_key` (a 32-bit key as `u32_halves` makes it) selects stochastic rounding of v with `counter_uniform`
    noise for the stored elements from `start` (likewise) on, drawn inside the kernel (a fused pass, no noise tensor
    in memory) and equal in eager and compiled form; None = round to nearest.
    Step-dependent scalars are 0-d tensors so a torch.compile'd version does not recompile every step.
    """
    numel = grad.numel()
    g = grad.float()
    m = dequantize(m_data, m_scale_inv, numel)
    v, v_floor = dequantize_with_floor(v_data, v_scale_inv, numel, v_fmt, stochastic)
    m = torch.lerp(m, g, 1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    if param is not None:
        # beta2 * floor: the most the flushed previous v could have contributed to this step's v.
        denom = (v + beta2 * v_floor).sqrt() / bc2_sqrt + eps
        param.mul_(decay)
        param.sub_(step_size * m / denom)
    if not requantize:
        return m.abs().amax(), v.amax()
    m_data, m_scale_inv = quantize(m, m_fmt, None, m_amax)  # nearest: see the module docstring
    noise = None if noise_key is None else counter_uniform(storage_numel(numel, v_fmt), start, noise_key, g.device)
    v_data, v_scale_inv = quantize(v, v_fmt, noise, v_amax)
    return m_data, m_scale_inv, v_data, v_scale_inv


def _tensor_step(param: torch.Tensor, grad: torch.Tensor, m_data: torch.Tensor, m_scale_inv: Optional[torch.Tensor],
                 v_data: torch.Tensor, v_scale_inv: Optional[torch.Tensor], decay: torch.Tensor,
                 step_size: torch.Tensor, bc2_sqrt: torch.Tensor, beta1: float, beta2: float, eps: float,
                 m_fmt: MomentFormat, v_fmt: MomentFormat, stochastic: bool, start: torch.Tensor,
                 noise_key: Optional[torch.Tensor]):
    """Both passes of a per-tensor-scaled update (`Fp8AdamW._step_stored`) in one call, for a tensor that is one chunk
    and whose amaxes need no reduction across ranks: `_chunk_step`'s pass 1 (the parameter, the new moments' amaxes),
    then its pass 2 (the moments quantized with them), the same operations as the two calls. Compiled, one graph
    instead of two calls, in which inductor computes the new moments once."""
    zero = torch.zeros((), device=grad.device)
    amaxes = [torch.maximum(zero, a) for a in _chunk_step(
        param, grad, m_data, m_scale_inv, v_data, v_scale_inv, decay, step_size, bc2_sqrt, beta1, beta2, eps, m_fmt,
        v_fmt, stochastic, False, None, None, start, None)]
    m_amax, v_amax = (a if f.is_fp8 and f.block_size == 0 else None for a, f in zip(amaxes, (m_fmt, v_fmt)))
    return _chunk_step(None, grad, m_data, m_scale_inv, v_data, v_scale_inv, decay, step_size, bc2_sqrt, beta1, beta2,
                       eps, m_fmt, v_fmt, stochastic, True, m_amax, v_amax, start, noise_key)


def _tensor_step_direct(param: torch.Tensor, grad: torch.Tensor, m_data: torch.Tensor, m_scale_inv: torch.Tensor,
                        v_data: torch.Tensor, v_scale_inv: torch.Tensor, decay: torch.Tensor, step_size: torch.Tensor,
                        bc2_sqrt: torch.Tensor, start: torch.Tensor, noise_key: torch.Tensor, beta1: float,
                        beta2: float, eps: float, m_fmt: MomentFormat, v_fmt: MomentFormat, stochastic: bool):
    """`_tensor_step` with its tensors first (a direct graph's calling convention, megatron/fp8/direct.py)."""
    return _tensor_step(param, grad, m_data, m_scale_inv, v_data, v_scale_inv, decay, step_size, bc2_sqrt, beta1, beta2,
                        eps, m_fmt, v_fmt, stochastic, start, noise_key)


# One compiled graph of `_tensor_step_direct` for every size of a CPU parameter, called without dynamo's guards and
# AOTAutograd's per-call work (docs/performance.md, "Direct calls"). The same kernels as the compiled update's (every
# reduction in it is a maximum: its order changes nothing).
_DIRECT = DirectGraphs()


# Elements per chunk of the update on CPU: temporaries of a few MB are reused by the allocator instead of
# page-faulting fresh tensor-sized buffers every step (that cost 30x in eager mode on CPU), and they
# stay cache-friendly. A multiple of every sensible block size.
_CHUNK = 1 << 20
# On a GPU (or Gaudi) a chunk is one kernel launch: the compiled update's host cost is ~120 us per call
# (measured on the CPU, docs/fp8_adam.md) while 2^20 elements take a few us of HBM bandwidth, so 2^20-element
# chunks would leave the device idle (Llama2-7B without sharding: 6,400 calls, ~0.8 s of host time per step).
# 2^26 elements (64 Mi; ~0.3 ms of H200 bandwidth per pass) keep it busy; the compiled kernel's temporaries stay
# fused, the eager fallback's are a few fp32 copies of one chunk (256 MiB each).
_CHUNK_ACCELERATOR = 1 << 26


def _chunk_elements(device: torch.device, block_size: int) -> int:
    """Elements per update chunk on `device`: a whole number of scale blocks. The result of a step does not
    depend on it (blocks never straddle chunks; per-tensor scales take the amax over all chunks first;
    stochastic rounding's noise is keyed on the element's position), tests/unit/test_fp8_adam.py checks it."""
    target = _CHUNK if device.type == "cpu" else _CHUNK_ACCELERATOR
    return max(target // max(block_size, 1), 1) * max(block_size, 1)


def _validate(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float, m_dtype: str,
              v_dtype: str, block_size: int) -> None:
    dtypes = ", ".join(d.value for d in MomentDtype)
    for flag, value in (("--fp8-optimizer-m-dtype", m_dtype), ("--fp8-optimizer-v-dtype", v_dtype)):
        if value not in {d.value for d in MomentDtype}:
            raise ValueError(f"{flag} must be one of {dtypes}; got {value!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
        raise ValueError("--fp8-optimizer-block-size must be 0 (one scale per tensor) or a positive number "
                         f"of elements per scale block (e.g. 128 or 256); got {block_size!r}")
    if not lr >= 0.0:
        raise ValueError(f"--lr must be >= 0; got {lr}")
    if not eps >= 0.0:
        raise ValueError(f"--adam-eps must be >= 0; got {eps}")
    for flag, beta in zip(("--adam-beta1", "--adam-beta2"), betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{flag} must be in [0, 1); got {beta}")
    if not weight_decay >= 0.0:
        raise ValueError(f"--weight-decay must be >= 0; got {weight_decay}")


class Fp8AdamW(torch.optim.Optimizer):
    """AdamW with m/v stored in FP8 (default m E4M3, v E5M2) for matrices, FP32 for 1-D tensors."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, m_dtype: str = "e4m3",
                 v_dtype: str = "e5m2", block_size: int = 0, stochastic_rounding: bool = True,
                 compile: bool = False, format_backend: Optional[str] = None) -> None:
        _validate(lr, betas, eps, weight_decay, m_dtype, v_dtype, block_size)
        if v_dtype == MomentDtype.E4M3.value:
            logger.warning("Fp8AdamW: v in E4M3 lacks the range 1/sqrt(v) needs; E5M2 is recommended")
        self.block_size = block_size
        self.stochastic_rounding = bool(stochastic_rounding)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fp8_states=None)
        super().__init__(params, defaults)
        # The FP8 limits of the device the moments live on (Gaudi2's E4M3 maximum is 240, not 448): from the
        # parameters unless `format_backend` says ("cpu" = OCP, "hpu").
        if format_backend is None:
            devices = [p.device for group in self.param_groups for p in group["params"]]
            format_backend = format_backend_of(devices[0]) if devices else "cpu"
        self.format_backend = format_backend
        self.m_format = moment_format(m_dtype, block_size, format_backend)
        self.v_format = moment_format(v_dtype, block_size, format_backend)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"Fp8AdamW updates FP32 master weights; got a {p.dtype} parameter of "
                                     f"shape {tuple(p.shape)} (keep master weights in FP32, e.g. --bf16 "
                                     "with an FP32 master copy)")
                if self.uses_fp8_states(p, group):
                    shards.check_blocks(p, block_size)
        # FSDP2: the group over which the shards' per-tensor amaxes are max-reduced (fp8_adam_shards.py)
        self.shard_group: Any = None
        # Compiled, on CPU: a tensor updated in one call takes the direct graph (`_DIRECT`); False: torch.compile's.
        self.direct_calls = True
        # Shapes are static for the first chunk length and become dynamic on the second (torch's automatic
        # dynamic shapes): full chunks and every tensor's tail then share two graphs per variant (pass 1 /
        # pass 2 / blockwise) instead of one graph per distinct tail length.
        if compile and self.format_backend == "hpu":  # inductor is not Gaudi's graph compiler: eager (lazy mode fuses)
            logger.info("Fp8AdamW: --fp8-optimizer-compile does not apply on Gaudi; the update runs eagerly")
            compile = False
        self._kernel: Optional[CompiledOrEager] = (
            CompiledOrEager(_chunk_step, "Fp8AdamW's update", dynamic=None, fullgraph=False) if compile else None)
        self._tensor_kernel: Optional[CompiledOrEager] = (
            CompiledOrEager(_tensor_step, "Fp8AdamW's update", dynamic=None, fullgraph=False) if compile else None)
        self._scalar_memo: Dict[Tuple, List[torch.Tensor]] = {}

    # ----------------------------------------------------------------------------- the rule
    def uses_fp8_states(self, p: torch.Tensor, group: Dict[str, Any]) -> bool:
        """The rule: the group's `fp8_states` if set, else True for matrices (ndim >= 2)."""
        override = group.get("fp8_states")
        return bool(override) if override is not None else len(full_shape(p)) >= 2  # full: ZeRO-3 partitions

    def _formats(self, p: torch.Tensor, group: Dict[str, Any]) -> Tuple[MomentFormat, MomentFormat]:
        return (self.m_format, self.v_format) if self.uses_fp8_states(p, group) else (_FP32, _FP32)

    def state_summary(self) -> Fp8StateSummary:
        """Counts of tensors/params with low-precision vs FP32 states (for a startup log line)."""
        counts = [0, 0, 0, 0]
        for group in self.param_groups:
            for p in group["params"]:
                i = 0 if self.uses_fp8_states(p, group) else 2
                counts[i] += 1
                counts[i + 1] += full_numel(p)
        return Fp8StateSummary(self.m_format.bits_label, self.v_format.bits_label, *counts)

    def state_nbytes(self) -> int:
        """Bytes held by all state tensors (moments and scales; the step counters excluded)."""
        return sum(state_nbytes(*(s.get(k) for k in ("exp_avg", "exp_avg_scale_inv", "exp_avg_sq",
                                                       "exp_avg_sq_scale_inv"))) for s in self.state.values())

    # ----------------------------------------------------------------------------- state
    def _noise_key(self, p: torch.Tensor, ordinal: int, step: float) -> Optional[torch.Tensor]:
        """The 32-bit name of the stochastic-rounding stream of parameter `p` at `step` (int32 halves,
        `u32_halves`), or None for round-to-nearest. `ordinal` is p's position in the param groups (stable
        across a resume; DeepSpeed's flat partitions have theirs). A splitmix64-style mix of (seed,
        ordinal, step): distinct streams per parameter and step, the same on every rank."""
        if not self.stochastic_rounding:
            return None
        z = (_SR_SEED * 0x9E3779B97F4A7C15 + ordinal * 0xBF58476D1CE4E5B9
             + int(step) * 0x94D049BB133111EB) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return u32_halves(z ^ (z >> 31), p.device)

    @staticmethod
    def _new_moment(p: torch.Tensor, fmt: MomentFormat, zero: bool = True
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        make = torch.zeros if zero else torch.empty
        if not fmt.is_fp8:
            return make(p.shape, dtype=fmt.torch_dtype, device=p.device), None
        n_blocks, _ = block_layout(p.numel(), fmt.block_size)
        data = make(storage_numel(p.numel(), fmt), dtype=fmt.torch_dtype, device=p.device)
        return data, make(n_blocks, dtype=torch.float32, device=p.device)

    def _init_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        state: Dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32)}
        for name, fmt in zip(_MOMENTS, self._formats(p, group)):
            data, scale_inv = self._new_moment(p, fmt)
            state[name] = data
            if scale_inv is not None:
                state[name + "_scale_inv"] = scale_inv
        return state

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ordinal = -1
        self._scalar_memo = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            batch: Dict[str, List] = defaultdict(list)  # FP32-state params: one foreach pass
            for p in group["params"]:
                ordinal += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Fp8AdamW does not support sparse gradients")
                state = self.state[p]
                values, grad = shards.local(p), shards.local(p.grad)  # FSDP2: this rank's rows
                if not state:
                    state.update(self._init_state(values, group))
                state["step"] += 1
                step = float(state["step"])
                m_fmt, v_fmt = self._formats(p, group)
                if m_fmt is _FP32 and v_fmt is _FP32:
                    for key, value in (("params", values), ("grads", grad), ("m", state["exp_avg"]),
                                       ("v", state["exp_avg_sq"]), ("step", step)):
                        batch[key].append(value)
                    continue
                self._step_stored(values, grad, state, group, step, (m_fmt, v_fmt), ordinal, shards.flat_offset(p))
            if batch:
                self._step_fp32_foreach(batch, lr, beta1, beta2, eps, wd)
        return loss

    def one_call(self, numel: int, device: torch.device, fmts: Tuple[MomentFormat, MomentFormat]) -> bool:
        """Whether a tensor of `numel` elements with moments in `fmts` takes `_tensor_step`: per-tensor scaling, one
        chunk, and no shard group to reduce its amaxes over."""
        per_tensor = any(f.is_fp8 and f.block_size == 0 for f in fmts)
        return per_tensor and self.shard_group is None and numel <= _chunk_elements(device, self.block_size)

    def _step_stored(self, p: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any],
                     step: float, fmts: Tuple[MomentFormat, MomentFormat], ordinal: int, offset: int,
                     one_call: Optional[bool] = None) -> None:
        """Update one parameter (`p`, `grad`: this rank's elements, the first at `offset` of the whole tensor)
        chunk by chunk. Per-tensor FP8 scaling needs the amax of the *new* moments before any chunk can be
        quantized, so it takes two passes: pass 1 updates the parameter and collects the amaxes (max-reduced over
        `shard_group` under FSDP2), pass 2 recomputes m and v from the old states and quantizes them. A tensor that
        is one chunk takes both in one call (`one_call`, decided by the method of that name unless given)."""
        m_fmt, v_fmt = fmts
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        # Device scalars by fills (torch.full): torch.tensor(x, device=cuda) would copy from the host and
        # synchronise the stream once per tensor (tests/unit/test_host_sync.py).
        scalars = self._scalars(p.device, (1.0 - lr * group["weight_decay"], lr / (1.0 - beta1**step),
                                           math.sqrt(1.0 - beta2**step)))
        fixed = (beta1, beta2, group["eps"], m_fmt, v_fmt, self.stochastic_rounding)
        old = [(state[name], state.get(name + "_scale_inv")) for name in _MOMENTS]
        flat_p, flat_g = p.view(-1), grad.reshape(-1)
        n = p.numel()
        chunk = _chunk_elements(p.device, self.block_size)
        per_tensor = any(f.is_fp8 and f.block_size == 0 for f in fmts)
        whole = self.one_call(n, p.device, fmts) if one_call is None else one_call
        amaxes: List[Optional[torch.Tensor]] = [None, None]
        noise_key = self._noise_key(p, ordinal, step) if v_fmt.dtype is not MomentDtype.FP32 else None
        starts = [u32_halves(offset + a, p.device) for a in range(0, n, chunk)]
        if per_tensor and not whole:  # pass 1
            amaxes = [torch.zeros((), device=p.device), torch.zeros((), device=p.device)]
            for a in range(0, n, chunk):
                length = min(chunk, n - a)
                ins = [x for (d, si), f in zip(old, fmts) for x in self._moment_slice(d, si, f, a, length)]
                out = self._call(flat_p[a:a + length], flat_g[a:a + length], *ins, *scalars, *fixed, False,
                                 None, None, starts[a // chunk], None)
                amaxes = [torch.maximum(x, y) for x, y in zip(amaxes, out)]
            if self.shard_group is not None:  # the whole tensor's amax (FSDP2: every rank holds some rows)
                both = torch.stack(amaxes)
                comm.all_reduce(both, self.shard_group, comm.ReduceOp.MAX)
                amaxes = list(both.unbind())
            amaxes = [am if f.is_fp8 and f.block_size == 0 else None for am, f in zip(amaxes, fmts)]
        if whole:  # both passes in one call (the tensor is this one chunk); its outputs are the new moments
            ins = [x for (d, si), f in zip(old, fmts) for x in self._moment_slice(d, si, f, 0, n)]
            out = self._call_tensor(flat_p, flat_g, *ins, *scalars, *fixed, starts[0], noise_key)
            new = [self._as_moment(p, f, q, qs) for f, q, qs in zip(fmts, out[0::2], out[1::2])]
        else:
            new = self._chunked_moments(p, flat_p, flat_g, old, scalars, fixed, per_tensor, amaxes, starts,
                                        noise_key, chunk)
        for name, (d, si) in zip(_MOMENTS, new):
            state[name] = d
            if si is not None:
                state[name + "_scale_inv"] = si

    def _scalars(self, device: torch.device, values: Tuple[float, ...]) -> List[torch.Tensor]:
        """The update's step scalars as 0-d tensors, made once per step for all tensors that share them (`step`
        empties the memo)."""
        key = (device, values)
        if key not in self._scalar_memo:
            self._scalar_memo[key] = [torch.full((), x, dtype=torch.float32, device=device) for x in values]
        return self._scalar_memo[key]

    def _chunked_moments(self, p: torch.Tensor, flat_p: torch.Tensor, flat_g: torch.Tensor, old: List, scalars: List,
                         fixed: Tuple, per_tensor: bool, amaxes: List, starts: List,
                         noise_key: Optional[torch.Tensor], chunk: int
                         ) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Pass 2 of `_step_stored` by chunks of `chunk` elements: the new moments, each chunk's quantized values
        written in place. `fixed` is `_step_stored`'s (beta1, beta2, eps, m format, v format, stochastic)."""
        n, (_, _, _, m_fmt, v_fmt, _) = p.numel(), fixed
        fmts = (m_fmt, v_fmt)
        new = [self._new_moment(p, f, zero=False) for f in fmts]  # every element is written
        for a in range(0, n, chunk):
            length = min(chunk, n - a)
            ins = [x for (d, si), f in zip(old, fmts) for x in self._moment_slice(d, si, f, a, length)]
            out = self._call(None if per_tensor else flat_p[a:a + length], flat_g[a:a + length], *ins,
                             *scalars, *fixed, True, *amaxes, starts[a // chunk], noise_key)
            for (d, si), f, q, qs in zip(new, fmts, out[0::2], out[1::2]):
                d_slice, s_slice = self._moment_slice(d, si, f, a, length)
                d_slice.copy_(q)
                if s_slice is not None:
                    s_slice.copy_(qs)
        return new

    @classmethod
    def _as_moment(cls, p: torch.Tensor, fmt: MomentFormat, data: torch.Tensor, scale_inv: Optional[torch.Tensor]
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A whole tensor's update output kept as its new moment (no copy) where it has the stored layout
        (`_new_moment`'s), else copied into one that has."""
        n_blocks, _ = block_layout(p.numel(), fmt.block_size)
        numel = storage_numel(p.numel(), fmt) if fmt.is_fp8 else p.numel()
        if (data.numel() == numel and data.dtype == fmt.torch_dtype and data.is_contiguous()
                and (scale_inv is None) == (not fmt.is_fp8)
                and (scale_inv is None or (scale_inv.numel() == n_blocks and scale_inv.dtype == torch.float32))):
            shaped = data.view(-1) if fmt.is_fp8 else data.view(p.shape)
            return shaped, None if scale_inv is None else scale_inv.reshape(n_blocks)
        want, want_scale = cls._new_moment(p, fmt, zero=False)
        want.view(-1).copy_(data.reshape(-1))
        if want_scale is not None:
            want_scale.copy_(scale_inv.reshape(-1))
        return want, want_scale

    @staticmethod
    def _moment_slice(data: torch.Tensor, scale_inv: Optional[torch.Tensor], fmt: MomentFormat, start: int,
                      length: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The stored elements (and scales) of parameter elements [start, start + length), as views."""
        flat = data.view(-1)
        if not fmt.is_fp8:
            return flat[start:start + length], None
        if fmt.block_size == 0:  # one scale for the whole tensor
            return flat[start:start + length], scale_inv
        first, count = start // fmt.block_size, -(-length // fmt.block_size)
        return flat[start:start + count * fmt.block_size], scale_inv[first:first + count]

    def _call(self, *args: Any):
        return _chunk_step(*args) if self._kernel is None else self._kernel(*args)

    def _call_tensor(self, *args: Any):
        if self._tensor_kernel is None:
            return _tensor_step(*args)
        if self.direct_calls and not (self._tensor_kernel.failed or torch.compiler.is_compiling()):
            (param, grad, m_data, m_scale_inv, v_data, v_scale_inv, decay, step_size, bc2_sqrt, beta1, beta2, eps,
             m_fmt, v_fmt, stochastic, start, noise_key) = args
            result = _DIRECT.call_or_build(_tensor_step_direct, (
                param, grad, m_data, m_scale_inv, v_data, v_scale_inv, decay, step_size, bc2_sqrt, start, noise_key,
                beta1, beta2, eps, m_fmt, v_fmt, stochastic))
            if result is not None:
                return result
        return self._tensor_kernel(*args)

    @property
    def compiled(self) -> bool:
        """Whether the update was asked to compile (`compile=True`); `runs_eager` says whether it does."""
        return self._kernel is not None

    @property
    def runs_eager(self) -> bool:
        """True when the update runs eagerly: compile off, or its compilation failed (warned once)."""
        return self._kernel is None or self._kernel.failed or self._tensor_kernel.failed

    @staticmethod
    def _step_fp32_foreach(b: Dict[str, List], lr: float, beta1: float, beta2: float, eps: float,
                           wd: float) -> None:
        """torch.optim.AdamW's arithmetic, batched with foreach ops over the FP32-state parameters."""
        params, grads, ms, vs = b["params"], b["grads"], b["m"], b["v"]
        torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, 1.0 - beta2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, [math.sqrt(1.0 - beta2**s) for s in b["step"]])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, ms, denom, [-lr / (1.0 - beta1**s) for s in b["step"]])

    # ----------------------------------------------------------------------------- state dict
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        # Plain data only (weights_only-loadable): what wrote it, and the stochastic-rounding streams.
        # Format 2: the noise is counter-based (a function of seed, parameter ordinal, step and element),
        # so there is no generator state to save; format 1's "rng_states" are accepted and have no use.
        sd["fp8_adam"] = {"format_version": 2, "m_dtype": self.m_format.dtype.value,
                          "v_dtype": self.v_format.dtype.value, "block_size": self.block_size,
                          "stochastic_rounding": self.stochastic_rounding, "noise": "counter-hash"}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load ours or torch.optim.AdamW's state; moments are converted to this optimizer's formats."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        id_map: Dict[int, Tuple[torch.Tensor, Dict[str, Any]]] = {}
        for group, saved in zip(self.param_groups, saved_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("optimizer state has a param group of a different size than this optimizer's")
            if saved.get("amsgrad") or saved.get("maximize"):
                raise ValueError("cannot load an AdamW state with amsgrad=True or maximize=True into Fp8AdamW")
            self._take_settings(group, saved)
            id_map.update({pid: (p, group) for pid, p in zip(saved["params"], group["params"])})
        new_state: Dict[torch.Tensor, Dict[str, Any]] = defaultdict(dict)
        for pid, saved_state in state_dict["state"].items():
            if pid not in id_map:
                raise ValueError(f"optimizer state holds parameter id {pid!r}, absent from its param groups")
            p, group = id_map[pid]
            new_state[p] = self._convert_state(p, group, saved_state)
        self.state = new_state
        if state_dict.get("fp8_adam", {}).get("rng_states"):
            logger.info("Fp8AdamW: the checkpoint's stochastic-rounding generator states (format 1) are not "
                        "used: the noise is now a function of (parameter, step, element)")

    @staticmethod
    def _take_settings(group: Dict[str, Any], saved: Dict[str, Any]) -> None:
        """The saved hyper-parameters win (as in torch); the FP8 rule stays this optimizer's."""
        group.update({k: v for k, v in saved.items() if k != "params" and k not in _FOREIGN_GROUP_KEYS})
        group["betas"] = tuple(group["betas"])

    def load_param_groups(self, groups: List[Dict[str, Any]]) -> None:
        """The saved groups' hyper-parameters alone (a sharded load reads the states in place)."""
        for group, saved in zip(self.param_groups, groups):
            self._take_settings(group, saved)

    def _convert_state(self, p: torch.Tensor, group: Dict[str, Any], saved: Dict[str, Any]) -> Dict[str, Any]:
        formats = self._formats(p, group)
        p = shards.local(p)  # FSDP2: `saved` holds this rank's rows (fp8_adam_shards.local_state_dict)
        if "max_exp_avg_sq" in saved:
            raise ValueError("cannot load an AMSGrad state (max_exp_avg_sq) into Fp8AdamW")
        step = saved.get("step", 0)
        out: Dict[str, Any] = {"step": torch.as_tensor(float(step), dtype=torch.float32).clone()}
        for name, fmt in zip(_MOMENTS, formats):
            data, scale_inv = saved[name], saved.get(name + "_scale_inv")
            if self._layout_matches(p, fmt, data, scale_inv):  # same format: copy bits (exact resume)
                new_data = data.to(p.device, copy=True)
                new_scale = None if scale_inv is None else scale_inv.to(p.device, torch.float32, copy=True)
            else:
                values = self._saved_values(p, name, data, scale_inv)
                new_data, new_scale = quantize(values.view(p.shape), fmt)
            out[name] = new_data
            if new_scale is not None:
                out[name + "_scale_inv"] = new_scale
        return out

    @staticmethod
    def _layout_matches(p: torch.Tensor, fmt: MomentFormat, data: torch.Tensor,
                        scale_inv: Optional[torch.Tensor]) -> bool:
        if data.dtype != fmt.torch_dtype:
            return False
        if not fmt.is_fp8:
            return scale_inv is None and data.shape == p.shape
        n_blocks, block_len = block_layout(p.numel(), fmt.block_size)
        return scale_inv is not None and scale_inv.numel() == n_blocks and data.numel() == n_blocks * block_len

    @staticmethod
    def _saved_values(p: torch.Tensor, name: str, data: torch.Tensor,
                      scale_inv: Optional[torch.Tensor]) -> torch.Tensor:
        """FP32 values of a saved moment in any supported layout, checked against the parameter."""
        numel = p.numel()
        if scale_inv is None:
            ok = data.numel() == numel
        else:
            n_blocks = scale_inv.numel()
            block_len = data.numel() // max(n_blocks, 1)
            ok = n_blocks > 0 and data.numel() == n_blocks * block_len and n_blocks * block_len >= numel \
                and (n_blocks - 1) * block_len < max(numel, 1)
        if not ok:
            raise ValueError(f"saved optimizer state {name!r} ({tuple(data.shape)}, "
                             f"{0 if scale_inv is None else scale_inv.numel()} scales) does not fit a "
                             f"parameter of shape {tuple(p.shape)}")
        return dequantize(data.to(p.device), None if scale_inv is None else scale_inv.to(p.device).float(), numel)
