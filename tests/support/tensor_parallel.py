"""TP = 1 and TP = 2 models trained side by side in a tensor-parallel worker (tests/e2e/test_tensor_parallel_launch.py,
tests/e2e/test_fp8_recipes_launch.py): every rank trains the full models and its shards on the same batches and
compares its shards with the same slices of the full tensors."""
from __future__ import annotations

import torch

from tests.support.run_noise import relative_error, relative_error_all


def make_engine(model, cfg, parallel):
    from megatron.optimizer import build_optimizer
    from megatron.optimizer.lr_scheduler import LrScheduler
    from megatron.training.engine import TorchEngine

    optimizer = build_optimizer(model, cfg.optimizer)
    return TorchEngine(model, optimizer, LrScheduler(optimizer, cfg.scheduler), parallel, cfg.optimizer.clip_grad)


def batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    tokens = torch.randint(0, 128, (4, cfg.model.seq_length), generator=g)
    labels = torch.randint(0, 128, (4, cfg.model.seq_length), generator=g)
    return tokens, labels


def train_side_by_side(parallel, cfg, models: dict, sharded: set, bf16: dict, steps: int) -> dict:
    """Train `models` (name -> model; those named in `sharded` are TP=2) on the same batches; per model: its
    losses, grad norms, gradients of every step, weights and logits, the TP=1 ones cut to this rank's shard."""
    from megatron.fp8 import Fp8Linear, fp8_optimizer_step
    from megatron.parallel import shard_state_dict
    from megatron.parallel_state import ParallelState

    rank, size = parallel.tensor_parallel_rank, parallel.tensor_parallel_size

    def local(name: str, tensors: dict) -> dict:
        return dict(tensors) if name in sharded else shard_state_dict(tensors, cfg.model, rank, size)

    def logits(name: str, model) -> torch.Tensor:
        tokens, _ = batch(cfg, 100)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16[name]):
            return model.eval()(tokens).detach().clone()

    engines = {name: make_engine(m, cfg, parallel if name in sharded else ParallelState())
               for name, m in models.items()}
    traces = {name: {"loss": [], "grad_norm": [], "grads": [], "logits_first": logits(name, m)}
              for name, m in models.items()}
    for step in range(steps):
        tokens, labels = batch(cfg, step)
        for name, engine in engines.items():
            model = engine.model
            model.train()
            engine.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16[name]):
                loss = engine.module(tokens, labels=labels).mean()
            engine.backward(loss)
            norm, _ = engine.step(step, True)
            trace = traces[name]
            trace["loss"].append(loss.detach().clone())
            trace["grad_norm"].append(norm)
            trace["grads"].append(local(name, {n: p.grad.clone() for n, p in model.named_parameters()}))
            if any(isinstance(m, Fp8Linear) for m in model.modules()):
                fp8_optimizer_step(model)
    for name, model in models.items():
        traces[name]["weights"] = local(name, model.state_dict())
        traces[name]["logits"] = logits(name, model)
    return traces


def errors(a: dict, b: dict) -> dict:
    """Relative errors of trace `a` against trace `b`: per step (loss, grad norm), max over tensors and steps
    (gradients), max over tensors (weights), and of the logits before and after training."""
    return {
        "loss": [relative_error(x, y) for x, y in zip(a["loss"], b["loss"])],
        "grad_norm": [abs(x - y) / y for x, y in zip(a["grad_norm"], b["grad_norm"])],
        "grad": max(relative_error(ga[n], gb[n]) for ga, gb in zip(a["grads"], b["grads"]) for n in gb),
        "grad_all": max(relative_error_all(ga, gb) for ga, gb in zip(a["grads"], b["grads"])),
        "weights": max(relative_error(a["weights"][n], b["weights"][n]) for n in b["weights"]),
        "weights_all": relative_error_all(a["weights"], b["weights"]),
        "logits_first": relative_error(a["logits_first"], b["logits_first"]),
        "logits": relative_error(a["logits"], b["logits"]),
        "logits_shape_equal": a["logits"].shape == b["logits"].shape,
    }
