"""The accelerator: one place that knows whether we run on CUDA, Gaudi (HPU) or CPU.

It owns device placement, the torch.distributed backend name, synchronisation, memory statistics and
the autocast dtype. Gaudi's `habana_frameworks` is imported only when present, never required.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import resource
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch

from megatron import cpu_bf16, host_malloc


# What the HPU path sets in the environment before Habana's bridge is imported (the bridge reads it then), and why.
# PT_ENABLE_INT64_SUPPORT: without it the bridge computes int64 tensors in int32. Fp8AdamW's stochastic-rounding
# noise does not depend on it (int32 arithmetic throughout, `optimizer.fp8_state_quant.counter_uniform`); the FP8
# statistics do: their int64 element counters (`fp8.stats.Fp8Stats`, for --log-fp8-stats and --fp8-autoheal) sum
# tensor sizes over a log interval, and one GEMM operand of a 7B model at 4096 tokens per micro-batch has ~10^8
# elements, so 2**31 is passed within a few dozen micro-batches.
HABANA_ENVIRONMENT = {"PT_ENABLE_INT64_SUPPORT": "1"}
_HABANA_NOTES: list[str] = []  # what prepare_habana_environment did, logged by `Accelerator.prepare_bf16`


def prepare_habana_environment(environ: Optional[dict] = None) -> list[str]:
    """Set `HABANA_ENVIRONMENT` in `environ` (default os.environ) where the user has not; returns one note per
    variable (the value and who set it), which the trainer logs once logging is set up. A user's
    PT_ENABLE_INT64_SUPPORT=0 is kept, with a warning naming what it affects."""
    environ = os.environ if environ is None else environ
    notes = []
    for name, value in HABANA_ENVIRONMENT.items():
        ours = name not in environ
        environ.setdefault(name, value)
        notes.append(f"Gaudi: {name}={environ[name]} ({'set by megatron' if ours else 'from the environment'})")
    if environ["PT_ENABLE_INT64_SUPPORT"] == "0":
        logging.getLogger("megatron").warning(
            "PT_ENABLE_INT64_SUPPORT=0: Gaudi computes int64 in int32, and the FP8 statistics' element counters "
            "(--log-fp8-stats, --fp8-autoheal) can overflow within a log interval; unset it to let megatron set 1")
    _HABANA_NOTES[:] = notes
    return notes


def hpu_is_lazy(environ: Optional[dict] = None) -> bool:
    """Whether Gaudi's bridge runs in lazy mode (`Accelerator.lazy_mode`)."""
    try:
        from habana_frameworks.torch.utils.internal import is_lazy

        return bool(is_lazy())
    except (ImportError, AttributeError):
        return (os.environ if environ is None else environ).get("PT_HPU_LAZY_MODE", "0") == "1"


def _hpu_available() -> bool:
    try:
        if importlib.util.find_spec("habana_frameworks") is None:
            return False
        prepare_habana_environment()  # before the bridge reads it, at its import
        import habana_frameworks.torch.core  # noqa: F401  (registers the hpu device)
        import habana_frameworks.torch.hpu as hthpu

        return bool(hthpu.is_available())
    except Exception:  # a broken install must not take the CPU path down with it
        return False


@dataclass(frozen=True)
class Accelerator:
    """A resolved device type ("cuda", "hpu" or "cpu") and the facts that follow from it."""

    device_type: str
    local_rank: int = 0

    @property
    def device(self) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.local_rank)

    @property
    def distributed_backend(self) -> str:
        return {"cuda": "nccl", "hpu": "hccl", "cpu": "gloo"}[self.device_type]

    def autocast(self, bf16: bool) -> ContextManager:
        """BF16 autocast (FP32 master weights stay untouched) or a no-op for FP32 runs."""
        return bf16_autocast(self.device_type, bf16)

    def prepare_bf16(self, bf16: bool) -> None:
        """Settle how BF16 autocast runs on this device before any engine enters it (DeepSpeed's
        `torch_autocast` included); logs the choice once. On CPU see `megatron.cpu_bf16`. On Gaudi, where autocast
        needs nothing, it logs the bridge's mode and the environment the HPU path set (this is the trainer's first
        call after logging is set up; the variables were set before the bridge was imported)."""
        if self.device_type == "hpu":
            log = logging.getLogger("megatron")
            log.info("Gaudi: %s mode (%s)", "lazy" if self.lazy_mode else "eager",
                     "habana_frameworks.torch.utils.internal.is_lazy, else PT_HPU_LAZY_MODE")
            for note in _HABANA_NOTES:
                log.info(note)
        if self.device_type != "cpu":
            return
        if bf16:
            cpu_bf16.install()
        else:
            cpu_bf16.check_unused()

    def prepare_host_memory(self) -> None:
        """On CPU, where tensors live in host memory: keep freed memory in the process (`megatron.host_malloc`);
        logs the choice once. Accelerators allocate through their own caching allocators: nothing to do."""
        if self.device_type == "cpu":
            host_malloc.configure()

    def synchronize(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device_type == "hpu":
            import habana_frameworks.torch.hpu as hthpu

            hthpu.synchronize()

    @property
    def lazy_mode(self) -> bool:
        """Gaudi's lazy mode: ops accumulate into a graph until mark_step. Asked of Habana's bridge, as Habana's own
        code does (`habana_frameworks.torch.utils.internal.is_lazy`); without that function, PT_HPU_LAZY_MODE=1
        (unset means eager: the default of current Gaudi software, where lazy mode is the legacy fallback)."""
        if self.device_type != "hpu":
            return False
        return hpu_is_lazy()

    def mark_step(self) -> None:
        """Cut and launch the accumulated graph in Gaudi's lazy mode; a no-op elsewhere (CUDA, CPU, HPU eager).

        The training loop calls it after each backward, after the optimizer step and after each evaluation
        forward, so no lazy graph spans two of them. Habana's Megatron-DeepSpeed has no calls of its own: its cuts
        come from DeepSpeed's HPU FusedAdam, which calls `htcore.step_closure._mark_step_if_lazy()` before and after
        its update (deepspeed/ops/op_builder/hpu/fused_adam.py). Ours do not depend on the optimizer (Fp8AdamW has
        no such call) and run with every engine, DeepSpeed's included.
        """
        if self.lazy_mode:
            import habana_frameworks.torch.core as htcore

            htcore.mark_step()

    def set_device(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
        elif self.device_type == "hpu":
            import habana_frameworks.torch.hpu as hthpu

            hthpu.set_device(self.local_rank)

    def memory_stats(self) -> dict:
        """Peak memory in MiB: device memory on accelerators, process max RSS on CPU."""
        if self.device_type == "cuda":
            return {
                "mem-allocated-MiB": torch.cuda.memory_allocated(self.device) / 2**20,
                "mem-max-allocated-MiB": torch.cuda.max_memory_allocated(self.device) / 2**20,
            }
        if self.device_type == "hpu":
            import habana_frameworks.torch.hpu as hthpu

            stats = hthpu.memory_stats()
            return {"mem-max-allocated-MiB": stats.get("MaxInUse", 0) / 2**20}
        # ru_maxrss is in KiB on Linux
        return {"mem-max-rss-MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def bf16_autocast(device_type: str, enabled: bool = True) -> ContextManager:
    """BF16 autocast on `device_type`, or a no-op when not enabled.

    On a CPU whose BF16 matmul has no fast kernel, the autocast GEMMs first become FP32 GEMMs on BF16-rounded
    operands (`megatron.cpu_bf16`): the same arithmetic, at FP32 speed.
    """
    if not enabled:
        return contextlib.nullcontext()
    if device_type == "cpu":
        cpu_bf16.install()
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def get_accelerator(requested: str = "auto", local_rank: Optional[int] = None) -> Accelerator:
    """Resolve `--device` (auto/cuda/hpu/cpu) to an `Accelerator`, with a clear error if unavailable."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif _hpu_available():
            requested = "hpu"
        else:
            requested = "cpu"
    elif requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but torch.cuda.is_available() is False; "
                         "use --device cpu or auto")
    elif requested == "hpu" and not _hpu_available():
        raise ValueError("--device hpu was requested but habana_frameworks is not installed or finds "
                         "no Gaudi device; use --device cpu or auto")
    elif requested not in ("cuda", "hpu", "cpu"):
        raise ValueError(f"--device must be one of auto, cuda, hpu, cpu; got {requested!r}")
    return Accelerator(requested, local_rank)
