"""The collectives of one training step on one device, from the parallel layout and our own code paths.

Placement (Megatron's rank order: tensor-parallel ranks innermost, then data-parallel, then pipeline): a group
stays inside a node while its ranks' span fits in `devices_per_node`, and then runs at the node's intra-node
bandwidth; otherwise at the device's scale-out bandwidth (each device has its own NIC share, so a ring across
nodes is bound by it). A collective of `n` ranks over a tensor of B bytes moves 2 (n-1)/n B per device
(all-reduce, ring) or (n-1)/n B (all-gather, reduce-scatter); a pipeline send moves B. Each costs a latency of
`COLLECTIVE_LATENCY_US` more.

What is sent, per our code:
- data parallel (the torch engine's DDP, DeepSpeed ZeRO 0-2): FP32 gradients (4 bytes per parameter: FP32 weights,
  or FP32 main gradients with `--params-dtype bf16`), reduced once per step after the last micro-batch (DDP's
  no_sync, DeepSpeed's accumulation boundary); all-reduce for ZeRO 0, reduce-scatter for ZeRO 1-2, whose updated
  weights are then all-gathered (their dtype's bytes). ZeRO-3 all-gathers the weights before each micro-batch's
  forward and again before its backward, and reduce-scatters the gradients after each micro-batch.
- tensor parallel: per layer and micro-batch, the outputs of the attention projection and fc2 are all-reduced in
  forward and the inputs' gradients of qkv and fc1 in backward (BF16 activations, tokens x hidden); sequence
  parallelism turns each all-reduce into a reduce-scatter and an all-gather, the same bytes.
- pipeline parallel: each micro-batch's activations (BF16, tokens x hidden) sent forward and their gradient
  backward, at every stage boundary.

Overlap rule: the data-parallel gradient reduction is issued during the last micro-batch's backward and overlaps
it; only the part longer than that backward is exposed. ZeRO-3's gathers overlap the forward and backward they
precede (prefetch) the same way. ZeRO 1-2's weight all-gather after the optimizer step, tensor-parallel and
pipeline collectives are exposed in full (they sit on the critical path of the layer that needs them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.config import MegatronConfig
from megatron.perf.hardware import COMM_EFFICIENCY, Device
from megatron.perf import outside
from megatron.perf.outside import device_parameters

# Per-collective latency (NCCL's small-message all-reduce on NVLink is ~10 us; across nodes ~20-30 us).
COLLECTIVE_LATENCY_US = 10.0


@dataclass(frozen=True)
class Collective:
    """`count` calls per step of one collective over `ranks` ranks on a tensor of `bytes` bytes."""

    name: str
    op: str  # all-reduce, all-gather, reduce-scatter, send
    bytes: float
    ranks: int
    count: float
    across_nodes: bool
    overlaps: str = ""  # "" = exposed in full; "backward" / "forward" = overlaps that compute (module docstring)

    def seconds(self, dev: Device) -> float:
        n = self.ranks
        factor = {"all-reduce": 2.0 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
                  "send": 1.0}[self.op]
        bandwidth = (dev.scale_out_gbps if self.across_nodes else dev.intra_node_gbps) * 1e9 * COMM_EFFICIENCY
        return self.count * (factor * self.bytes / bandwidth + COLLECTIVE_LATENCY_US * 1e-6)


def step_collectives(config: MegatronConfig, devices_per_node: int,
                     gather_bytes: Optional[float] = None) -> list[Collective]:
    """Every collective one device takes part in during one step (module docstring). `gather_bytes`: bytes per
    parameter of ZeRO's weight all-gathers when they are not the weights' dtype (a peer that gathers FP8 weights)."""
    m, t, p = config.model, config.training, config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    data_parallel, micro = t.data_parallel_size, t.num_micro_batches
    params = device_parameters(config)
    weight_bytes = gather_bytes if gather_bytes is not None else outside.weight_bytes(config)
    activation = 2.0 * t.micro_batch_size * m.seq_length * m.hidden_size
    out: list[Collective] = []
    if data_parallel > 1:
        dp_inter = tp * data_parallel > devices_per_node
        zero = p.zero_stage or 0
        if zero == 3:
            out += [Collective("ZeRO-3 weight all-gather (forward)", "all-gather", params * weight_bytes,
                               data_parallel, micro, dp_inter, "forward"),
                    Collective("ZeRO-3 weight all-gather (backward)", "all-gather", params * weight_bytes,
                               data_parallel, micro, dp_inter, "backward"),
                    Collective("ZeRO-3 gradient reduce-scatter", "reduce-scatter", params * 4.0, data_parallel,
                               micro, dp_inter, "backward")]
        elif zero in (1, 2):
            out += [Collective("gradient reduce-scatter", "reduce-scatter", params * 4.0, data_parallel, 1,
                               dp_inter, "backward"),
                    Collective("updated weight all-gather", "all-gather", params * weight_bytes, data_parallel, 1,
                               dp_inter)]
        else:
            out.append(Collective("gradient all-reduce", "all-reduce", params * 4.0, data_parallel, 1, dp_inter,
                                  "backward"))
    if tp > 1:
        layers = m.num_layers / pp
        out.append(Collective("tensor-parallel activations" + (" (SP)" if p.sequence_parallel else ""),
                              "all-reduce", activation, tp, 4 * layers * micro, tp > devices_per_node))
    if pp > 1:
        out.append(Collective("pipeline sends", "send", activation, 2, 2 * micro,
                              tp * data_parallel >= devices_per_node))
    return out

