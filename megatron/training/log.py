"""The Megatron log line and TensorBoard scalars.

Tags follow Megatron-DeepSpeed's `training_log` so existing dashboards work: `lm-loss-training/lm loss`,
`learning-rate/learning-rate`, `grad-norm/grad-norm`, `batch-size/batch-size` (--log-batch-size-to-tensorboard),
`iteration-time/iteration-time` (--log-timers-to-tensorboard, seconds), `lm-loss-validation/lm loss validation`
(and `... ppl`, and `lm loss test` for the test split), each keyed by iteration with its "<tag> vs samples" and
"<tag> vs tokens" twins, plus the `steps-vs-samples/*` and `steps-vs-tokens/*` conversions. Our own tags
(throughput, memory, skipped/nan iterations, FP8 and SwiGLU statistics) keep their names, keyed by iteration
and by tokens.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

logger = logging.getLogger("megatron")


def host_floats(values: list) -> list[float]:
    """`values` (floats and 0-d tensors of one device) as floats, with one device read for all the tensors."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().float() for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def setup_logging(rank: int) -> None:
    """INFO on the logging rank, WARNING elsewhere, so N ranks do not print N copies."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", force=True)


class TrainingLogger:
    """Accumulates per-iteration values between log lines and writes them out every `--log-interval`."""

    def __init__(self, log_interval: int, train_iters: int, tensorboard_dir: Optional[str], enabled: bool,
                 log_batch_size: bool = False, log_timers: bool = False, wandb=None) -> None:
        """`wandb`: a writer (megatron/training/wandb_log.py) that gets every scalar by iteration, on this rank."""
        self.log_interval = log_interval
        self.log_batch_size = log_batch_size
        self.log_timers = log_timers
        self.train_iters = train_iters
        self.enabled = enabled
        self.writer = None
        self.wandb = wandb if enabled else None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)
        self._reset()

    def _reset(self) -> None:
        self.losses, self.time_sum, self.iters = [], 0.0, 0

    def scalar(self, tag: str, value: float, iteration: int, tokens: Optional[int] = None,
               samples: Optional[int] = None) -> None:
        """`tag` by iteration, and its "<tag> vs samples" / "<tag> vs tokens" twins when those are given."""
        if self.wandb is not None:
            self.wandb.add_scalar(tag, value, iteration)
        if self.writer is None:
            return
        self.writer.add_scalar(tag, value, iteration)
        if samples is not None:
            self.writer.add_scalar(f"{tag} vs samples", value, samples)
        if tokens is not None:
            self.writer.add_scalar(f"{tag} vs tokens", value, tokens)

    def _megatron_scalars(self, iteration: int, samples: int, tokens: int, values: dict) -> None:
        if self.writer is not None:
            self.writer.add_scalar("steps-vs-samples/y=steps,x=samples", iteration, samples)
            self.writer.add_scalar("steps-vs-samples/y=samples,x=steps", samples, iteration)
            self.writer.add_scalar("steps-vs-tokens/y=steps,x=tokens", iteration, tokens)
            self.writer.add_scalar("steps-vs-tokens/y=tokens,x=steps", tokens, iteration)
        for tag, value in values.items():
            self.scalar(tag, value, iteration, tokens, samples)

    def record(self, *, iteration: int, loss: Optional[float | torch.Tensor], elapsed_s: float, lr: float,
               grad_norm: float | torch.Tensor, state, global_batch_size: int, seq_length: int, flops_per_iter: float,
               world_size: int, memory: dict, extra: Optional[dict] = None, extra_text: str = "") -> Optional[str]:
        """Accumulate one iteration; every `log_interval` iterations emit the log line (returned).

        `loss` and `grad_norm` may be 0-d device tensors: they are summed on the device and read only here, at
        log iterations (no host synchronisation on the others).
        """
        if loss is not None:
            self.losses.append(loss)
        self.time_sum += elapsed_s
        self.iters += 1
        tokens = state.consumed_train_tokens
        if iteration % self.log_interval != 0:
            return None
        if not self.enabled:
            self._reset()  # drop the interval's device tensors
            return None
        avg_time = self.time_sum / max(self.iters, 1)
        avg_loss = sum(host_floats(self.losses)) / len(self.losses) if self.losses else float("nan")
        grad_norm = float(grad_norm)
        tokens_per_s = global_batch_size * seq_length / avg_time
        tflops = flops_per_iter / avg_time / world_size / 1e12
        line = (f" iteration {iteration:8d}/{self.train_iters:8d} |"
                f" consumed samples: {state.consumed_train_samples:12d} |"
                f" consumed tokens: {tokens:14d} |"
                f" elapsed time per iteration (ms): {avg_time * 1000:.1f} |"
                f" learning rate: {lr:.6E} |"
                f" global batch size: {global_batch_size:5d} |"
                f" lm loss: {avg_loss:.6E} |"
                f" grad norm: {grad_norm:.3f} |"
                f" tokens/s: {tokens_per_s:.1f} |"
                f" TFLOP/s per device: {tflops:.4f} |"
                f" number of skipped iterations: {state.skipped_iterations:3d} |"
                f" number of nan iterations: {state.nan_iterations:3d} |{extra_text}")
        logger.info(line)
        megatron = {"learning-rate/learning-rate": lr}
        if math.isfinite(avg_loss):
            megatron["lm-loss-training/lm loss"] = avg_loss
        if math.isfinite(grad_norm):
            megatron["grad-norm/grad-norm"] = grad_norm
        if self.log_batch_size:
            megatron["batch-size/batch-size"] = global_batch_size
        if self.log_timers:
            megatron["iteration-time/iteration-time"] = avg_time
        self._megatron_scalars(iteration, state.consumed_train_samples, tokens, megatron)
        self.scalar("throughput/tokens-per-sec", tokens_per_s, iteration, tokens)
        self.scalar("throughput/tflops-per-device", tflops, iteration, tokens)
        self.scalar("skipped-iterations", state.skipped_iterations, iteration, tokens)
        self.scalar("nan-iterations", state.nan_iterations, iteration, tokens)
        for key, value in memory.items():
            self.scalar(f"memory/{key}", value, iteration, tokens)
        for key, value in (extra or {}).items():
            self.scalar(key, value, iteration, tokens)
        self._reset()
        return line

    def validation(self, name: str, loss: float, iteration: int, tokens: int, samples: Optional[int] = None) -> str:
        """`name` is "validation" or "test": Megatron's `lm-loss-validation/lm loss <name>` (and `... ppl`)."""
        ppl = math.exp(min(loss, 20.0))
        line = f" {name} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        if self.enabled:
            logger.info("-" * len(line))
            logger.info(line)
            logger.info("-" * len(line))
        self.scalar(f"lm-loss-validation/lm loss {name}", loss, iteration, tokens, samples)
        self.scalar(f"lm-loss-validation/lm loss {name} ppl", ppl, iteration, tokens, samples)
        return line

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
