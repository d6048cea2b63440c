"""The pretraining loop: the model from `parallelize`, an engine around it, then train, evaluate and checkpoint.

One iteration = one optimizer step over a global batch of `micro_batch_size * dp * accumulation`
samples. Each micro-batch loss is the mean over its unmasked tokens; the step averages micro-batch
losses (Megatron's convention), so 8 micro-batches of 1 equal 1 micro-batch of 8 when no tokens are
masked. Non-finite loss or gradient norm skips the step (counted); too many in a row stop the run
without saving, so the last good checkpoint stays the newest one.

Host synchronisation: the loss and the gradient norm stay on the device; a step reads the host once, for
its skip decision (in the engine). Losses are read at log iterations, the timing synchronises at log
iterations only, and the exit checks reduce CPU flags over the gloo host group. docs/distributed.md,
"Host synchronisation", lists every read that remains and why.
"""
from __future__ import annotations

import logging
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch
from torch import nn

from megatron import comm
from megatron.accelerator import Accelerator, get_accelerator
from megatron.checkpoint import store as ckpt
from megatron.checkpoint.fallback import resume_iteration
from megatron.checkpoint.folders import check_load_folder, check_save_folder, prune_checkpoints
from megatron.checkpoint.train_state import TrainState
from megatron.config import MegatronConfig
from megatron.data.provider import Batch, build_loader, make_batch
from megatron.optimizer import build_optimizer
from megatron.optimizer.fp8_adam_warmup import warm_up_fp8_adam
from megatron.optimizer.lr_scheduler import LrScheduler
from megatron.parallel_state import ParallelState, initialize_parallel_state
from megatron.training import run_plan
from megatron.training.datasets import build_datasets
from megatron.training.divergence import DivergenceGuard, max_abs_weight
from megatron.training.engines import build_engine
from megatron.training.parallelize import parallelize
from megatron.perf.flops import flops_per_iteration
from megatron.training.log import TrainingLogger, host_floats, setup_logging
from megatron.training.swiglu_hooks import STATE_KEY as SWIGLU_STATE_KEY
from megatron.training.stall import StallWatchdog
from megatron.training.wandb_log import build_wandb_writer

logger = logging.getLogger("megatron")


class TrainingDiverged(RuntimeError):
    """Raised after `--max-consecutive-nan-steps` non-finite steps in a row."""


@dataclass
class TrainResult:
    state: TrainState
    losses: list = field(default_factory=list)  # lm loss per iteration run in this process (nan if skipped)
    valid: list = field(default_factory=list)  # (iteration, validation loss)
    test_loss: Optional[float] = None
    exit_reason: str = "train-iters"
    model: Optional[nn.Module] = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _SignalFlag:
    """Remembers a SIGTERM so the loop can save a checkpoint and exit at the end of the iteration."""

    def __init__(self, enabled: bool) -> None:
        self.received = False
        self._previous = None
        if enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        logger.warning("received signal %d: will save a checkpoint and exit after this iteration", signum)
        self.received = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _any_rank(flags: list[bool], parallel: ParallelState) -> list[bool]:
    """Each flag OR-ed over all ranks: one MAX all-reduce of a CPU tensor over the gloo host group, so no
    rank waits for its accelerator (a no-op with one process)."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags])
    comm.all_reduce(t, parallel.host_group, comm.ReduceOp.MAX)
    return [v > 0 for v in t.tolist()]


class Trainer:
    """Owns the objects of one run; `pretrain()` is the public entry point."""

    def __init__(self, config: MegatronConfig, tokenizer=None) -> None:
        self.config = config
        self.accel: Accelerator = get_accelerator(config.device)
        self.accel.set_device()
        self.parallel = initialize_parallel_state(config.parallel, self.accel)
        setup_logging(self.parallel.rank)
        for note in config.compat.notes:  # upstream flags accepted as no-ops, the env recipe (megatron/compat.py)
            logger.info(note)
        t = config.training
        self.accel.prepare_bf16(t.bf16)
        self.accel.prepare_host_memory()
        if t.data_parallel_size != self.parallel.data_parallel_size:
            raise ValueError(f"config was resolved for data-parallel size {t.data_parallel_size} but "
                             f"{self.parallel.data_parallel_size} ranks are running; launch with the same WORLD_SIZE")
        seed_everything(t.seed)
        built = parallelize(config, self.parallel, self.accel)
        self.model, self.fp8, self.swiglu = built.model, built.fp8, built.swiglu
        self.optimizer = build_optimizer(self.model, config.optimizer)
        # compiled now, not inside the first iteration
        seconds = warm_up_fp8_adam(self.optimizer, sharded=config.parallel.use_torch_fsdp2)
        if seconds is not None:
            logger.info("> torch.compile: Fp8AdamW's update compiled in %.1f s, before the first iteration", seconds)
        self.scheduler = LrScheduler(self.optimizer, config.scheduler)
        self.engine = build_engine(config, self.model, self.optimizer, self.scheduler, self.parallel, self.accel)
        self.state = TrainState()
        self.guard = DivergenceGuard(config.divergence, config.scheduler.warmup_iters)
        self.last_healthy: Optional[str] = None  # the newest checkpoint known healthy (loaded or saved by this run)
        self.save_failures = 0  # interval saves that failed in a row
        check_load_folder(config.checkpoint.load, config.checkpoint.save)
        if config.checkpoint.load:
            self._load()
        check_save_folder(config.checkpoint.save, config.checkpoint.load, self.state.iteration)
        self.train_ds, self.valid_ds, self.test_ds, self.eod = build_datasets(config, tokenizer, self.parallel)
        # global batches each evaluation reads, per split: --eval-iters, capped to one pass unless given
        self.eval_iters = run_plan.report(config, self.parallel,
                                          {"train": self.train_ds, "valid": self.valid_ds, "test": self.test_ds})
        self.flops_per_iter = flops_per_iteration(config.model, t.global_batch_size)
        wandb = (build_wandb_writer(config.logging, config.checkpoint.save, config.to_dict())
                 if self.parallel.is_logging_rank else None)
        self.tlog = TrainingLogger(config.logging.log_interval, t.train_iters, config.logging.tensorboard_dir,
                                   enabled=self.parallel.is_logging_rank, log_batch_size=config.logging.log_batch_size,
                                   log_timers=config.logging.log_timers, wandb=wandb)

    # -------------------------------------------------------------------------------- checkpoints
    def _load(self) -> None:
        c = self.config.checkpoint
        # The engine restores weights and optimizer state in place, in its own layout.
        iteration = resume_iteration(c.load, c.fallback, self.parallel.host_group)
        loaded = None if iteration is None else self.engine.load_checkpoint(
            c.load, load_optimizer=not (c.no_load_optim or c.finetune), module_only=c.finetune, iteration=iteration)
        if loaded is None:
            logger.info("no checkpoint found under --load %s: starting from scratch", c.load)
            return
        payload = loaded["payload"]
        if c.finetune:
            logger.info("--finetune: loaded weights only from %s; iteration and optimizer reset", loaded["path"])
            return
        self.state = TrainState.from_dict(loaded["train_state"])
        for diff in self.scheduler.check_state_dict(payload.get("lr_scheduler", {})):
            if self.parallel.is_logging_rank:  # the same on every rank: said once
                logger.warning("learning-rate schedule differs from the checkpoint (flags win): %s", diff)
        if not c.no_load_rng and "rng_state" in payload:
            ckpt.set_rng_state(payload["rng_state"])
        self.fp8.load_state(payload.get("fp8"), loaded["path"])
        self.swiglu.load_state(payload.get(SWIGLU_STATE_KEY), loaded["path"])
        self.last_healthy = str(loaded["path"])
        logger.info("loaded checkpoint %s at iteration %d", loaded["path"], self.state.iteration)

    def save(self) -> None:
        c = self.config.checkpoint
        if not c.save:
            return
        extras = {"lr_scheduler": self.scheduler.state_dict()}
        if not c.no_save_rng:
            extras["rng_state"] = ckpt.get_rng_state()
        fp8_state = self.fp8.state()
        if fp8_state is not None:
            extras["fp8"] = fp8_state
        swiglu_state = self.swiglu.state()  # the jump warnings' history (rank 0's; absent where diagnostics are off)
        if swiglu_state is not None:
            extras[SWIGLU_STATE_KEY] = swiglu_state
        self.state.healthy = self.guard.healthy and self.state.consecutive_nan_iterations == 0
        self.engine.save_checkpoint(c.save, self.state.iteration, extras, self.state.to_dict(), self.config.to_dict())
        if self.state.healthy:
            self.last_healthy = str(ckpt.iteration_dir(c.save, self.state.iteration))
        if c.keep_last is not None:
            comm.barrier(self.parallel.host_group)  # every rank's files are written before one rank removes any
            if self.parallel.rank == 0:
                prune_checkpoints(c.save, c.keep_last, self.last_healthy)

    def _interval_save(self) -> bool:
        """A --save-interval checkpoint; one that cannot be written (the engine has removed its partial folder on
        every rank and kept the previous checkpoint as the newest) is logged and training goes on, until
        --exit-on-save-failure failures in a row. Whether it was saved."""
        try:
            self.save()
        except ckpt.CheckpointError as exc:
            self._save_failed(exc)
            return False
        self.save_failures = 0
        return True

    def _save_failed(self, exc: ckpt.CheckpointError) -> None:
        """Count a failed save; --exit-on-save-failure failures in a row end the run (the error raised)."""
        c = self.config.checkpoint
        self.save_failures += 1
        if self.save_failures >= c.exit_on_save_failure:
            raise exc
        interval = c.save_interval or 0  # a failed background write is found at a later iteration than its save's
        following = (self.state.iteration // interval + 1) * interval if interval else self.state.iteration
        logger.error("iteration %d: checkpoint not saved (%d failed in a row; --exit-on-save-failure %d ends the run): "
                     "%s. Training goes on; the next save is at iteration %d", self.state.iteration, self.save_failures,
                     c.exit_on_save_failure, str(exc).splitlines()[0], following)

    def _poll_checkpoint(self, wait: bool = False) -> None:
        """A checkpoint written in the background (--async-save) is committed once every rank has written it; then
        --keep-last-n-checkpoints prunes. A failed background write counts as a failed save."""
        try:
            committed = self.engine.poll_checkpoint(wait)
        except ckpt.CheckpointError as exc:
            self._save_failed(exc)
            return
        c = self.config.checkpoint
        if committed is not None and c.keep_last is not None and self.parallel.rank == 0:
            prune_checkpoints(c.save, c.keep_last, self.last_healthy)

    # ---------------------------------------------------------------------------------- one step
    def _forward_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with self.accel.autocast(self.config.training.bf16):
            per_token = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        masked = (per_token * batch.loss_mask).sum()
        return masked, batch.loss_mask.sum()

    def _batches(self, loader_iter: Iterator, count: int) -> list[Batch]:
        return [make_batch(next(loader_iter), self.eod, self.config.data) for _ in range(count)]

    def train_step(self, micro_batches: Iterator[torch.Tensor]) -> tuple[torch.Tensor | float, torch.Tensor | float,
                                                                          bool]:
        """One optimizer step. Returns (loss, grad norm, stepped); loss and norm may be 0-d device tensors
        (read them where a value is needed: `host_floats`)."""
        batches = self._batches(micro_batches, self.config.training.num_micro_batches)
        loss, grad_norm, stepped = self.engine.train_batch(self.state.iteration, batches, self._forward_loss)
        self.fp8.after_optimizer_step()
        self.accel.mark_step()
        return loss, grad_norm, stepped

    # ------------------------------------------------------------------------------- evaluation
    def evaluate(self, dataset, split: str = "valid") -> float:
        """Token-weighted mean loss over the first `--eval-iters` global batches of `dataset` (the same samples
        each time, so curves of different runs are comparable; at most one pass over the split unless --eval-iters
        was given: megatron/training/run_plan.py). A long one logs its progress."""
        t = self.config.training
        loader = build_loader(dataset, 0, t.micro_batch_size, self.parallel.data_parallel_rank,
                              self.parallel.data_parallel_size, self.config.data.num_workers)
        count = self.eval_iters.get(split, t.eval_iters) * t.num_micro_batches
        progress = run_plan.EvalProgress(run_plan.SPLIT_TITLES[split], count, self.parallel.is_logging_rank)
        return self.engine.evaluate(self._batches(iter(loader), count), self._forward_loss, progress)

    # ------------------------------------------------------------------------------ divergence
    def _read_pending(self, pending: list) -> list[float]:
        """The pending iterations' losses and grad norms in one host read, fed to the divergence guard; returns the
        losses (NaN for skipped steps)."""
        values = host_floats([v for _, loss, norm, _ in pending for v in (loss, norm)])
        losses = []
        for k, (iteration, _, _, stepped) in enumerate(pending):
            loss, norm = values[2 * k], values[2 * k + 1]
            if stepped:
                self.guard.observe(iteration, loss, norm)
            losses.append(loss if stepped else float("nan"))
        pending.clear()
        return losses

    def _check_weights(self) -> None:
        if self.config.divergence.enabled:
            largest = max_abs_weight(self.model.parameters(), comm.world_group())
            self.guard.observe_weights(self.state.iteration, float(largest))

    def _judge(self, pending: list, result: TrainResult) -> None:
        """Read the pending iterations into `result`, check the weights, and stop the run if it diverged."""
        result.losses.extend(self._read_pending(pending))
        self._check_weights()
        self._stop_if_diverged(result)

    def _stop_if_diverged(self, result: TrainResult) -> None:
        if self.guard.reason is None:
            return
        result.exit_reason = "diverged"
        healthy = self.last_healthy or "none: no checkpoint was loaded or saved by this run"
        raise TrainingDiverged(f"training diverged: {self.guard.reason}. Nothing was saved after it; the newest "
                               f"healthy checkpoint is {healthy}. (--no-divergence-guard turns the guard off.)")

    # ------------------------------------------------------------------------------------ loop
    def train(self) -> TrainResult:
        t = self.config.training
        result = TrainResult(state=self.state, model=self.model)
        loader = build_loader(self.train_ds, self.state.consumed_train_samples, t.micro_batch_size,
                              self.parallel.data_parallel_rank, self.parallel.data_parallel_size,
                              self.config.data.num_workers)
        micro_batches = iter(loader)
        sig = _SignalFlag(t.exit_signal_handler)
        start_time = time.time()
        saved_at = None
        # This log interval's (iteration, loss, grad norm, stepped), device tensors read at its log iteration.
        pending: list = []
        self.accel.synchronize()
        t_mark = time.perf_counter()
        watchdog = (StallWatchdog(t.exit_on_stall_seconds, self.parallel.rank)
                    if t.exit_on_stall_seconds is not None else None)
        try:
            self._check_weights()  # an absurd init (or a loaded exploded model) stops here
            self._stop_if_diverged(result)
            while self.state.iteration < t.train_iters:
                loss, grad_norm, stepped = self._step_and_count(micro_batches, pending, result)
                now = time.perf_counter()
                elapsed, t_mark = now - t_mark, now
                loss, grad_norm = self._account_skip(loss, grad_norm, stepped, result)
                self._log_iteration(loss, grad_norm, elapsed)
                validated = self._validate_if_due(result)
                save_due, saved = self._save_if_due(pending, result)
                self._poll_checkpoint()
                if saved:
                    saved_at = self.state.iteration
                if validated or save_due:
                    t_mark = time.perf_counter()  # not iteration time (evaluation and saving read the host)
                if watchdog is not None:
                    watchdog.finished(self.state.iteration)
                exit_reason = self._exit_reason(sig, start_time)
                if exit_reason:
                    result.exit_reason = exit_reason
                    break
            self._finish(pending, result, saved_at)
        finally:
            if watchdog is not None:
                watchdog.close()
            result.losses.extend(self._read_pending(pending) if pending else [])
            sig.restore()
            self.tlog.close()
        return result

    def _step_and_count(self, micro_batches: Iterator, pending: list, result: TrainResult) -> tuple:
        """One optimizer step, counted in the train state; at a log iteration the interval's values are read (one
        synchronisation per log interval: the per-iteration times of the interval sum to its wall time, which is all
        the log line reports, their mean) and judged by the divergence guard."""
        t = self.config.training
        self.swiglu.before_step(self.state.iteration + 1, self.config.logging.log_interval)
        loss, grad_norm, stepped = self.train_step(micro_batches)
        s = self.state
        s.iteration += 1
        s.consumed_train_samples += t.global_batch_size
        s.consumed_train_tokens += t.global_batch_size * self.config.model.seq_length
        pending.append((s.iteration, loss, grad_norm, stepped))
        if s.iteration % self.config.logging.log_interval == 0:
            self.accel.synchronize()
            self._judge(pending, result)
        return loss, grad_norm, stepped

    def _account_skip(self, loss, grad_norm, stepped: bool, result: TrainResult) -> tuple:
        """A skipped step is counted and warned about (its loss and norm read to the host for the warning); too many
        in a row end the run without a save. Returns the loss and norm to log."""
        s, t = self.state, self.config.training
        if stepped:
            s.consecutive_nan_iterations = 0
            return loss, grad_norm
        loss, grad_norm = host_floats([loss, grad_norm])
        s.skipped_iterations += 1
        s.nan_iterations += 1
        s.consecutive_nan_iterations += 1
        fp8_bad = self.fp8.nonfinite_layers()
        logger.warning("iteration %d: non-finite loss or grad norm (loss %s, grad norm %s): step skipped "
                       "(%d in a row)%s", s.iteration, loss, grad_norm, s.consecutive_nan_iterations,
                       f"; inf/NaN in FP8 tensors, first seen in: {', '.join(fp8_bad[:4])}"
                       f"{' ...' if len(fp8_bad) > 4 else ''}" if fp8_bad else "")
        if s.consecutive_nan_iterations >= t.max_consecutive_nan_steps:
            result.exit_reason = "diverged"
            raise TrainingDiverged(
                f"training diverged: {s.consecutive_nan_iterations} consecutive non-finite steps, the last "
                f"at iteration {s.iteration} (--max-consecutive-nan-steps {t.max_consecutive_nan_steps}). "
                f"No checkpoint was written for these steps; the newest healthy one is "
                f"{self.last_healthy or 'none (no checkpoint was loaded or saved by this run)'}.")
        return loss, grad_norm

    def _log_iteration(self, loss, grad_norm, elapsed: float) -> None:
        """The iteration's log line and TensorBoard scalars (a skipped step's loss as computed, as the warning)."""
        s, t, interval = self.state, self.config.training, self.config.logging.log_interval
        fp8_extra, fp8_text = self.fp8.log_values(s.iteration, interval)
        swiglu_extra, swiglu_text = self.swiglu.log_values(s.iteration, interval)
        self.tlog.record(iteration=s.iteration, loss=loss, elapsed_s=elapsed, lr=self.engine.learning_rate,
                         grad_norm=grad_norm, state=s, global_batch_size=t.global_batch_size,
                         seq_length=self.config.model.seq_length, flops_per_iter=self.flops_per_iter,
                         world_size=self.parallel.world_size, memory=self.accel.memory_stats(),
                         extra={**fp8_extra, **swiglu_extra}, extra_text=fp8_text + swiglu_text)

    def _validate_if_due(self, result: TrainResult) -> bool:
        """Validation at every --eval-interval; whether it ran."""
        s, t = self.state, self.config.training
        if self.valid_ds is None or not t.eval_interval or s.iteration % t.eval_interval:
            return False
        self._validate(result)
        return True

    def _validate(self, result: TrainResult) -> None:
        """One validation at this iteration: its loss kept in `result` and logged."""
        s = self.state
        vloss = self.evaluate(self.valid_ds)
        result.valid.append((s.iteration, vloss))
        self.tlog.validation("validation", vloss, s.iteration, s.consumed_train_tokens, s.consumed_train_samples)

    def _save_if_due(self, pending: list, result: TrainResult) -> tuple[bool, bool]:
        """The save of a --save-interval: (whether one was due, whether it was written). Never during a run of
        non-finite steps or while the divergence guard is worried: such a checkpoint must not replace the last
        healthy one."""
        s, c = self.state, self.config.checkpoint
        if not (c.save and c.save_interval and s.iteration % c.save_interval == 0):
            return False, False
        self._judge(pending, result)  # the guard judges up to this iteration
        if s.consecutive_nan_iterations or not self.guard.healthy:
            logger.warning("iteration %d: not saving during a run of non-finite steps or while the divergence guard "
                           "sees the loss far above its median or a zero gradient", s.iteration)
            return True, False
        return True, self._interval_save()

    def _finish(self, pending: list, result: TrainResult, saved_at: Optional[int]) -> None:
        """The end of training: the final checkpoint (marked unhealthy in train_state.json if the guard is still
        worried) unless this iteration's is written, and the test evaluation of a run that reached --train-iters."""
        if self.config.checkpoint.save and saved_at != self.state.iteration:
            self._judge(pending, result)
            self.save()
        self._poll_checkpoint(wait=True)  # a checkpoint still written in the background is committed before the end
        if result.exit_reason != "train-iters":
            return
        if self.valid_ds is not None and (not result.valid or result.valid[-1][0] != self.state.iteration):
            self._validate(result)  # at the end of training, where the last --eval-interval did not fall on it
        if self.test_ds is not None:
            result.test_loss = self.evaluate(self.test_ds, "test")
            self.tlog.validation("test", result.test_loss, self.state.iteration, self.state.consumed_train_tokens,
                                 self.state.consumed_train_samples)

    def _exit_reason(self, sig: _SignalFlag, start_time: float) -> Optional[str]:
        """Every rank takes the same decision: a SIGTERM or the time limit seen by one rank stops all of them."""
        t, it = self.config.training, self.state.iteration
        signal_seen = over_time = False
        if t.exit_signal_handler or t.exit_duration_in_mins is not None:  # else no rank can see either
            over = t.exit_duration_in_mins is not None and (time.time() - start_time) / 60.0 > t.exit_duration_in_mins
            signal_seen, over_time = _any_rank([sig.received, over], self.parallel)
        if signal_seen:
            return "signal"
        if t.exit_interval and it % t.exit_interval == 0:
            return "exit-interval"
        if over_time:
            return "exit-duration"
        return None


def pretrain(config: MegatronConfig, tokenizer=None) -> TrainResult:
    """Build the model, optimizer and data from `config` and train; see `Trainer`."""
    return Trainer(config, tokenizer).train()
