"""FP8 GEMM backends: CUDA `torch._scaled_mm`, Gaudi `habana_frameworks` FP8 ops, and an emulation.

All backends implement one operation in "NT" form, the natural one for a linear layer whose weight is
stored [out_features, in_features]:

    gemm_nt(a, a_scale, b, b_scale, out_dtype) = (a / a_scale) @ (b / b_scale)^T,   a: [M, K], b: [N, K]

with FP8 operands, quantization scales (the ones that multiplied the data, see `quantize.py`), FP32
accumulation and an output in `out_dtype`. `fast_accum` (the recipe's per-GEMM choice, `Fp8Recipe.fast_accum`)
is `torch._scaled_mm`'s `use_fast_accum`; the emulation and Gaudi's `fp8_gemm_v2` (no such switch) accumulate in
FP32 regardless. Callers may pass transposed *views* (for dgrad and wgrad); each
backend decides whether it needs a copy:

- `CudaScaledMmBackend`: `torch._scaled_mm(A, B)` wants A row-major [M, K] and B column-major [K, N]. With
  b row-major [N, K], `b.t()` is exactly that, for free. It takes *dequantization* factors (1/scale), needs
  at least one E4M3 operand (E5M2 x E5M2 is not supported), and every dimension a multiple of 16: we pad with
  zeros (zeros along K add nothing to the dot products; padded rows/columns of the output are sliced off).
  Runs on sm89+ (L40, H100, H200). `torch._scaled_mm` also runs on CPU (2-D), which is how the tests check
  this layout logic numerically without a GPU.
- `HpuBackend`: `torch.ops.hpu.cast_to_fp8_v2` (multiplies by the scale, native stochastic rounding) and
  `torch.ops.hpu.fp8_gemm_v2(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv, B_scale_inv, bias,
  accumulate)`, whose transpose flags make every layout free. Gaudi2's E4M3 maximum is 240. This backend
  cannot be exercised on this project's CI (no Gaudi); it is written against the documented op signatures.
- `EmulatedBackend`: real FP8 values (the same casts), GEMM on the FP8 values (exact inputs, fp32
  accumulation); the scales are applied to the result, which is rounded to the output dtype once (a bf16
  GEMM only where that is exact: power-of-two scales, see `gemm_nt`). Used on CPU
  and on GPUs without FP8 tensor cores (sm < 89). Numerically it matches the hardware up to accumulation
  order; it is slower than a plain BF16 matmul by design (it does strictly more work).

`select_backend(choice, device)` picks one from the device, or validates a forced `--fp8-backend`
(`auto`, `scaled_mm` = its alias `cuda`, `hpu`, `emulated`).
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

from megatron.fp8 import cpu_gemm, fused
from megatron.fp8.formats import Fp8FormatSpec, format_backend_of, format_spec
from megatron.fp8.quantize import TiledFp8, dequantize_tiles, div_like_eager, quantize
from megatron.fp8.recipe import Fp8Backend, Fp8Scaling

logger = logging.getLogger(__name__)


class EmulatedBackend:
    """Real FP8 casts; the GEMM runs in FP32 on the dequantized values. Its FP8 maxima are those of the device its
    tensors live on (`formats.format_backend_of`): OCP's elsewhere, Gaudi2's on an HPU (`--fp8-backend emulated`
    there), so no FP8 tensor on a Gaudi holds a value beyond 240."""

    name = "emulated"
    format_backend = "cpu"  # which FP8 maxima apply (OCP), unless made for another device
    # Transposed views are fine for a plain matmul, so the linear need not cache transposed copies.
    wants_contiguous_operands = False

    def __init__(self, format_backend: str = "cpu") -> None:
        self.format_backend = format_backend

    def quantize(self, x: torch.Tensor, scale: torch.Tensor, spec: Fp8FormatSpec,
                 stochastic_rounding: bool = False) -> torch.Tensor:
        return quantize(x, scale, spec, stochastic_rounding)

    def gemm_nt(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                out_dtype: torch.dtype, pow2_scales: bool = False, fused_epilogue: bool = False,
                fast_accum: bool = False, run_dtype: torch.dtype | None = None) -> torch.Tensor:
        # a and b hold FP8 values (as FP8 tensors, or exactly in bf16/fp32 for the cached weight); bf16 holds
        # every FP8 value exactly and CPU bf16 GEMMs accumulate in fp32 like the tensor cores, but they *round
        # their output to bf16*. The hardware rounds once: fp32 accumulator * dequantization factors -> bf16.
        # A bf16 GEMM followed by the division and a second cast rounds twice (~25% of outputs off by one bf16
        # ulp at arbitrary scales). Dividing by a power of two is exact, so with power-of-two scales the bf16
        # GEMM's single rounding is the hardware's; otherwise the GEMM runs in fp32 (exact operands, one fp32
        # rounding per accumulation step as on the tensor cores) and the result is rounded once at the end.
        # CPUs without a fast BF16 GEMM (megatron.cpu_bf16) take the fp32 GEMM always: the same single rounding.
        # On CPUs with AMX-BF16 (or AMD's AVX512-BF16) the BF16 GEMM is the fast one, and runs every GEMM of a
        # --bf16 run, with the scales applied to its accumulator (one rounding): megatron/fp8/cpu_gemm.py.
        if cpu_gemm.bf16_gemm(a, out_dtype, run_dtype, pow2_scales):
            if a.device.type == "cpu":  # the scales applied to the accumulator inside the GEMM
                return cpu_gemm.scaled_bf16_gemm(fused.as_bf16(a), fused.as_bf16(b), a_scale, b_scale, out_dtype)
            out = fused.as_bf16(a) @ fused.as_bf16(b).t()  # bf16: the epilogue takes it to fp32 in its pass
        else:
            out = a.float() @ b.float().t()
        # The epilogue compiled when the layer fuses its quantization; the real-FP8 backends have none (their
        # kernels scale the accumulator), so `fused_epilogue` changes nothing there.
        return fused.scale_output(out, a_scale, b_scale, out_dtype, compiled=fused_epilogue)

    def gemm_tiles(self, a: TiledFp8, b: TiledFp8, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
        """`a @ b^T` of two tile-scaled operands: exact dequantization tile by tile (a division by a power of
        two under MXFP8 or power-of-two scales, else one fp32 rounding), fp32 GEMM, one rounding to out_dtype.
        The reference for the hardware's block-scaled GEMMs, which promote partial sums to fp32 per tile."""
        return (dequantize_tiles(a) @ dequantize_tiles(b).t()).to(out_dtype)


def _round_up(n: int, multiple: int = 16) -> int:
    return (n + multiple - 1) // multiple * multiple


def _padded(t: torch.Tensor, pad: tuple[int, ...], value: float = 0.0) -> torch.Tensor:
    """`F.pad(t, pad, value=value)`, or `t` itself when nothing is padded (a pad by nothing still copies)."""
    return F.pad(t, pad, value=value) if any(pad) else t


def _dequantization_factor(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale as the 0-d fp32 tensor `_scaled_mm` takes: one kernel, with eager's bits (`div_like_eager`) also
    where the layer is traced into a compiled graph."""
    factor = div_like_eager(1.0, scale.float())
    return factor if factor.dim() == 0 else factor.reshape(())


class CudaScaledMmBackend:
    """`torch._scaled_mm`: FP8 x FP8 on sm89+ tensor cores, FP32 accumulation; also runs on CPU (2-D)."""

    name = "scaled_mm"
    format_backend = "cuda"
    wants_contiguous_operands = True  # b must be row-major [N, K]; the linear caches W^T once per step

    def quantize(self, x: torch.Tensor, scale: torch.Tensor, spec: Fp8FormatSpec,
                 stochastic_rounding: bool = False) -> torch.Tensor:
        return quantize(x, scale, spec, stochastic_rounding)

    def gemm_nt(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                out_dtype: torch.dtype, pow2_scales: bool = False, fused_epilogue: bool = False,
                fast_accum: bool = False, run_dtype: torch.dtype | None = None) -> torch.Tensor:
        # The kernel applies both scales to the fp32 accumulator and rounds once: `pow2_scales` is not needed.
        m, k = a.shape
        n = b.shape[0]
        # Row-major A and row-major b (so that b.t() is the column-major B the kernel wants).
        a = a.contiguous()
        b = b.contiguous()
        mp, kp, np_ = _round_up(m), _round_up(k), _round_up(n)
        if (mp, kp) != (m, k):
            a = F.pad(a, (0, kp - k, 0, mp - m))
        if (np_, kp) != (n, k):
            b = F.pad(b, (0, kp - k, 0, np_ - n))
        out = torch._scaled_mm(
            a, b.t(),
            scale_a=_dequantization_factor(a_scale),
            scale_b=_dequantization_factor(b_scale),
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
        if (mp, np_) != (m, n):
            out = out[:m, :n]
        return out

    def gemm_tiles(self, a: TiledFp8, b: TiledFp8, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
        """Rowwise: `torch._scaled_mm` with one fp32 dequantization factor per row of A ([M, 1]) and per column
        of B ([1, N]). Blockwise: `torch.nn.functional.scaled_mm` (see `_blockwise_gemm`). `select_backend`
        sends what the installed torch cannot take to the emulation."""
        if a.tile.cols:
            if a.data.dtype == b.data.dtype == torch.float8_e4m3fn:
                try:
                    return _blockwise_gemm(a, b, out_dtype, fast_accum)
                except (RuntimeError, ValueError) as error:  # a torch whose kernel refuses this case
                    _log_kernel_refusal(str(error).splitlines()[0])
            # E5M2 gradients (hybrid): the sm90 blockwise kernel takes E4M3 x E4M3 only.
            return _make("emulated").gemm_tiles(a, b, out_dtype)
        m, k = a.data.shape
        n = b.data.shape[0]
        mp, kp, np_ = _round_up(m), _round_up(k), _round_up(n)
        # Zero columns along K add nothing; padded rows get factor 1 and are sliced off.
        qa = _padded(a.data.contiguous(), (0, kp - k, 0, mp - m))
        qb = _padded(b.data.contiguous(), (0, kp - k, 0, np_ - n))
        sa = _padded(div_like_eager(1.0, a.scale.float()).reshape(m, 1), (0, 0, 0, mp - m), value=1.0)
        sb = _padded(div_like_eager(1.0, b.scale.float()).reshape(1, n), (0, np_ - n), value=1.0)
        out = torch._scaled_mm(qa, qb.t(), scale_a=sa.contiguous(), scale_b=sb.contiguous(), out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
        return out[:m, :n] if (mp, np_) != (m, n) else out


def _blockwise_gemm(a: TiledFp8, b: TiledFp8, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """1x128 x (1x128 or 128x128), E4M3 x E4M3, through `F.scaled_mm` (sm90; checked on an H200 with torch
    2.11 by scripts/gpu_check.py, untestable on the CPU, whose kernel takes tensorwise and rowwise scales only).

    The kernel's layout, as its checks state them: dequantization factors fp32; A's 1x128 factors [M, K/128]
    column-major; B's 1x128 factors [N, K/128] column-major; B's 128x128 factors as [K/128, N/128] with strides
    (1, K/128) (the transpose of the row-major [N/128, K/128] grid). M is padded to 16, N to 128, K to 512 (the
    kernel wants the K-blocks of a 128x128 grid in fours); zero data adds nothing, padded factors are 1.
    """
    m, k = a.data.shape
    n = b.data.shape[0]
    mp, np_, kp = _round_up(m, 16), _round_up(n, 128), _round_up(k, 512)
    qa = _padded(a.data.contiguous(), (0, kp - k, 0, mp - m))
    qb = _padded(b.data.contiguous(), (0, kp - k, 0, np_ - n))

    def factors(t: TiledFp8, rows: int) -> torch.Tensor:
        f = div_like_eager(1.0, t.scale.float())
        return _padded(f, (0, kp // 128 - f.shape[1], 0, rows - f.shape[0]), value=1.0)

    fa = factors(a, mp).t().contiguous().t()
    if b.tile.rows == 1:
        fb, kind_b = factors(b, np_).t().contiguous().t(), F.ScalingType.BlockWise1x128
    else:
        fb, kind_b = factors(b, np_ // 128).contiguous().t(), F.ScalingType.BlockWise128x128
    # The kernel refuses fast accumulation with 128x128 factors (torch 2.11 on an H200): those GEMMs promote.
    out = F.scaled_mm(qa, qb.t(), fa, F.ScalingType.BlockWise1x128, fb, kind_b, output_dtype=out_dtype,
                      use_fast_accum=fast_accum and kind_b is F.ScalingType.BlockWise1x128)
    return out[:m, :n]


class HpuBackend:
    """Gaudi FP8 ops from `habana_frameworks` (imported lazily; untested here: no Gaudi on CI)."""

    name = "hpu"
    format_backend = "hpu"  # E4M3 max 240 on Gaudi2
    wants_contiguous_operands = False  # fp8_gemm_v2 has transpose flags

    def __init__(self) -> None:
        import habana_frameworks.torch  # noqa: F401  registers torch.ops.hpu.*

    def quantize(self, x: torch.Tensor, scale: torch.Tensor, spec: Fp8FormatSpec,
                 stochastic_rounding: bool = False) -> torch.Tensor:
        # The kernel multiplies by `scale` and saturates to the format's max itself; we still clamp first so
        # an inf in the input becomes +-max exactly like on the other backends.
        y = torch.clamp(x.float() * scale.float(), -spec.max, spec.max)
        q, _ = torch.ops.hpu.cast_to_fp8_v2(y, None, stochastic_rounding, False, spec.torch_dtype)
        return q

    def gemm_nt(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                out_dtype: torch.dtype, pow2_scales: bool = False, fused_epilogue: bool = False,
                fast_accum: bool = False, run_dtype: torch.dtype | None = None) -> torch.Tensor:
        # The kernel applies both scales to the fp32 accumulator and rounds once: `pow2_scales` is not needed.
        # Express transposed views through the flags instead of copying.
        trans_a = not a.is_contiguous() and a.t().is_contiguous()
        a_arg = a.t() if trans_a else a.contiguous()
        # NT: b^T is wanted. A contiguous b [N, K] -> pass b with trans_B=True; a transposed view -> its base.
        b_is_view_t = not b.is_contiguous() and b.t().is_contiguous()
        b_arg, trans_b = (b.t(), False) if b_is_view_t else (b.contiguous(), True)
        return torch.ops.hpu.fp8_gemm_v2(
            a_arg, trans_a, b_arg, trans_b, None, out_dtype,
            _dequantization_factor(a_scale), _dequantization_factor(b_scale), None, False,  # 0-d, as Habana's code
        )


Backend = EmulatedBackend | CudaScaledMmBackend | HpuBackend


def _cuda_has_fp8(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# The stateless backends, made once: traced code (traced.py) looks them up here (dynamo does not trace into an
# lru_cache). The Gaudi backend imports habana_frameworks when made, so it is made on first use.
STATELESS_BACKENDS: dict[str, Backend] = {"emulated": EmulatedBackend(), "scaled_mm": CudaScaledMmBackend()}


@functools.lru_cache(maxsize=None)
def _make(name: str, device_type: str = "cpu") -> Backend:
    """The backend `name` for tensors on `device_type`; only the emulation differs by device (its FP8 maxima)."""
    if name == "hpu":
        return HpuBackend()
    if name == "emulated" and format_backend_of(device_type) != "cpu":
        return EmulatedBackend(format_backend_of(device_type))
    return STATELESS_BACKENDS[name]


KERNEL_REFUSALS: list[str] = []  # first lines of the errors of scaled GEMMs that fell back (tests read it)


def _log_kernel_refusal(message: str) -> None:
    if message not in KERNEL_REFUSALS:
        logger.warning("FP8 blockwise GEMM: torch.nn.functional.scaled_mm refused (%s); emulating it", message)
    KERNEL_REFUSALS.append(message)


@functools.lru_cache(maxsize=None)
def _log_emulated(scaling: str, device: str) -> None:
    logger.info("FP8 %s scaling: no scaled GEMM of the installed torch %s takes these tiles on %s; emulating "
                "them (exact tile dequantization, fp32 GEMM)", scaling, torch.__version__, device)


def scaled_mm_supports(scaling: Fp8Scaling, device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs `scaling`'s GEMMs here. Per-tensor scales: always; rowwise: fp32
    [M, 1] x [1, N] factors, accepted by torch >= 2.5 on sm90+ and on the CPU. Blockwise (1x128 / 128x128) and
    MXFP8 are not routed to a kernel yet (`torch.nn.functional.scaled_mm`'s BlockWise and MX scaling types,
    sm90 / sm100, are untested here): they run emulated, with a log line."""
    if not Fp8Scaling(scaling).fine_grained:
        return True
    if scaling is Fp8Scaling.ROWWISE:
        return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0))
    if scaling is Fp8Scaling.BLOCKWISE:
        kinds = getattr(getattr(F, "ScalingType", None), "__members__", {})
        return (device.type == "cuda" and hasattr(F, "scaled_mm") and "BlockWise128x128" in kinds
                and torch.cuda.get_device_capability(device)[0] == 9)
    return False


def select_backend(choice: Fp8Backend | str, device: torch.device | str,
                   scaling: Fp8Scaling | str = Fp8Scaling.DELAYED) -> Backend:
    """The backend for tensors on `device`; `choice` is the recipe's `--fp8-backend`.

    auto: scaled_mm on sm89+ GPUs, hpu on Gaudi, emulated otherwise (CPU, older GPUs). A forced `scaled_mm`
    (alias `cuda`) runs wherever `torch._scaled_mm` does: sm89+ GPUs and the CPU, which is how the CUDA
    backend's layouts, padding and operand order are trained end to end without a GPU. A forced choice the
    device cannot run raises ValueError naming the flag. A fine-grained `scaling` the scaled GEMM cannot take
    runs emulated (logged once); on Gaudi it raises ValueError.
    """
    choice = Fp8Backend(choice)
    device = torch.device(device)
    scaling = Fp8Scaling(scaling)
    if scaling.fine_grained and (choice is Fp8Backend.HPU or (choice is Fp8Backend.AUTO and device.type == "hpu")):
        raise ValueError(f"--fp8-recipe {scaling.value} is not supported on Gaudi (habana_frameworks' fp8_gemm_v2 "
                         f"takes per-tensor scales only): use --fp8-recipe delayed or tensorwise there")
    backend = _select(choice, device)
    if backend.name == "scaled_mm" and not scaled_mm_supports(scaling, device):
        _log_emulated(scaling.value, str(device))
        return _make("emulated")
    return backend


def _select(choice: Fp8Backend, device: torch.device) -> Backend:
    if choice is Fp8Backend.AUTO:
        if _cuda_has_fp8(device):
            return _make("scaled_mm")
        if device.type == "hpu":
            return _make("hpu")
        return _make("emulated", device.type)
    if choice is Fp8Backend.SCALED_MM and not (_cuda_has_fp8(device) or device.type == "cpu"):
        raise ValueError(
            f"--fp8-backend scaled_mm (alias cuda) needs a CUDA device with compute capability >= 8.9 (FP8 "
            f"tensor cores) or the CPU, but the model is on {device}; use --fp8-backend auto or emulated")
    if choice is Fp8Backend.HPU:
        if device.type != "hpu" or importlib.util.find_spec("habana_frameworks") is None:
            raise ValueError(
                f"--fp8-backend hpu needs a Gaudi device and habana_frameworks, but the model is on {device}; "
                f"use --fp8-backend auto or emulated")
    return _make(choice.value, device.type)


def backend_format_spec(backend: Backend, dtype: str) -> Fp8FormatSpec:
    """The FP8 format `dtype` as `backend` implements it (the E4M3 max is 240 on Gaudi2, 448 elsewhere)."""
    return format_spec(dtype, backend.format_backend)
