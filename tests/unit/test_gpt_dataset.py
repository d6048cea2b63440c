"""GPT samples and their indices: samples rebuild the token stream, epochs repeat and reshuffle,
indices are deterministic and cached, splits and blends follow Megatron's flags and weights."""
import os

import numpy as np
import pytest

from megatron.config import DataConfig
from megatron.data.blended_dataset import BlendedDataset, build_blending_indices
from megatron.data.gpt_dataset import (
    GPTDataset,
    build_gpt_indices,
    build_sample_index,
    build_shuffle_index,
    build_train_valid_test_datasets,
    parse_split,
)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.tokenizer import NullTokenizer

SEQ = 16


def make_dataset(prefix, num_docs: int = 120, seed: int = 0, base: int = 0) -> MMapIndexedDataset:
    """Documents of 0..40 tokens whose ids (base + running counter) identify every position."""
    rng = np.random.default_rng(seed)
    with MMapIndexedDatasetBuilder(str(prefix), np.int32) as builder:
        counter = base
        for _ in range(num_docs):
            n = int(rng.integers(0, 41))
            builder.add_document(np.arange(counter, counter + n))
            counter += n
        builder.finalize()
    return MMapIndexedDataset(str(prefix))


def megatron_sample_index_loop(sizes, doc_idx, seq_length, num_samples):
    """Megatron-LM's C++ `build_sample_idx`, transcribed as a reference."""
    out = [(0, 0)]
    index, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[index]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                index, offset = index + 1, 0
        out.append((index, offset))
    return np.array(out)


def test_sample_index_matches_megatron_loop():
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 30, size=200).astype(np.int32)
    sizes[[0, 5, 6]] = 0
    doc_idx = rng.permutation(200).astype(np.int32)
    n = (int(sizes.sum()) - 1) // 7
    assert np.array_equal(build_sample_index(sizes, doc_idx, 7, n), megatron_sample_index_loop(sizes, doc_idx, 7, n))


def test_samples_rebuild_the_token_stream_across_epochs(tmp_path):
    ds = make_dataset(tmp_path / "ds")
    gpt = GPTDataset("train", ds, (10, 100), SEQ, seed=3, num_samples=500, cache_dir=str(tmp_path / "cache"))
    assert len(gpt) >= 500
    tokens_per_epoch = int(ds.sizes[10:100].sum())
    epochs = len(gpt.doc_idx) // 90
    assert epochs > 1 and len(gpt) == (epochs * tokens_per_epoch - 1) // SEQ
    # Every epoch holds each document of the split exactly once, in its own order.
    per_epoch = np.asarray(gpt.doc_idx).reshape(epochs, 90)
    assert all(sorted(row) == list(range(10, 100)) for row in per_epoch)
    assert not np.array_equal(per_epoch[0], per_epoch[1])
    stream = np.concatenate([ds[int(d)] for d in gpt.doc_idx])
    unshuffled = np.argsort(gpt.shuffle_idx)
    for k in range(len(gpt)):
        sample = gpt[int(unshuffled[k])]["text"]
        assert sample.dtype == np.int64 and np.array_equal(sample, stream[k * SEQ:k * SEQ + SEQ + 1])
    # The shuffle never mixes epochs: the first epoch's samples come first.
    first_epoch = tokens_per_epoch // SEQ
    assert np.all(np.asarray(gpt.shuffle_idx[:first_epoch]) < first_epoch + 1)


@pytest.mark.parametrize("tokens_per_epoch", [1000, 37])  # few long epochs / thousands of tiny ones
def test_shuffle_stays_within_epochs(tokens_per_epoch):
    n = 5000
    shuffle = build_shuffle_index(n, SEQ, tokens_per_epoch, np.random.default_rng(0))
    assert sorted(shuffle) == list(range(n)) and not np.array_equal(shuffle, np.arange(n))
    epoch = np.arange(n) * SEQ // tokens_per_epoch
    assert np.array_equal(epoch[shuffle], epoch)


def test_indices_are_deterministic_and_cached(tmp_path, monkeypatch):
    ds = make_dataset(tmp_path / "ds")
    a = build_gpt_indices(ds.sizes, np.arange(120), SEQ, 300, seed=5)
    b = build_gpt_indices(ds.sizes, np.arange(120), SEQ, 300, seed=5)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = build_gpt_indices(ds.sizes, np.arange(120), SEQ, 300, seed=6)
    assert not np.array_equal(a["shuffle_idx"], c["shuffle_idx"])

    cache = tmp_path / "cache"
    first = GPTDataset("train", ds, (0, 120), SEQ, 5, 300, str(cache))
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(".tmp" in f for f in files)
    assert np.array_equal(first.shuffle_idx, a["shuffle_idx"])
    def no_rebuild(*args):
        raise RuntimeError("indices rebuilt")

    monkeypatch.setattr("megatron.data.gpt_dataset.write_gpt_indices", no_rebuild)
    again = GPTDataset("train", ds, (0, 120), SEQ, 5, 300, str(cache))
    assert isinstance(again.sample_idx, np.memmap)
    assert [again[i]["text"].tolist() for i in range(20)] == [first[i]["text"].tolist() for i in range(20)]
    with pytest.raises(RuntimeError, match="indices rebuilt"):  # another seed is another cache entry
        GPTDataset("train", ds, (0, 120), SEQ, 6, 300, str(cache))


def test_default_cache_lives_next_to_the_data(tmp_path):
    ds = make_dataset(tmp_path / "ds")
    GPTDataset("valid", ds, (0, 120), SEQ, 1, 10)
    assert any(f.startswith("ds-valid-") for f in os.listdir(tmp_path / "index-cache"))


def test_parse_split():
    assert parse_split("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert parse_split("8,1,1", 10) == [(0, 8), (8, 9), (9, 10)]
    assert parse_split("100,0,0", 7) == [(0, 7), (7, 7), (7, 7)]
    assert parse_split("1", 5) == [(0, 5), (5, 5), (5, 5)]
    with pytest.raises(ValueError, match="--split"):
        parse_split("a,b", 10)


def test_split_datasets_from_data_path(tmp_path):
    make_dataset(tmp_path / "ds")
    cfg = DataConfig(data_path=(str(tmp_path / "ds"),), split="80,20,0")
    train, valid, test = build_train_valid_test_datasets(cfg, NullTokenizer(10**6), SEQ, 1, (200, 30, 5))
    assert len(train) >= 200 and len(valid) >= 30 and test is None
    assert set(np.asarray(train.doc_idx)) <= set(range(96)) and set(np.asarray(valid.doc_idx)) <= set(range(96, 120))


def test_blending_indices_follow_the_weights():
    index, sample = build_blending_indices([0.3, 0.2, 0.5], 10_000)
    counts = np.bincount(index, minlength=3)
    assert np.all(np.abs(counts - np.array([3000, 2000, 5000])) <= 10)  # within 1% of 1000+
    for n in (7, 100, 1234, 9999):  # every prefix of the run, not only the whole
        assert np.all(np.abs(np.bincount(index[:n], minlength=3) - n * np.array([0.3, 0.2, 0.5])) <= 2)
    for k in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert np.array_equal(sample[index == k], np.arange(counts[k]))


def test_blended_data_path(tmp_path):
    make_dataset(tmp_path / "a", seed=1, base=0)
    make_dataset(tmp_path / "b", seed=2, base=10**6)
    cfg = DataConfig(data_path=("0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")), split="90,10,0")
    train, valid, test = build_train_valid_test_datasets(cfg, None, SEQ, 1, (10_000, 100, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 10_000 and test is None
    from_b = sum(int(train[i]["text"][-1] >= 10**6) for i in range(len(train)))  # ids tell the source
    assert abs(from_b / 10_000 - 0.7) < 0.01
    again, _, _ = build_train_valid_test_datasets(cfg, None, SEQ, 1, (10_000, 100, 0))
    assert all(np.array_equal(train[i]["text"], again[i]["text"]) for i in range(0, 10_000, 97))


def test_per_split_paths(tmp_path):
    make_dataset(tmp_path / "a", seed=1)
    make_dataset(tmp_path / "b", seed=2, num_docs=30)
    cfg = DataConfig(train_data_path=(str(tmp_path / "a"),), valid_data_path=(str(tmp_path / "b"),))
    train, valid, test = build_train_valid_test_datasets(cfg, None, SEQ, 1, (50, 20, 10))
    assert len(train) >= 50 and len(valid) >= 20 and test is None
    assert sorted(set(np.asarray(valid.doc_idx))) == list(range(30))


def test_bad_data_flags(tmp_path):
    make_dataset(tmp_path / "a")
    with pytest.raises(ValueError, match="--data-path"):
        build_train_valid_test_datasets(DataConfig(), None, SEQ, 1, (1, 1, 1))
    with pytest.raises(ValueError, match="exclusive"):
        build_train_valid_test_datasets(DataConfig(data_path=("x",), train_data_path=("y",)), None, SEQ, 1, (1, 1, 1))
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        build_train_valid_test_datasets(DataConfig(data_path=("0.5", str(tmp_path / "a"), "0.5")), None, SEQ, 1,
                                        (1, 1, 1))
    with pytest.raises(FileNotFoundError, match="preprocess_data.py"):
        build_train_valid_test_datasets(DataConfig(data_path=(str(tmp_path / "missing"),)), None, SEQ, 1, (1, 1, 1))
    with pytest.raises(ValueError, match=r"a.bin: document 119 holds token id 2437, but the tokenizer .* has 100 ids"):
        build_train_valid_test_datasets(DataConfig(data_path=(str(tmp_path / "a"),)), NullTokenizer(99), SEQ, 1,
                                        (1, 1, 1))
