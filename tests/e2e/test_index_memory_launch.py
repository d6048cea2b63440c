"""Index memory at 2T-token scale, in child processes: the chunked build fits a hard address-space
limit proportional to 16 GB at 2T tokens (RLIMIT_AS in a child process of bench/bench_index_build.py; the former
whole-array build runs out there); and one rank per node builds the indices, the others load them
(two spawned gloo ranks)."""
import os

import numpy as np
import pytest

from tests.support.config import load_bench

BUDGET_PER_TOKEN = 16e9 / 2e12  # the bound: 16 GB at 2T tokens, i.e. 3.2 GB at 400B


def test_index_build_fits_16gb_at_2t_scaled_under_rlimit_as(tmp_path):
    """The same build as bench/bench_index_build.py's 400B one under 3.2 GB, at 20B tokens (18M documents) under
    baseline + 20B x 8 bytes per 1,000 tokens; the former whole-array build runs out there (the limit bites)."""
    bench = load_bench("bench_index_build")
    table = str(tmp_path / "sizes.npy")
    bench.synthetic_table(2e10, table)
    result = bench.run_child(table, 4096, "new", budget_per_token=BUDGET_PER_TOKEN, chunk=1 << 16, timeout=120)
    assert result["samples"] > 4_800_000 and result["peak_as"] <= result["limit"]
    with pytest.raises(RuntimeError, match="MemoryError|Cannot allocate memory"):
        bench.run_child(table, 4096, "old", budget_per_token=BUDGET_PER_TOKEN, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEGATRON_SLOW_TESTS") != "1", reason="~70 s; MEGATRON_SLOW_TESTS=1 runs it")
def test_400b_token_index_build_under_3_2_gb(tmp_path):
    bench = load_bench("bench_index_build")
    table = str(tmp_path / "sizes.npy")
    bench.synthetic_table(4e11, table)
    result = bench.run_child(table, 4096, "new", rlimit_as=3.2e9, timeout=600)
    assert result["documents"] == 360_000_000 and result["peak_as"] <= 3.2e9


# --------------------------------------------------------------------------- one builder per node, the others load

def _coordination_worker(rank: int, store: str, prefix: str, root: str) -> None:
    """One of two gloo ranks: four dataset builds in a row; writes how often each rank built and scanned."""
    import json
    import socket

    import torch.distributed as dist

    from megatron.arguments import parse_config
    from megatron.data import gpt_dataset, token_range
    from megatron.parallel_state import ParallelState
    from megatron.training.datasets import build_datasets
    from tests.support.config import tiny_argv

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    parallel = ParallelState(world_size=2, rank=rank, data_parallel_size=2, data_parallel_rank=rank,
                             host_group=dist.group.WORLD)
    counts = {"index": 0, "scan": 0}
    real_write, real_scan, real_host = gpt_dataset.write_gpt_indices, token_range.scan_token_range, socket.gethostname

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    gpt_dataset.write_gpt_indices = counted("index", real_write)
    token_range.scan_token_range = counted("scan", real_scan)
    # (cache folder, --data-cache-shared, two nodes); two nodes without a shared cache have node-local folders.
    steps = [(f"a{rank}", False, True), (f"a{rank}", False, True), ("b", True, True), ("c", False, False)]
    events = []
    for cache, shared, two_nodes in steps:
        socket.gethostname = (lambda: f"node{rank}") if two_nodes else real_host
        argv = tiny_argv(vocab_size=1000, split="90,10,0") + ["--data-path", prefix, "--tokenizer-type",
                                                                "NullTokenizer", "--data-cache-path", f"{root}/{cache}"]
        argv.remove("--mock-data")
        before = dict(counts)
        build_datasets(parse_config(argv + (["--data-cache-shared"] if shared else [])), None, parallel)
        events.append({k: counts[k] - before[k] for k in counts})
    # The builder fails (rank 0 on this one node): both ranks fail, rank 1 naming who to look at.
    gpt_dataset.write_gpt_indices = lambda *args: (_ for _ in ()).throw(RuntimeError("disk on fire"))
    argv = tiny_argv(vocab_size=1000, split="90,10,0") + ["--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                                                            "--data-cache-path", f"{root}/d"]
    argv.remove("--mock-data")
    try:
        build_datasets(parse_config(argv), None, parallel)
        events.append("built")
    except Exception as err:  # noqa: BLE001  (the test records what each rank saw)
        events.append(f"{type(err).__name__}: {err}")
    with open(f"{root}/rank{rank}.json", "w") as f:
        json.dump(events, f)
    dist.destroy_process_group()


def test_one_rank_per_node_builds_and_a_second_run_never_rebuilds(tmp_path):
    import json
    import multiprocessing

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    with MMapIndexedDatasetBuilder(prefix, np.uint16) as builder:
        for d in range(200):
            builder.add_document(np.arange(d % 50, d % 50 + 30))
        builder.finalize()
    os.remove(prefix + ".manifest.json")  # a pair from another tool: its token range is scanned (once per node)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_coordination_worker, args=(r, str(tmp_path / "store"), prefix, str(tmp_path)))
             for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    rank0, rank1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    # Two nodes (one rank each): both build and scan; the same run again builds nothing anywhere.
    assert rank0[0]["index"] >= 2 and rank0[0]["scan"] == 1 and rank1[0] == rank0[0]
    assert rank0[1] == rank1[1] == {"index": 0, "scan": 0}
    # --data-cache-shared: rank 0 alone builds and scans; rank 1 loads what it wrote.
    assert rank0[2] == rank0[0] and rank1[2] == {"index": 0, "scan": 0}
    # Both ranks on one node (the default, per node): the node's first rank builds for both.
    assert rank0[3] == rank0[0] and rank1[3] == {"index": 0, "scan": 0}
    assert rank0[4] == "RuntimeError: disk on fire"
    assert rank1[4].startswith("DataError: building the data indices failed on one rank per node: ranks [0]")
