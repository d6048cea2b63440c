"""The performance model's collectives (megatron/perf/comm.py) against what our engines send: 2-rank gloo runs of
`pretrain_gpt.py` with every collective counted (tests/support/count_collectives.py), one steady-state step.

The model's bytes per device, summed over its collectives (ring algorithms), must equal the counted ones up to the
collectives it leaves out on purpose: 0-d values (the loss average, DeepSpeed's overflow flag and gradient norm),
at most 16 bytes each.
"""
from __future__ import annotations

import json

import pytest

from megatron.arguments import parse_config
from megatron.perf import comm
from tests.support.config import tiny_argv, write_zero3_config
from tests.support.launch import launch_checked

# 3 steps of 8 samples as micro-batches of 2 (2 or 4 per rank and step); hidden 128, so that an activation collective
# (32-64 KiB) is far above the 0-d ones.
RUN = dict(micro_batch_size=2, global_batch_size=8, train_iters=3, eval_iters=0, eval_interval=1000, log_interval=1,
           hidden_size=128, seq_length=64)
LAYOUTS = {
    "deepspeed-zero1-bf16-weights": ("--deepspeed", "--zero-stage", "1", "--bf16", "--params-dtype", "bf16"),
    "tensor-parallel-sp-bf16": ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"),
    "pipeline": ("--pipeline-model-parallel-size", "2", "--deepspeed"),
    "ddp": (),
    "main-grads-bf16-weights": ("--bf16", "--params-dtype", "bf16"),
    "tensor-parallel": ("--tensor-model-parallel-size", "2"),
    "deepspeed-zero2": ("--deepspeed", "--zero-stage", "2"),
    "deepspeed-zero3": ("--deepspeed", "--zero-stage", "3"),
    "fsdp2-bf16": ("--use-torch-fsdp2", "--bf16"),
    "fsdp2-kept-gathered-bf16-reduction": ("--use-torch-fsdp2", "--no-fsdp-reshard-after-forward",
                                           "--grad-reduce-in-bf16"),
    "fsdp2-fp8-param-gather": ("--use-torch-fsdp2", "--bf16", "--fp8-format", "hybrid", "--fp8-param-gather"),
}


def _model_bytes(argv: list[str]) -> float:
    config = parse_config(argv, world_size=2)
    return sum(c.wire_bytes for c in comm.step_collectives(config, 8))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_bytes_equal_counted_bytes(layout, tmp_path):
    switches = LAYOUTS[layout]
    if layout == "deepspeed-zero3":  # every weight partitioned and gathered (DeepSpeed keeps < 1e5-element ones)
        switches += ("--deepspeed_config", write_zero3_config(tmp_path))
    argv = tiny_argv(*switches, **RUN)
    out = tmp_path / "counts"
    launch_checked(2, [str(out), "--", *argv], script="tests/support/count_collectives.py", timeout=600)
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts.rank{rank}.json").read_text())
        last = counts[str(RUN["train_iters"] - 1)]  # a step after the first (DeepSpeed traces ZeRO-3's first)
        measured = sum(wire for op, (_, wire) in last.items() if op != "recv")  # a link is full duplex
        calls = sum(n for op, (n, _) in last.items() if op != "recv")
        model = _model_bytes(argv)
        assert model <= measured <= model + 16 * calls, (rank, last, model)
