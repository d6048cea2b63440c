"""Every torch.distributed collective of megatron/ goes through this module.

Why one module: the backends disagree on what they accept. NCCL reduces CUDA tensors only, HCCL HPU tensors
only, gloo CPU tensors (see docs/distributed.md, "Collectives"). A call site that builds a CPU flag and
all-reduces it works on every CPU test and stops the first multi-GPU run. Here each collective

- puts its tensor on the group's *communication device* (`communication_device`: the current CUDA device for
  nccl, the HPU for hccl, the CPU for gloo; a combined "cpu:gloo,cuda:nccl" group takes the accelerator, the
  hot path) and copies the result back to the caller's device only when it had to move it;
- sends NaN as +inf in MAX reductions: a MAX over NaN is backend-defined, +inf is ordered, and every reader of
  a reduced max (FP8 amaxes, Smooth-SwiGLU scales) treats NaN and inf alike (non-finite);
- refuses FP8 tensors: no backend reduces them, and nothing we communicate needs to be FP8 (amaxes and
  scales are fp32, activations bf16/fp32);
- is a no-op for `group=None` (no group: one rank, or TP = 1) and for a one-rank group, unless
  MEGATRON_FORCE_COLLECTIVES=1, which sends even a one-rank group's tensors through the backend (a one-GPU
  run that exercises NCCL; the tests' one-process runs of the collective path).

MEGATRON_COLLECTIVE_GUARD=1 (the test suite sets it, spawned workers inherit it) makes torch.distributed's
collectives raise when called directly from megatron/ code other than this file; `tests/unit/test_comm.py` also
scans megatron/ for such calls. DeepSpeed's and torch's own collectives (DDP's reducer, ZeRO) are theirs.

Process-group setup (init_process_group, new_group, get_rank, get_world_size) is not a collective and stays
where the groups are built (`megatron/parallel_state.py`).
"""
from __future__ import annotations

import enum
import functools
import os
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

FORCE_ENV = "MEGATRON_FORCE_COLLECTIVES"
GUARD_ENV = "MEGATRON_COLLECTIVE_GUARD"

_FP8_DTYPES = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                          "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))


class ReduceOp(enum.Enum):
    SUM = "sum"
    MAX = "max"


def collectives_forced() -> bool:
    """MEGATRON_FORCE_COLLECTIVES=1: one-rank groups communicate too (read on every call: tests toggle it)."""
    return os.environ.get(FORCE_ENV) == "1"


def world_group() -> Optional[Any]:
    """The default group, or None when torch.distributed is not initialized."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def is_active(group: Optional[Any]) -> bool:
    """Whether a collective over `group` communicates (else every function here returns its input)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return False
    return dist.get_world_size(group) > 1 or collectives_forced()


def _accelerator_device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)  # "hpu": the device set by Accelerator.set_device


def device_for_backend(backend: str) -> torch.device:
    """The device whose tensors `backend` (as `dist.get_backend` spells it) communicates on the hot path."""
    backend = str(backend).lower()
    if "nccl" in backend:
        return _accelerator_device("cuda")
    if "hccl" in backend:
        return _accelerator_device("hpu")
    return torch.device("cpu")  # gloo (and mpi): host tensors


def communication_device(group: Any) -> torch.device:
    return device_for_backend(dist.get_backend(group))


def _to_wire(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dtype in _FP8_DTYPES:
        raise TypeError(f"refusing to communicate an FP8 tensor ({tensor.dtype}): no backend reduces FP8; "
                        "communicate its fp32/bf16 source or its fp32 amax/scale instead")
    if tensor.device != device:
        tensor = tensor.to(device, non_blocking=True)
    return tensor.contiguous()


def _from_wire(wire: torch.Tensor, device: torch.device, one_rank_result: torch.Tensor) -> torch.Tensor:
    if wire.device.type == "meta":
        # A stand-in communication device (tests/unit/test_comm.py records which device each tensor was put on):
        # it holds no data. Stand-ins are used with one-rank groups only, whose result is the input.
        return one_rank_result
    if wire.device == device:
        return wire
    # Into host memory, a non-blocking copy may still be in flight when the caller reads the tensor.
    return wire.to(device, non_blocking=device.type != "cpu")


# Backends whose devices have no float64 (Gaudi): a float64 SUM travels as a float32 (hi, lo) pair.
_NO_FLOAT64 = ("hccl",)


def _all_reduce_float64_as_pairs(tensor: torch.Tensor, group: Any, op: ReduceOp) -> torch.Tensor:
    """float64 SUM over a backend without float64: x = hi + lo with hi = fp32(x), lo = fp32(x - hi) (x - hi is
    exact in float64), both summed in fp32 and added back in float64 on the caller's side. The result carries
    fp32 rounding of the rank sums (~1e-7 relative), not float64's; used once per evaluation."""
    if op is not ReduceOp.SUM:
        raise TypeError(f"a float64 {op.value} reduction cannot go over {dist.get_backend(group)}: it has no "
                        "float64; reduce a float32 tensor instead")
    hi = tensor.float()
    lo = (tensor - hi.double()).float()
    pair = all_reduce(torch.stack([hi, lo]), group, op)
    tensor.copy_(pair[0].double() + pair[1].double())
    return tensor


def all_reduce(tensor: torch.Tensor, group: Optional[Any], op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` over `group` in place and return it (MAX: NaN is sent as +inf; float64 over HCCL goes
    as a float32 pair)."""
    if not is_active(group):
        return tensor
    if tensor.dtype == torch.float64 and any(b in str(dist.get_backend(group)).lower() for b in _NO_FLOAT64):
        return _all_reduce_float64_as_pairs(tensor, group, op)
    wire = _to_wire(tensor, communication_device(group))
    if op is ReduceOp.MAX:
        wire = torch.where(torch.isnan(wire), torch.full_like(wire, float("inf")), wire)
        torch_op = dist.ReduceOp.MAX
    else:
        torch_op = dist.ReduceOp.SUM
    dist.all_reduce(wire, op=torch_op, group=group)
    if wire is not tensor:
        result = _from_wire(wire, tensor.device, tensor)
        if result is not tensor:
            tensor.copy_(result)
    return tensor


def all_gather(tensor: torch.Tensor, group: Optional[Any]) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape everywhere), in rank order, on the caller's device."""
    if not is_active(group):
        return [tensor]
    wire = _to_wire(tensor, communication_device(group))
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, wire, group=group)
    return [_from_wire(p, tensor.device, tensor) for p in parts]


def all_gather_object(obj: Any, group: Optional[Any]) -> list[Any]:
    """Every rank's picklable `obj`, in rank order. For small host-side values over a CPU group (the host group)."""
    if not is_active(group):
        return [obj]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def reduce_scatter(parts: list[torch.Tensor], group: Optional[Any]) -> torch.Tensor:
    """Sum of every rank's `parts[r]`, on rank r (len(parts) = group size; equal shapes)."""
    if not is_active(group):
        return parts[0]
    device = communication_device(group)
    wire_parts = [_to_wire(p, device) for p in parts]
    out = torch.empty_like(wire_parts[0])
    dist.reduce_scatter(out, wire_parts, group=group)
    return _from_wire(out, parts[0].device, parts[0])


def barrier(group: Optional[Any]) -> None:
    """Wait for every rank of `group` (the default group: pass `world_group()`)."""
    if is_active(group):
        dist.barrier(group=group)


# ---------------------------------------------------------------------------------------- the run-time guard
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "barrier", "monitored_barrier", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "all_gather_single", "reduce_scatter_single", "send_object_list", "recv_object_list")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)


def _guarded(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)  # the direct caller: one attribute read per collective
        caller = frame.f_code.co_filename
        if caller.startswith(_PACKAGE_DIR) and os.path.abspath(caller) != _THIS_FILE:
            raise RuntimeError(f"torch.distributed.{name} called from {caller}:{frame.f_lineno}: collectives in "
                               "megatron/ must go through megatron.comm (it puts tensors on the backend's device)")
        return fn(*args, **kwargs)

    call.megatron_collective_guard = True
    return call


def install_collective_guard() -> None:
    """Make torch.distributed's collectives raise when megatron/ calls them other than through this module.

    Callers outside the megatron package (torch itself, DeepSpeed, tests, tools) are let through: the guard
    checks our code, not theirs. Idempotent.
    """
    if not dist.is_available():
        return
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "megatron_collective_guard", False):
            setattr(dist, name, _guarded(name, fn))


if os.environ.get(GUARD_ENV) == "1":
    install_collective_guard()
