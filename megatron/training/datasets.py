"""Choose and build the train/valid/test datasets of a run (mock data or indexed `.bin/.idx` data).

Indexed data is built by one rank per node first (with `--data-cache-shared`, by global rank 0 alone), while
the other ranks wait; then they build too, which loads what the first one cached: the sample, shuffle and
blending indices, and the token-id range of files without a manifest (a chunked scan of every token). So each
node reads its data once and holds one index build's memory at a time, not one per GPU.

Why per node by default: the index cache sits next to the data or under `--data-cache-path`, and only a
filesystem shared by all nodes lets one rank build for everyone; on node-local disks every node must build its
own copy. On a shared filesystem the per-node default is still correct (the builders of the nodes write the same
files, each atomically under its own temporary name), just N times the work: `--data-cache-shared` says the
folder is shared and leaves the work to rank 0.

Waiting is a loop of short collectives over the gloo host group (`ParallelState.host_group`, CPU tensors, through
`megatron.comm`), one every `POLL_SECONDS`, rather than one barrier: a first build or scan at 2T tokens takes
minutes to an hour, longer than a collective's timeout. The builders build in a thread meanwhile. A build that
fails on a builder fails every rank (the builder raises its error, the others name the rank to look at).
"""
from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from typing import Callable, Optional, TypeVar

from megatron.config import MegatronConfig
from megatron.data.mock import MockGPTDataset

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0
T = TypeVar("T")


def build_datasets(config: MegatronConfig, tokenizer=None, parallel=None) -> tuple:
    """(train, valid, test, eod) sized for `--train-iters` and `--eval-iters` global batches.

    Validation and test always use the first `eval_iters` global batches of their split, so every
    evaluation of a run (and of a run it is compared with) sees the same samples. `parallel` (a
    `ParallelState`) makes one rank per node build the indices first; without it every process builds.
    """
    t, d, m = config.training, config.data, config.model
    n_train = t.train_iters * t.global_batch_size
    n_eval = t.eval_iters * t.global_batch_size
    if d.mock_data:
        vocab = d.vocab_size
        return (MockGPTDataset(vocab, m.seq_length, n_train, t.seed),
                MockGPTDataset(vocab, m.seq_length, n_eval, t.seed, split=1) if n_eval else None,
                MockGPTDataset(vocab, m.seq_length, n_eval, t.seed, split=2) if n_eval else None,
                None)
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    from megatron.tokenizer import build_tokenizer

    if tokenizer is None:
        tokenizer = build_tokenizer(d)
    train, valid, test = build_first_on_builders(
        lambda: build_train_valid_test_datasets(d, tokenizer, m.seq_length, t.seed, (n_train, n_eval, n_eval)),
        parallel, d.data_cache_shared)
    if train is None:
        raise ValueError("no training data: pass --data-path or --train-data-path (or --mock-data for a synthetic run)")
    return train, _none_if_empty(valid, n_eval), _none_if_empty(test, n_eval), tokenizer.eod


def _none_if_empty(ds: Optional[object], wanted: int) -> Optional[object]:
    return ds if (ds is not None and wanted > 0 and len(ds) > 0) else None


def index_builders(parallel, shared: bool) -> list[int]:
    """The ranks that build first: global rank 0 (`shared`), or the lowest rank on each host."""
    if shared:
        return [0]
    import torch

    from megatron import comm

    digest = hashlib.sha1(socket.gethostname().encode()).digest()
    host = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)  # < 2^56: fits int64
    hosts = [int(h.item()) for h in comm.all_gather(host, parallel.host_group)]
    return sorted({hosts.index(h) for h in hosts})


def build_first_on_builders(build: Callable[[], T], parallel, shared: bool) -> T:
    """`build()` on the builder ranks while the others wait, then on the others (which load the cache)."""
    from megatron import comm

    if parallel is None or parallel.host_group is None or not comm.is_active(parallel.host_group):
        return build()
    import torch

    builders = index_builders(parallel, shared)
    here = parallel.rank in builders
    scope = "rank 0 (--data-cache-shared)" if shared else f"one rank per node: ranks {builders}"
    result: dict[str, object] = {}
    worker = None
    if here:
        logger.info("building the data indices on this rank first (%s); the other ranks wait", scope)

        def run() -> None:
            try:
                result["value"] = build()
            except BaseException as err:  # handed to the main thread, which raises it after telling the others
                result["error"] = err

        worker = threading.Thread(target=run, name="data-index-build", daemon=True)
        worker.start()
    else:
        logger.info("waiting for the data indices built by %s", scope)
    began, rounds = time.monotonic(), 0
    while True:  # one short collective per round; rounds grow from 50 ms to POLL_SECONDS apart
        delay = min(POLL_SECONDS, 0.05 * 2 ** rounds) if rounds else 0.0
        rounds += 1
        if worker is not None:
            worker.join(timeout=delay)
        else:
            time.sleep(delay)
        pending = worker is not None and worker.is_alive()
        state = torch.tensor([float(pending), float("error" in result)], dtype=torch.float32)
        comm.all_reduce(state, parallel.host_group, comm.ReduceOp.SUM)
        if state[0] == 0:
            break
    if "error" in result:
        raise result["error"]
    if state[1] > 0:
        from megatron.data.errors import DataError

        raise DataError(f"building the data indices failed on {scope}: see the error that rank printed")
    if here:
        return result["value"]
    logger.info("the data indices are built (%.0f s); loading them", time.monotonic() - began)
    return build()
