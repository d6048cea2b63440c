"""Blends of hundreds of prefixes from files: `--data-args-path` and `--per-split-data-args-path` give
what the flags would, and a malformed file is named with its line."""
import json

import numpy as np
import pytest

from megatron.arguments import parse_config
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.tokenizer import NullTokenizer
from tests.support.config import tiny_argv

SEQ = 16


def make_prefixes(folder, count: int) -> list[str]:
    """`count` small pairs whose token ids name their prefix (k * 1000 + position)."""
    prefixes = []
    for k in range(count):
        prefix = str(folder / f"shard_{k:04d}")
        with MMapIndexedDatasetBuilder(prefix, np.int32) as builder:
            for d in range(3):
                builder.add_document(np.arange(k * 1000 + 20 * d, k * 1000 + 20 * d + 20))
            builder.finalize()
        prefixes.append(prefix)
    return prefixes


def config(*flags: str):
    argv = tiny_argv(vocab_size=400_000) + ["--tokenizer-type", "NullTokenizer", "--split", "100,0,0", *flags]
    argv.remove("--mock-data")
    return parse_config(argv).data


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_prefixes(tmp_path_factory.mktemp("blend"), 200)


def test_data_args_file_equals_the_flags(shards, tmp_path):
    weights = [f"{0.5 + (k % 7) / 10:.1f}" for k in range(len(shards))]
    pairs = [x for w, p in zip(weights, shards) for x in (w, p)]
    # One pair a line, a comment, blank lines: whitespace of any kind separates items.
    (tmp_path / "blend.txt").write_text("# 200 shards\n" + "\n".join(f"{w} {p}" for w, p in zip(weights, shards))
                                        + "\n\n")
    from_file, from_flags = config("--data-args-path", str(tmp_path / "blend.txt")), config("--data-path", *pairs)
    assert from_file.data_path == from_flags.data_path == tuple(pairs)
    a, _, _ = build_train_valid_test_datasets(from_file, NullTokenizer(399_999), SEQ, 1, (2000, 0, 0))
    b, _, _ = build_train_valid_test_datasets(from_flags, NullTokenizer(399_999), SEQ, 1, (2000, 0, 0))
    assert len(a) == len(b) == 2000
    assert all(np.array_equal(a[i]["text"], b[i]["text"]) for i in range(0, 2000, 37))
    drawn = np.bincount(np.asarray(a.dataset_index), minlength=len(shards))
    expected = 2000 * np.array([float(w) for w in weights]) / sum(float(w) for w in weights)
    assert np.all(np.abs(drawn - expected) <= 2)  # every prefix on its weight


def test_per_split_file(shards, tmp_path):
    spec = {"train": shards[:150], "valid": " ".join(shards[150:160])}  # a list, or one string; test left out
    (tmp_path / "splits.json").write_text(json.dumps(spec, indent=1))
    cfg = config("--per-split-data-args-path", str(tmp_path / "splits.json"))
    assert cfg.train_data_path == tuple(shards[:150]) and cfg.valid_data_path == tuple(shards[150:160])
    assert cfg.data_path == () and cfg.test_data_path == ()
    train, valid, test = build_train_valid_test_datasets(cfg, NullTokenizer(399_999), SEQ, 1, (100, 10, 0))
    assert len(train) >= 100 and len(valid) >= 10 and test is None
    assert all(int(valid[i]["text"][0]) // 1000 in range(150, 160) for i in range(10))


@pytest.mark.parametrize("text, message", [
    ("0.5 {a}\n0.5\n", r"blend.txt:2: '0.5' has no partner"),
    ("0.5 {a}\n{b} 0.5\n", r"blend.txt:2: '.*shard_0001' stands where a weight belongs"),
    ("0.5 {a}\n0.5 0.25\n", r"blend.txt:2: '0.25' stands where a prefix belongs"),
    ("{a}\n{b}\n0.5\n", r"blend.txt:3: '0.5' looks like a weight"),
    ("-1 {a}\n", r"blend.txt:1: negative weight -1"),
    ("0.5 {a}\n# ok so far\n0.5 {a}_typo\n", r"blend.txt:3: .*shard_0000_typo.bin not found"),
    ("# nothing\n", r"holds no data prefixes"),
])
def test_malformed_data_args_file_is_named_with_its_line(shards, tmp_path, text, message):
    (tmp_path / "blend.txt").write_text(text.format(a=shards[0], b=shards[1]))
    with pytest.raises(ValueError, match=message):
        config("--data-args-path", str(tmp_path / "blend.txt"))


@pytest.mark.parametrize("text, message", [
    ('{"train": ["{a}",\n  "{b}"\n  "{a}"]}', r"splits.json:3: bad JSON \(Expecting ',' delimiter at column 3\)"),
    ('{"train": ["{a}"],\n "validation": ["{a}"]}', r"splits.json:2: unknown key 'validation'"),
    ('{"train": {"x": 1}}', r"splits.json:1: 'train' must be a list"),
    ('{"train": ["{a}",\n "{a}_typo"]}', r"splits.json:2: .*shard_0000_typo.bin not found"),
    ('["{a}"]', r"takes a JSON object"),
])
def test_malformed_per_split_file_is_named_with_its_line(shards, tmp_path, text, message):
    (tmp_path / "splits.json").write_text(text.replace("{a}", shards[0]).replace("{b}", shards[1]))
    with pytest.raises(ValueError, match=message):
        config("--per-split-data-args-path", str(tmp_path / "splits.json"))


def test_file_forms_exclude_the_flags_they_replace(shards, tmp_path):
    (tmp_path / "blend.txt").write_text(shards[0])
    (tmp_path / "splits.json").write_text(json.dumps({"train": [shards[0]]}))
    with pytest.raises(ValueError, match="--data-args-path replaces --data-path"):
        config("--data-args-path", str(tmp_path / "blend.txt"), "--data-path", shards[1])
    with pytest.raises(ValueError, match="--per-split-data-args-path replaces"):
        config("--per-split-data-args-path", str(tmp_path / "splits.json"), "--train-data-path", shards[1])
    with pytest.raises(ValueError, match=r"--data-args-path .*missing.txt: No such file"):
        config("--data-args-path", str(tmp_path / "missing.txt"))
