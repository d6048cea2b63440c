"""Storage formats for optimizer moments: FP8 with per-tensor or per-block scales, BF16 or FP32.

`Fp8AdamW` keeps Adam's two moments in one of these formats between steps. This module owns the
(de)quantization of one moment tensor and nothing else; the Adam arithmetic lives in `fp8_adam.py`.

Layout of an FP8 moment of a parameter with `n` elements:
- `data`: a 1-D FP8 tensor of `n_blocks * block_len` bytes (the flattened moment, zero-padded to whole
  blocks). Per-tensor scaling is the special case of one block of length `n` (no padding).
- `scale_inv`: a 1-D FP32 tensor of `n_blocks` dequantization factors, `x ~ data * scale_inv`.
  We store the *inverse* scale (Transformer Engine's `scale_inv`) rather than `scale = fp8_max / amax`
  because an all-zero block then has the honest factor 0 instead of an arbitrary or infinite scale,
  and the flush-to-zero threshold of a block is simply `min_subnormal * scale_inv` (used by the v floor).
The layout is self-describing (block length = `data.numel() // scale_inv.numel()`), so a checkpoint
written with another block size can be dequantized without extra metadata.
BF16/FP32 moments keep the parameter's shape and have no scale.

Scales come from the *current* amax of each block (just-in-time scaling): the optimizer requantizes
every moment once per step from FP32 values it already holds, so there is no reason to use a delayed
amax history, and a fresh amax can never clip.

There is one FP8 numerics core: the scale (`compute_scale`), the saturating cast and the stochastic
rounding are `megatron.fp8.quantize`'s, the same functions the FP8 layers use; this module only adds
the block layout and stores `scale_inv = 1 / scale`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.fp8.formats import Fp8Dtype, format_spec
from megatron.fp8.quantize import compute_scale, div_like_eager, quantize as fp8_quantize, stochastic_round


class MomentDtype(str, enum.Enum):
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(frozen=True)
class MomentFormat:
    """How one moment is stored: element dtype, its range, and the block length (0 = per tensor)."""

    dtype: MomentDtype
    torch_dtype: torch.dtype
    max: float  # largest finite magnitude (after scaling)
    min_subnormal: float  # smallest positive magnitude (after scaling)
    mantissa_bits: int
    block_size: int = 0

    @property
    def is_fp8(self) -> bool:
        return self.dtype in (MomentDtype.E4M3, MomentDtype.E5M2)

    @property
    def bits_label(self) -> str:
        return self.dtype.value if not self.is_fp8 or not self.block_size else \
            f"{self.dtype.value}/block{self.block_size}"


def moment_format(dtype: MomentDtype | str, block_size: int = 0, backend: str = "cpu") -> MomentFormat:
    """The `MomentFormat` for `dtype`; FP8 ranges come from `megatron.fp8.formats` for `backend`."""
    dtype = MomentDtype(dtype)
    if dtype in (MomentDtype.E4M3, MomentDtype.E5M2):
        spec = format_spec(Fp8Dtype(dtype.value), backend)
        return MomentFormat(dtype, spec.torch_dtype, spec.max, spec.min_subnormal, spec.mantissa_bits,
                            block_size)
    if dtype is MomentDtype.BF16:
        fi = torch.finfo(torch.bfloat16)
        return MomentFormat(dtype, torch.bfloat16, fi.max, 2.0**-133, 7, 0)
    return MomentFormat(dtype, torch.float32, torch.finfo(torch.float32).max, 2.0**-149, 23, 0)


def block_layout(numel: int, block_size: int) -> Tuple[int, int]:
    """(n_blocks, block_len) of a flattened tensor of `numel` elements; block_size 0 = one block."""
    if block_size <= 0 or numel == 0:
        return 1, max(numel, 1)
    return -(-numel // block_size), block_size


def storage_numel(numel: int, fmt: MomentFormat) -> int:
    """Elements stored for a moment of `numel` elements (FP8 moments are padded to whole blocks)."""
    if not fmt.is_fp8:
        return numel
    n_blocks, block_len = block_layout(numel, fmt.block_size)
    return n_blocks * block_len


def quantize(x: torch.Tensor, fmt: MomentFormat, noise: Optional[torch.Tensor] = None,
             amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Store fp32 `x` (any shape) in `fmt`: returns (data, scale_inv); scale_inv is None unless FP8.

    `noise` (uniform [0, 1), `storage_numel` elements) selects stochastic rounding; None = nearest.
    `amax` (0-d) overrides the per-block amax: a per-tensor scale for a tensor quantized in chunks.
    The scale and the rounding are the layers' (`megatron.fp8.quantize`), applied per block.
    """
    if fmt.dtype is MomentDtype.FP32:
        return x.float().clone(), None
    if fmt.dtype is MomentDtype.BF16:
        y = x.float()
        if noise is not None:
            y = stochastic_round(y, fmt, noise.view(y.shape))
        return y.to(torch.bfloat16), None
    numel = x.numel()
    n_blocks, block_len = block_layout(numel, fmt.block_size)
    flat = x.reshape(-1).float()
    pad = n_blocks * block_len - numel
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(n_blocks, block_len)
    amax = blocks.abs().amax(dim=1, keepdim=True) if amax is None else amax.view(1, 1).float()
    scale = compute_scale(amax, fmt.max)  # 1.0 for an all-zero block; finite for a tiny amax
    data = fp8_quantize(blocks, scale, fmt, noise=None if noise is None else noise.view(n_blocks, block_len))
    scale_inv = torch.where(amax > 0, div_like_eager(1.0, scale), torch.zeros_like(scale))
    return data.view(-1), scale_inv.view(-1)


def dequantize(data: torch.Tensor, scale_inv: Optional[torch.Tensor], numel: int) -> torch.Tensor:
    """FP32 values of a stored moment, flattened to `numel` elements (padding dropped)."""
    if scale_inv is None:
        return data.float().reshape(-1)
    n_blocks = scale_inv.numel()
    x = data.float().view(n_blocks, -1) * scale_inv.view(n_blocks, 1)
    return x.view(-1)[:numel]


def dequantize_with_floor(data: torch.Tensor, scale_inv: Optional[torch.Tensor], numel: int,
                          fmt: MomentFormat, stochastic: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """`dequantize`, plus per element the largest true value that may have been stored as 0.

    The floor is 0 wherever the stored value is nonzero (or the block is all zeros: scale_inv 0).
    Round-to-nearest flushes values below min_subnormal / 2; stochastic rounding can send anything below
    min_subnormal to 0. `Fp8AdamW` uses it to floor v where v underflowed (see its docstring).
    """
    if scale_inv is None:
        x = data.float().reshape(-1)
        return x, torch.zeros_like(x)
    n_blocks = scale_inv.numel()
    s = scale_inv.view(n_blocks, 1)
    x = data.float().view(n_blocks, -1) * s
    per_block = s * (fmt.min_subnormal if stochastic else fmt.min_subnormal / 2)
    floor = torch.where(x == 0, per_block, torch.zeros_like(x))
    return x.view(-1)[:numel], floor.view(-1)[:numel]


# The stochastic-rounding noise: a 32-bit integer hash (Chris Wellons' "lowbias32" shape: xorshift 16, multiply,
# xorshift 15, multiply, xorshift 15, with his multipliers 0x21f0aaad and 0x735a2d97) of the element's counter xor a
# key. On Gaudi (whose bridge computes int64 tensors in int32 unless told otherwise) it is computed on the two 16-bit
# halves of each 32-bit value, held in int32, so that every intermediate is a non-negative integer below 2**31; on
# the CPU and CUDA in int64, without wrap-around either: the same integers in eager, in torch.compile's C++ and
# Triton, and on Gaudi.
_HASH_MUL = (0x21F0AAAD, 0x735A2D97)
_LOW16 = 0xFFFF
# Resolution: the noise is a multiple of 2**-24 (the hash's top 24 bits; any such value is exact in fp32). Rounding
# fp32 y onto a grid of m mantissa bits compares the fraction of y / ulp with the noise; in the normal range that
# fraction has 23 - m bits (21 for E5M2, 20 for E4M3, 16 for BF16), so 24-bit noise resolves the round-up
# probability exactly there. Anywhere else the probability is floor(f * 2**24) / 2**24 instead of f, a bias below
# 2**-24 ulp, under the fp32 rounding of y itself.
_NOISE_BITS = 24


def u32_halves(value: int, device: torch.device | str) -> torch.Tensor:
    """`value` mod 2**32 as the int32 tensor [high 16 bits, low 16 bits]: how `counter_uniform` takes a 32-bit
    start or key. Made by fills (no host-to-device copy: tests/unit/test_host_sync.py)."""
    value &= 0xFFFFFFFF
    halves = torch.full((2,), value & _LOW16, dtype=torch.int32, device=device)
    halves[0].fill_(value >> 16)
    return halves


def _mul_u32(hi: torch.Tensor, lo: torch.Tensor, c: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(hi * 2**16 + lo) * c mod 2**32, as halves; hi, lo in [0, 2**16), c a 32-bit constant.

    With c in bytes c0 + c1 2**8 + c2 2**16 + c3 2**24, every product is a half times a byte (< 2**24); of the
    terms at 2**32 and above nothing is kept, of those at 2**16 and 2**24 only what lands below 2**32. Largest
    intermediate: the high half's sum, < 2**25 + 2**18."""
    c0, c1, c2, c3 = ((c >> shift) & 0xFF for shift in (0, 8, 16, 24))
    lo_c1 = lo * c1
    low = lo * c0 + ((lo_c1 & 0xFF) << 8)  # the product's bits 0..24: < 2**24 + 2**16
    high = ((low >> 16) + (lo_c1 >> 8) + lo * c2 + (((lo * c3) & 0xFF) << 8)
            + hi * c0 + (((hi * c1) & 0xFF) << 8))
    return high & _LOW16, low & _LOW16


def _xorshift(hi: torch.Tensor, lo: torch.Tensor, shift: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x ^ (x >> shift) on halves, 1 <= shift <= 16 (hi << (16 - shift) < 2**31)."""
    if shift == 16:
        return hi, lo ^ hi
    shifted_lo = ((hi << (16 - shift)) & _LOW16) | (lo >> shift)
    return hi ^ (hi >> shift), lo ^ shifted_lo


def counter_uniform(numel: int, start: torch.Tensor, key: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`numel` uniform [0, 1) fp32 values for elements start .. start + numel - 1 of a stream named `key`.

    A counter-based generator: value i is a hash of ((start + i) mod 2**32) xor key, so it depends on the element
    and the key alone, not on how many values were drawn before or in what order. That is what makes a compiled
    update equal the eager one (the same integers in both), lets a chunked update draw its chunks independently,
    and makes resume exact without saving generator state. The hash's top 24 bits become the fraction (multiples
    of 2**-24, exact in fp32). `start` and `key` are 32-bit values as `u32_halves` makes them (int32 tensors: a
    compiled caller then does not specialize on them); `numel` < 2**31. The same integers on every device: in int64
    where int64 tensors are computed in 64 bits (`_INT64_DEVICES`), else in int32 halves (`_hash_in_halves`).
    """
    if numel >= 2**31:
        raise ValueError(f"counter_uniform draws fewer than 2**31 values per call; asked for {numel}")
    top = (_hash_in_int64 if device.type in _INT64_DEVICES else _hash_in_halves)(numel, start, key, device)
    return top.to(torch.float32) * 2.0**-_NOISE_BITS


# Where int64 tensors hold 64-bit integers, the hash takes one int64 value per element: every product of a 32-bit
# value and a multiplier (< 2**31) is below 2**63, so nothing wraps. On the CPU that is ~4x faster than the halves
# (1M values: 169 vs 746 us compiled, AMD EPYC, torch 2.13.0+cpu, 2026-12-07). Gaudi computes int64 tensors in int32
# unless PT_ENABLE_INT64_SUPPORT=1, and other backends may too: they take the halves.
_INT64_DEVICES = frozenset({"cpu", "cuda"})
_MASK32 = 0xFFFFFFFF


def _hash_in_int64(numel: int, start: torch.Tensor, key: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The hash's top `_NOISE_BITS` bits (int64) for counters start .. start + numel - 1, in int64 arithmetic."""
    start64 = start[0].to(torch.int64) * 65536 + start[1].to(torch.int64)
    key64 = key[0].to(torch.int64) * 65536 + key[1].to(torch.int64)
    x = ((torch.arange(numel, dtype=torch.int64, device=device) + start64) & _MASK32) ^ key64
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _HASH_MUL[1]) & _MASK32
    x = x ^ (x >> 15)
    return x >> (32 - _NOISE_BITS)


def _hash_in_halves(numel: int, start: torch.Tensor, key: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The same bits as `_hash_in_int64` (int32), each 32-bit value held as two 16-bit halves in int32 tensors:
    every intermediate is a non-negative integer below 2**31, which int32 arithmetic anywhere computes exactly."""
    i = torch.arange(numel, dtype=torch.int32, device=device)
    low_sum = (i & _LOW16) + start[1]  # < 2**17
    hi = ((i >> 16) + start[0] + (low_sum >> 16)) & _LOW16
    lo = low_sum & _LOW16
    hi, lo = hi ^ key[0], lo ^ key[1]
    hi, lo = _xorshift(hi, lo, 16)
    hi, lo = _mul_u32(hi, lo, _HASH_MUL[0])
    hi, lo = _xorshift(hi, lo, 15)
    hi, lo = _mul_u32(hi, lo, _HASH_MUL[1])
    hi, lo = _xorshift(hi, lo, 15)
    return (hi << (_NOISE_BITS - 16)) | (lo >> (32 - _NOISE_BITS))


def state_nbytes(*tensors: Optional[torch.Tensor]) -> int:
    """Bytes held by the given state tensors (None ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
