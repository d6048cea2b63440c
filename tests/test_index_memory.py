"""Index memory at 2T-token scale (issue 15.4): the chunked, narrow-dtype construction gives the values of the
former whole-array one, picks dtypes from what each array indexes, and builds under a hard address-space
limit proportional to 16 GB at 2T tokens (RLIMIT_AS in a child process; the former build runs out there)."""
import importlib.util
import os

import numpy as np
import pytest

import index_reference as reference
from conftest import REPO
from megatron.data import blended_dataset, gpt_index
from megatron.data.gpt_index import build_gpt_indices, document_dtype, index_dtype, sample_dtype

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
