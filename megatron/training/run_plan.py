"""What a run is, said at start-up: its layout, the size of each split, and how many batches each evaluation reads.

A validation or test evaluation reads the first `--eval-iters` global batches of its split. On a small split that
can be the split many times over (100 x 32 samples over a split of two documents), which costs minutes and adds
nothing: without an explicit `--eval-iters`, each evaluation reads at most one pass over its split; with one, the
run warns. Long evaluations report their progress every `PROGRESS_SECONDS`.
"""
from __future__ import annotations

import logging
import time

from megatron.config import MegatronConfig
from megatron.data.split_size import SplitSize, split_size

logger = logging.getLogger(__name__)

PROGRESS_SECONDS = 10.0
SPLIT_TITLES = {"train": "training", "valid": "validation", "test": "test"}


def layout_line(config: MegatronConfig, parallel) -> str:
    """'layout: world 8 = DP 4 x TP 2 x PP 1, engine DeepSpeed ZeRO-1'."""
    p = config.parallel
    if p.pipeline_model_parallel_size > 1:
        engine = "DeepSpeed pipeline"
    elif p.deepspeed:
        engine = f"DeepSpeed ZeRO-{p.zero_stage or 0}"
    elif p.use_torch_fsdp2:
        engine = "torch FSDP2"
    else:
        engine = "torch DDP" if parallel.data_parallel_size > 1 else "torch (one data-parallel replica)"
    return (f"layout: world {parallel.world_size} = DP {parallel.data_parallel_size} x "
            f"TP {parallel.tensor_parallel_size} x PP {parallel.pipeline_parallel_size}, engine {engine}")


def _size_text(size: SplitSize, seq_length: int) -> str:
    if size.one_pass is None:
        return "mock data"
    return (f"{_count(size.documents, 'document')}, {_count(size.tokens, 'token')} = "
            f"{_count(size.one_pass, 'sample')} of {seq_length} tokens per pass")


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _iterations(n: int) -> str:
    return _count(n, "iteration")


def _reads_text(samples: int, size: SplitSize) -> str:
    passes = size.passes(samples)
    return _count(samples, "sample") + ("" if passes is None else f" ({passes:.2f} passes)")


def eval_iterations(name: str, size: SplitSize, config: MegatronConfig, warn: bool = True) -> int:
    """The global batches each evaluation of split `name` reads: --eval-iters, capped to one pass over the split
    unless it was given; warned about (where `warn`: the logging rank) where it repeats the split."""
    t = config.training
    log = logger.warning if warn else logger.debug  # every rank decides alike; one says so
    gbs, asked = t.global_batch_size, t.eval_iters
    title = SPLIT_TITLES[name]
    if size.one_pass is None or asked * gbs <= size.one_pass:
        return asked
    full = size.one_pass // gbs
    times = f"{size.passes(asked * gbs):.1f} times over" if size.one_pass else "many times over"
    if not t.eval_iters_capped:
        log("--eval-iters %d reads the %s split %s (%s per pass, %d global batches of %d): its loss repeats "
            "samples%s", asked, title, times, _count(size.one_pass, "sample"), asked, gbs,
            f"; --eval-iters {full} reads at most one pass" if full else "")
        return asked
    if full == 0:
        log("the %s split holds %s per pass, fewer than one global batch (%d): each %s evaluation reads 1 "
            "iteration, repeating samples; give the split more data (--split)", title, _count(size.one_pass, "sample"),
            gbs, title)
        return 1
    log("--eval-iters %d (the default) would read the %s split %s: each %s evaluation reads %s, at most one pass; "
        "pass --eval-iters to choose", asked, title, times, title, _iterations(full))
    return full


def report(config: MegatronConfig, parallel, datasets: dict) -> dict[str, int]:
    """Log the layout and one line per split; return the global batches each evaluation reads, per split."""
    t, seq = config.training, config.model.seq_length
    logger.info(layout_line(config, parallel))
    iterations = {}
    for name, ds in datasets.items():
        if ds is None:
            continue
        size = split_size(ds, seq, scan=0 if name == "train" else t.eval_iters * t.global_batch_size)
        if name == "train":
            reads = f"{_iterations(t.train_iters)} read {_reads_text(t.train_iters * t.global_batch_size, size)}"
        else:
            iterations[name] = eval_iterations(name, size, config, warn=parallel.is_logging_rank)
            reads = (f"each evaluation reads {_iterations(iterations[name])} = "
                     f"{_reads_text(iterations[name] * t.global_batch_size, size)}")
        logger.info("%s split: %s; %s", SPLIT_TITLES[name], _size_text(size, seq), reads)
    return iterations


class EvalProgress:
    """Called after each evaluated batch: logs batches done / total and the time left every PROGRESS_SECONDS.

    The time is the host's: on an accelerator it runs ahead by the queued kernels, which bounds how early it is."""

    def __init__(self, title: str, total: int, enabled: bool, every: float = PROGRESS_SECONDS) -> None:
        self.title, self.total, self.enabled, self.every = title, total, enabled, every
        self.began = self.last = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < self.every or done >= self.total:
            return
        self.last = now
        spent = now - self.began
        logger.info("%s evaluation: %d/%d batches, %.0f s, about %.0f s left", self.title, done, self.total, spent,
                    spent * (self.total - done) / max(done, 1))
