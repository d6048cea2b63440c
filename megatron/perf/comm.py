"""The collectives of one training step on one device, from the parallel layout and our own code paths.

Placement (Megatron's rank order: tensor-parallel ranks innermost, then data-parallel, then pipeline): a group
stays inside a node while its ranks' span fits in `devices_per_node`, and then runs at the node's intra-node
bandwidth; otherwise at the device's scale-out bandwidth (each device has its own NIC share, so a ring across
nodes is bound by it). A collective of `n` ranks over a tensor of B bytes moves 2 (n-1)/n B per device
(all-reduce, ring) or (n-1)/n B (all-gather, reduce-scatter); a pipeline send moves B. Each costs a latency of
`COLLECTIVE_LATENCY_US` more.

What is sent, per our code (each count checked against a counting process group in 2-rank gloo runs,
tests/e2e/test_perf_comm.py):
- data parallel, the torch engine: FP32 gradients (4 bytes per parameter: DDP's buckets with FP32 weights, or the
  flat FP32 main gradient with `--params-dtype bf16`), all-reduced once per step after the last micro-batch (DDP's
  no_sync).
- data parallel, DeepSpeed: gradients in the weights' dtype (BF16 with `--params-dtype bf16`). ZeRO 0-1 all-reduce
  them once per step (at the accumulation boundary); ZeRO-2 reduces each micro-batch's gradients as backward makes
  them, an all-reduce per owner's slice: the bytes of a full all-reduce per micro-batch. ZeRO 1-2 then all-gather
  the updated weights (their dtype's bytes). ZeRO-3 all-gathers the weights before each micro-batch's forward,
  again before its backward for the blocks whose weights it has released (those used again only after
  `stage3_max_reuse_distance` elements, 1e9 by default, have been gathered), and reduce-scatters the gradients
  after each micro-batch.
- tensor parallel: per layer and micro-batch, the outputs of the attention projection and fc2 are all-reduced in
  forward and the inputs' gradients of qkv and fc1 in backward (activations, tokens x hidden, 2 bytes under
  `--bf16`, else 4); sequence parallelism turns each all-reduce into a reduce-scatter and an all-gather, the same
  bytes. Per micro-batch also the vocabulary-parallel embedding's output (forward, in the weights' dtype) and the
  LM head's input gradient (backward), and the vocabulary-parallel cross-entropy's three all-reduces of one FP32
  value per token; with sequence parallelism once per step the norms' weight gradients.
- pipeline parallel: each micro-batch's activations sent forward and their gradient backward at every stage
  boundary: a middle stage sends two per micro-batch, the first and last one.

Overlap rule: the data-parallel gradient reduction is issued during the last micro-batch's backward and overlaps
it; only the part longer than that backward is exposed. ZeRO-3's gathers overlap the forward and backward they
precede (prefetch) the same way. ZeRO 1-2's weight all-gather after the optimizer step, tensor-parallel and
pipeline collectives are exposed in full (they sit on the critical path of the layer that needs them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from megatron.config import MegatronConfig
from megatron.perf.hardware import COMM_EFFICIENCY, Device
from megatron.perf import outside
from megatron.perf.flops import block_linear_weights, fp8_gathered_parameters
from megatron.perf.outside import device_parameters

# Per-collective latency (NCCL's small-message all-reduce on NVLink is ~10 us; across nodes ~20-30 us).
COLLECTIVE_LATENCY_US = 10.0


def ring_factor(op: str, ranks: int) -> float:
    """Bytes one device moves per byte of the collective's tensor, with ring algorithms (module docstring): the
    all-reduced tensor, the all-gathered output, the reduce-scattered input, the tensor sent, received or broadcast."""
    n = ranks
    return {"all-reduce": 2.0 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
            "broadcast": (n - 1) / n, "send": 1.0, "recv": 1.0}[op]


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

    @property
    def wire_bytes(self) -> float:
        """Bytes one device moves for this collective in one step."""
        return self.count * ring_factor(self.op, self.ranks) * self.bytes

    def seconds(self, dev: Device) -> float:
        bandwidth = (dev.scale_out_gbps if self.across_nodes else dev.intra_node_gbps) * 1e9 * COMM_EFFICIENCY
        return self.wire_bytes / bandwidth + self.count * COLLECTIVE_LATENCY_US * 1e-6


@dataclass(frozen=True)
class ShardedPeer:
    """A peer's sharded data parallelism where the model stands it in as ZeRO-3 (torchtitan's FSDP2): bytes per
    parameter of its weight all-gathers and of its gradient reduce-scatter, and the fraction of the weights it
    gathers again for backward (FSDP2's reshard after forward: 1)."""

    gather_bytes: float
    grad_bytes: float
    backward_regather: float = 1.0


def step_collectives(config: MegatronConfig, devices_per_node: int,
                     peer: Optional[ShardedPeer] = None) -> list[Collective]:
    """Every collective one device takes part in during one step (module docstring); `peer`: see `ShardedPeer`."""
    m, t, p = config.model, config.training, config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    data_parallel, micro = t.data_parallel_size, t.num_micro_batches
    params = device_parameters(config)
    weight_bytes = peer.gather_bytes if peer is not None else outside.weight_bytes(config)
    grad_bytes = peer.grad_bytes if peer is not None else None
    tokens = t.micro_batch_size * m.seq_length
    activation = (2.0 if t.bf16 else 4.0) * tokens * m.hidden_size
    out: list[Collective] = []
    if data_parallel > 1:
        dp_inter = tp * data_parallel > devices_per_node
        zero = p.zero_stage or 0
        if grad_bytes is None:  # DeepSpeed reduces in the weights' dtype; the torch engine in FP32
            grad_bytes = outside.weight_bytes(config) if p.deepspeed else 4.0
        if p.use_torch_fsdp2 and peer is None:
            out += _fsdp2_collectives(config, params, micro, dp_inter)
        elif zero == 3:
            regather = peer.backward_regather if peer is not None else _zero3_backward_regather(config)
            out += [Collective("ZeRO-3 weight all-gather (forward)", "all-gather", params * weight_bytes,
                               data_parallel, micro, dp_inter, "forward"),
                    Collective("ZeRO-3 gradient reduce-scatter", "reduce-scatter", params * grad_bytes,
                               data_parallel, micro, dp_inter, "backward")]
            if regather > 0:
                out.insert(1, Collective("ZeRO-3 weight all-gather (backward)", "all-gather",
                                         regather * params * weight_bytes, data_parallel, micro, dp_inter, "backward"))
        else:
            per_micro = zero == 2 and p.deepspeed
            out.append(Collective("gradient all-reduce", "all-reduce", params * grad_bytes, data_parallel,
                                  micro if per_micro else 1, dp_inter, "backward"))
            if zero in (1, 2):
                out.append(Collective("updated weight all-gather", "all-gather", params * weight_bytes,
                                      data_parallel, 1, dp_inter))
    if tp > 1:
        layers = m.num_layers / pp
        tp_inter = tp > devices_per_node
        sp = " (SP)" if p.sequence_parallel else ""
        out.append(Collective("tensor-parallel activations" + sp, "all-reduce", activation, tp, 4 * layers * micro,
                              tp_inter))
        # The first stage holds the embedding, the last the LM head and the loss (both without pipelining). The
        # device modelled is on the last stage, whose share is the larger: the head's gradient and the loss.
        if pp == 1:
            embedding = outside.weight_bytes(config) * tokens * m.hidden_size
            out.append(Collective("tensor-parallel embedding output" + sp, "all-reduce", embedding, tp, micro,
                                  tp_inter))
        out += [Collective("tensor-parallel LM head input gradient" + sp, "all-reduce", activation, tp, micro,
                           tp_inter),
                Collective("vocabulary-parallel cross-entropy", "all-reduce", 4.0 * tokens, tp, 3 * micro, tp_inter)]
        if p.sequence_parallel:
            norms = (2 * layers + 1) * m.hidden_size  # two per block and the final norm
            out.append(Collective("sequence-parallel norm gradients", "all-reduce",
                                  norms * outside.weight_bytes(config), tp, 1, tp_inter))
    if pp > 1:
        out.append(Collective("pipeline sends", "send", activation, 2, (1 if pp == 2 else 2) * micro,
                              tp * data_parallel >= devices_per_node))
    return out


def _fsdp2_collectives(config: MegatronConfig, params: float, micro: int, dp_inter: bool) -> list[Collective]:
    """FSDP2 (megatron/training/fsdp2.py): each micro-batch gathers the weights for forward (BF16 under --bf16, else
    FP32) and again for backward unless --no-fsdp-reshard-after-forward; the gradients are reduce-scattered once per
    step, after the last micro-batch (FP32, or BF16 with --grad-reduce-in-bf16). Under --fp8-param-gather the FP8
    layers' weights travel as 1 byte per element."""
    p, data_parallel = config.parallel, config.training.data_parallel_size
    fp8 = fp8_gathered_parameters(config)
    gather = (2.0 if config.training.bf16 else 4.0) * (params - fp8) + 1.0 * fp8
    out = [Collective("FSDP2 weight all-gather (forward)", "all-gather", gather, data_parallel, micro, dp_inter,
                      "forward"),
           Collective("FSDP2 gradient reduce-scatter", "reduce-scatter",
                      (2.0 if p.grad_reduce_in_bf16 else 4.0) * params, data_parallel, 1, dp_inter, "backward")]
    if p.fsdp_reshard_after_forward:
        out.insert(1, Collective("FSDP2 weight all-gather (backward)", "all-gather", gather, data_parallel, micro,
                                 dp_inter, "backward"))
    return out


def _zero3_backward_regather(config: MegatronConfig) -> float:
    """The fraction of the weights DeepSpeed's ZeRO-3 gathers again for backward: a block's weights stay gathered
    from its forward to its backward when fewer than `stage3_max_reuse_distance` elements (the DeepSpeed JSON's, or
    1e9) are gathered in between: the blocks after it, forward and backward, and the LM head."""
    reuse = 1e9
    if config.parallel.deepspeed_config:
        try:
            with open(config.parallel.deepspeed_config) as f:
                reuse = float(json.load(f).get("zero_optimization", {}).get("stage3_max_reuse_distance", reuse))
        except (OSError, ValueError, AttributeError):
            pass  # parse_config has read and checked the file; a model of it keeps DeepSpeed's default
    m = config.model
    layers = m.num_layers // config.parallel.pipeline_model_parallel_size
    block = sum(block_linear_weights(m).values()) / config.parallel.tensor_model_parallel_size
    head = m.padded_vocab_size * m.hidden_size / config.parallel.tensor_model_parallel_size
    released = sum(1 for i in range(layers) if 2 * (layers - 1 - i) * block + head >= reuse)
    return released / layers
