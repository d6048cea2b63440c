"""Index memory at 2T-token scale (issue 15.4): the chunked, narrow-dtype construction gives the values of the
former whole-array one, picks dtypes from what each array indexes, and builds under a hard address-space
limit proportional to 16 GB at 2T tokens (RLIMIT_AS in a child process; the former build runs out there)."""
import importlib.util
import os

import numpy as np
import pytest

from megatron.data import blended_dataset, gpt_index
from megatron.data.gpt_index import build_gpt_indices, document_dtype, index_dtype, sample_dtype
from tests.support import index_reference as reference
from tests.support.config import REPO

BUDGET_PER_TOKEN = 16e9 / 2e12  # the bound: 16 GB at 2T tokens, i.e. 3.2 GB at 400B


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_index_build", os.path.join(REPO, "bench", "bench_index_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_cases(count: int, seed: int = 0):
    """(sizes, (start, end), seq_length, num_samples, seed): empty documents, one to thousands of epochs."""
    rng = np.random.default_rng(seed)
    while count:
        tiny = rng.random() < 0.2  # a few tokens per epoch: thousands of epochs
        n = int(rng.integers(1, 4 if tiny else 80))
        sizes = rng.integers(0, 6 if tiny else 50, size=n + 6).astype(np.int32)
        sizes[rng.integers(0, n + 6, 4)] = 0
        start = int(rng.integers(0, n))
        end = int(rng.integers(start + 1, n + 7))
        if not sizes[start:end].any():
            continue
        count -= 1
        yield (sizes, (start, end), int(rng.integers(1, 40)), int(rng.integers(0, 3000 if tiny else 600)),
               int(rng.integers(0, 10**6)))


@pytest.mark.parametrize("chunk", [3, 64, gpt_index.CHUNK])  # many chunks per epoch / per array / one chunk
def test_chunked_build_equals_the_whole_array_build(monkeypatch, chunk):
    monkeypatch.setattr(gpt_index, "CHUNK", chunk)
    epochs_seen = set()
    for sizes, (start, end), seq, samples, seed in random_cases(40 if chunk < 10 else 100, seed=chunk):
        old = reference.build_gpt_indices(sizes, np.arange(start, end), seq, samples, seed)
        for documents in ((start, end), np.arange(start, end)):
            new = build_gpt_indices(sizes, documents, seq, samples, seed)
            for name in ("doc_idx", "sample_idx", "shuffle_idx"):
                assert np.array_equal(new[name], old[name]), (name, sizes, start, end, seq, samples, seed)
        epochs = len(old["doc_idx"]) // (end - start)
        epochs_seen.add("one" if epochs == 1 else "few" if epochs <= gpt_index.MANY_EPOCHS else "many")
    assert epochs_seen == {"one", "few", "many"}  # "many": more than MANY_EPOCHS, the sorted-keys shuffle


@pytest.mark.parametrize("chunk", [5, 1000])
def test_blending_equals_the_whole_array_build(monkeypatch, chunk):
    monkeypatch.setattr(blended_dataset, "CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for _ in range(60):
        weights = rng.random(int(rng.integers(1, 9))) * (rng.random() < 0.5 and 4 or 1)
        weights[rng.random(len(weights)) < 0.2] = 0
        weights = np.round(weights, int(rng.integers(0, 3)))  # equal weights: ties between datasets
        if weights.sum() == 0:
            continue
        size = int(rng.integers(0, 3000))
        old = reference.build_blending_indices(weights, size)
        new = blended_dataset.build_blending_indices(weights, size)
        assert np.array_equal(new[0], old[0]) and np.array_equal(new[1], old[1])


def test_dtypes_follow_what_they_index():
    assert index_dtype(2**31 - 1) == np.int32 and index_dtype(2**31) == np.int64
    # 1.8B documents fit int32 ids; two epochs of them (3.6B doc_idx positions) do not fit int32 positions.
    assert document_dtype((0, 1_800_000_000)) == np.int32
    assert sample_dtype(np.zeros(1, np.int32), 2 * 1_800_000_000) == np.int64
    assert sample_dtype(np.zeros(1, np.int32), 1_800_000_000) == np.int32
    assert document_dtype((0, 2**31 + 1)) == np.int64
    small = build_gpt_indices(np.full(100, 10, np.int32), (0, 100), 16, 500, 1)
    assert {name: a.dtype for name, a in small.items()} == {name: np.dtype(np.int32) for name in small}


def test_index_build_fits_16gb_at_2t_scaled_under_rlimit_as(tmp_path):
    """The same build as bench/bench_index_build.py's 400B one under 3.2 GB, at 20B tokens (18M documents) under
    baseline + 20B x 8 bytes per 1,000 tokens; the former whole-array build runs out there (the limit bites)."""
    bench = load_bench()
    table = str(tmp_path / "sizes.npy")
    bench.synthetic_table(2e10, table)
    result = bench.run_child(table, 4096, "new", budget_per_token=BUDGET_PER_TOKEN, chunk=1 << 16, timeout=120)
    assert result["samples"] > 4_800_000 and result["peak_as"] <= result["limit"]
    with pytest.raises(RuntimeError, match="MemoryError|Cannot allocate memory"):
        bench.run_child(table, 4096, "old", budget_per_token=BUDGET_PER_TOKEN, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEGATRON_SLOW_TESTS") != "1", reason="~70 s; MEGATRON_SLOW_TESTS=1 runs it")
def test_400b_token_index_build_under_3_2_gb(tmp_path):
    bench = load_bench()
    table = str(tmp_path / "sizes.npy")
    bench.synthetic_table(4e11, table)
    result = bench.run_child(table, 4096, "new", rlimit_as=3.2e9, timeout=600)
    assert result["documents"] == 360_000_000 and result["peak_as"] <= 3.2e9


# --------------------------------------------------------------- one builder per node, the others load (issue 15.5)

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
