"""Model construction measured: the largest tensor a construction produces, and the ~1B-parameter worker.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.support.model_construction MODE` runs
`construction_worker(MODE)` on each rank and prints its measurements as one `RESULT {json}` line
(tests/e2e/test_model_construction_launch.py). MODE "tp" / "pp": this rank's model at TP=2 / PP=2 (the pipeline
wrapped by `build_pipeline_module`). "old-tp": the path before build_model (whole model, then cut): its RSS growth
is ~1.0 x the full bytes, failing the test's bound; kept to show by hand that the check can fail.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.config import LLAMA, ModelConfig
from megatron.model import GPTModel
from megatron.model.build import build_model

SEED = 1234


class LargestTensor(TorchDispatchMode):
    """While active: the bytes (and the op) of the largest non-meta tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.numel() * t.element_size() > self.largest:
                self.largest, self.op = t.numel() * t.element_size(), str(func)
        return out


def largest_parameter(model: torch.nn.Module) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def llama_1b() -> ModelConfig:
    """Llama-style, 1.03e9 parameters: 20 x 45.09e6 per layer + 2 x 65.5e6 (untied embedding and head)."""
    return ModelConfig(num_layers=20, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                       ffn_hidden_size=5632, seq_length=2048, max_position_embeddings=2048,
                       padded_vocab_size=32000, kv_channels=128, **LLAMA)


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def construction_worker(mode: str) -> dict[str, Any]:
    """One rank of `torchrun -m tests.support.model_construction MODE`: build the 1B model, measure (module
    docstring)."""
    from megatron.accelerator import get_accelerator
    from megatron.config import ParallelConfig
    from megatron.parallel import parallelize_tensor
    from megatron.parallel_state import initialize_parallel_state

    torch.set_num_threads(1)
    cfg = llama_1b()
    pp = 2 if mode == "pp" else 1
    parallel = initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=3 - pp,
                                                        pipeline_model_parallel_size=pp), get_accelerator("cpu"))
    if pp > 1:
        from megatron.training.pipeline_engine import build_pipeline_module, pipeline_stage
    full_bytes = 4 * GPTModel(cfg, device="meta").num_parameters()
    before, start = _max_rss_bytes(), time.perf_counter()
    with LargestTensor() as recorder:
        if mode == "old-tp":
            model = parallelize_tensor(GPTModel(cfg, seed=SEED), parallel)
        else:
            stage = pipeline_stage(cfg.num_layers, parallel) if pp > 1 else None
            model = build_model(cfg, "cpu", SEED, parallel, stage=stage)
            if pp > 1:
                build_pipeline_module(model, parallel)
    return {"rank": parallel.rank, "seconds": time.perf_counter() - start, "rss_growth": _max_rss_bytes() - before,
            "full_bytes": full_bytes, "largest_tensor": recorder.largest, "largest_op": recorder.op,
            "largest_piece": largest_parameter(model),
            "local_bytes": sum(p.numel() * 4 for p in model.parameters() if not p.is_meta)}


if __name__ == "__main__":  # a torchrun worker of the 1B test
    # One write of the whole line (a pipe takes writes under 4 KiB whole): print() writes the text and its newline
    # separately, and with unbuffered output the other rank's line could land between them (seen once in CI).
    sys.stdout.write("RESULT " + json.dumps(construction_worker(sys.argv[1])) + "\n")
    sys.stdout.flush()
