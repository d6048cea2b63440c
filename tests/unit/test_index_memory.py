"""Index memory at 2T-token scale: the chunked, narrow-dtype construction gives the values of the
former whole-array one (tests/support/index_reference.py) and picks dtypes from what each array indexes. The
builds under a hard address-space limit run in child processes (tests/e2e/test_index_memory_launch.py)."""
import numpy as np
import pytest

from megatron.data import blended_dataset, gpt_index
from megatron.data.gpt_index import build_gpt_indices, document_dtype, index_dtype, sample_dtype
from tests.support import index_reference as reference


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
