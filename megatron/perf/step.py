"""One training step projected on a device: the blocks' kernels (extract.py), the rest of the step (outside.py)
and its collectives (comm.py), summed per kernel class.

    step = micro-batches x (layers of the stage x block(forward + backward) + embedding / head / loss)
         + once per step (optimizer, FP8 weight casts, scaling update)
         + exposed communication + pipeline bubble

Kernels run one after another (no two compute kernels overlap); the bubble of the 1F1B schedule is (stages - 1)
micro-batches of one stage's forward and backward. The most loaded stage is the last one (the LM head and the
loss), which also holds the first stage's embedding when there is one stage. Under full activation recompute each
block's forward runs again in its backward. `--fp8-first-last-layers-bf16 N` layers run the BF16 block.

MFU follows Megatron's convention (megatron/perf/flops.py: matmul FLOPs, attention counted in full, 3 passes,
4 with full recompute) against the device's dense BF16 peak, for BF16 and FP8 runs alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megatron.config import MegatronConfig, RecomputeGranularity
from megatron.perf import comm, outside
from megatron.perf.extract import BlockKernels
from megatron.perf.flops import flops_per_iteration
from megatron.perf.hardware import Device
from megatron.perf.kernels import Kernel, KernelClass, seconds_by_class


@dataclass(frozen=True)
class Projection:
    """A step of `config` on `devices` x `device`: seconds per kernel class and what follows from them."""

    device: Device
    devices: int
    by_class: dict[KernelClass, float]
    kernels: tuple[Kernel, ...]
    tokens_per_step: int
    model_flops_per_step: float

    @property
    def step_seconds(self) -> float:
        return sum(self.by_class.values())

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_step / self.step_seconds / self.devices

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / self.devices / self.step_seconds / (self.device.bf16_tflops * 1e12)


def data_parallel_size(config: MegatronConfig, devices: Optional[int]) -> int:
    """The data-parallel size on `devices` devices (the configured one when None); ValueError when the devices
    cannot hold the model split or the global batch does not divide."""
    p, t = config.parallel, config.training
    split = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if devices is None:
        return t.data_parallel_size
    if devices < split or devices % split:
        raise ValueError(f"--project-devices {devices} is not a multiple of tensor x pipeline parallel = {split}")
    dp = devices // split
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(f"--project-devices {devices}: --global-batch-size {t.global_batch_size} is not divisible by "
                         f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp}")
    return dp


def step_kernels(config: MegatronConfig, fp8_block: Optional[BlockKernels], bf16_block: BlockKernels) -> list[Kernel]:
    """Every compute kernel of one step on the most loaded device (module docstring)."""
    m, t, p = config.model, config.training, config.parallel
    micro = t.num_micro_batches
    layers = m.num_layers / p.pipeline_model_parallel_size
    bf16_layers = layers if fp8_block is None else min(layers, 2 * config.fp8.first_last_layers_bf16)
    tokens = t.micro_batch_size * m.seq_length
    per_micro: list[Kernel] = []
    for block, n in ((fp8_block, layers - bf16_layers), (bf16_block, bf16_layers)):
        if block is None or n <= 0:
            continue
        per_micro += [k.times(n) for k in block.kernels]
        if m.recompute_granularity is RecomputeGranularity.FULL:
            recomputed = n if m.recompute_method == "uniform" else min(n, m.recompute_num_layers)
            per_micro += [replace(k, where="backward").times(recomputed) for k in block.forward]
    per_micro += outside.head_kernels(config, tokens)
    if p.pipeline_model_parallel_size == 1:
        per_micro += outside.embedding_kernels(config, tokens)
    once = outside.optimizer_kernels(config) + outside.fp8_weight_kernels(config)
    return [k.times(micro) for k in per_micro] + once


def project(config: MegatronConfig, device: Device, fp8_block: Optional[BlockKernels], bf16_block: BlockKernels,
            devices: Optional[int] = None, peer: Optional[comm.ShardedPeer] = None) -> Projection:
    """The step of `config` (its recipe when `fp8_block` is given, else BF16) on `devices` devices (`peer`: a peer's
    sharded data parallelism, `comm.ShardedPeer`)."""
    p = config.parallel
    config = replace(config, training=replace(config.training, data_parallel_size=data_parallel_size(config, devices)))
    t = config.training
    n_devices = t.data_parallel_size * p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    kernels = step_kernels(config, fp8_block, bf16_block)
    by_class = seconds_by_class(kernels, device)
    micro = t.num_micro_batches
    forward = sum(k.seconds(device) for k in kernels if k.where == "forward") / micro
    backward = sum(k.seconds(device) for k in kernels if k.where == "backward") / micro
    exposed = 0.0
    for c in comm.step_collectives(config, device.devices_per_node, peer):
        hidden = {"backward": backward, "forward": forward}.get(c.overlaps, 0.0) * (c.count if c.count > 1 else 1)
        exposed += max(0.0, c.seconds(device) - hidden)
    by_class[KernelClass.COMMUNICATION] = exposed
    stages = p.pipeline_model_parallel_size
    by_class[KernelClass.BUBBLE] = (stages - 1) * (forward + backward) if stages > 1 else 0.0
    tokens = t.global_batch_size * config.model.seq_length
    return Projection(device, n_devices, by_class, tuple(kernels), tokens,
                      flops_per_iteration(config.model, t.global_batch_size))


def days(seconds: float) -> float:
    return seconds / 86400.0

