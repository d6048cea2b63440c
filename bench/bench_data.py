"""Data-pipeline benchmark: preprocessing throughput and index building at 10B-token scale.

    python bench/bench_data.py [--tokens 1e10] [--seq-length 2048] [--workers 2]

1. Preprocessing vs raw tokenization, on the same text (the demo corpus' training chapters, made
   with tools/prepare_demo_data.py in a temporary folder unless `--demo-dir` points to one):
   tokens/s of `tokenizer.tokenize` over in-memory strings, and of `preprocess` (read, parse JSON,
   tokenize, write `.bin/.idx`) with 1 and `--workers` processes; best of `--repeats` runs.
2. Index building for a synthetic document-length table of `--tokens` tokens (log-normal lengths,
   mean about 1,100 tokens; no tokens are written): time and peak memory (tracemalloc, which sees
   numpy's allocations) to hash the table and build the document, sample and shuffle indices of
   one epoch, then the blending index of a 3-way blend of the same number of samples.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from megatron.config import DataConfig  # noqa: E402
from bench.common import wall_times  # noqa: E402
from megatron.data.blended_dataset import build_blending_indices  # noqa: E402
from megatron.data.gpt_dataset import build_gpt_indices, build_sample_index  # noqa: E402
from megatron.data.index_cache import array_digest  # noqa: E402
from megatron.data.preprocess import preprocess  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402
from prepare_demo_data import TOKENIZER_TYPE, prepare  # noqa: E402


def best_time(fn, repeats: int) -> float:
    """Best of `repeats` wall times: the least disturbed by other load on the machine."""
    return min(wall_times(fn, repeats))


def bench_preprocess(demo_dir: str, workers: int, repeats: int) -> None:
    paths = prepare(demo_dir)
    cfg = DataConfig(tokenizer_type=TOKENIZER_TYPE, tokenizer_model=paths["tokenizer_model"])
    tokenizer = build_tokenizer(cfg)
    jsonl = os.path.join(demo_dir, "train.jsonl")
    with open(jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tokens = sum(len(tokenizer.tokenize(t)) for t in texts)
    raw = tokens / best_time(lambda: [tokenizer.tokenize(t) for t in texts], repeats)
    print(f"corpus: {len(texts):,} documents, {tokens:,} tokens, {os.path.getsize(jsonl) / 1e6:.1f} MB JSONL")
    print(f"raw tokenizer.tokenize          {raw:12,.0f} tokens/s")
    with tempfile.TemporaryDirectory() as out:
        for n in sorted({1, workers}):
            runs = [preprocess(jsonl, os.path.join(out, f"w{n}"), cfg, append_eod=True, workers=n, progress=False)
                    for _ in range(repeats)]
            stats = min(runs, key=lambda r: r.seconds)
            rate = stats.tokens / stats.seconds
            print(f"preprocess, {n} worker(s)        {rate:12,.0f} tokens/s  ({rate / raw:.2f}x raw tokenize, "
                  f"{stats.documents / stats.seconds:,.0f} docs/s)")


def measure(fn, *args):
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def bench_indices(total_tokens: float, seq_length: int, seed: int = 1234) -> None:
    rng = np.random.default_rng(seed)
    mean = float(np.exp(6.5 + 0.5))  # log-normal(6.5, 1): ~1,100 tokens per document
    sizes = np.clip(rng.lognormal(6.5, 1.0, int(total_tokens / mean)), 1, 200_000).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    num_samples = (tokens - 1) // seq_length
    print(f"synthetic corpus: {len(sizes):,} documents, {tokens / 1e9:.2f}B tokens; "
          f"{num_samples:,} samples of {seq_length} tokens (one epoch)")

    def build():
        digest = array_digest(sizes)  # the cache key hashes the length table
        return digest, build_gpt_indices(sizes, np.arange(len(sizes)), seq_length, num_samples, seed)

    (_, arrays), seconds, peak = measure(build)
    stored = sum(a.nbytes for a in arrays.values())
    print(f"document+sample+shuffle index   {seconds:6.2f} s, peak {peak / 2**20:,.0f} MiB "
          f"({peak / num_samples:.0f} B/sample; {peak / len(sizes):.0f} B/document), "
          f"cached arrays {stored / 2**20:,.0f} MiB")
    _, seconds, peak = measure(build_blending_indices, [0.5, 0.3, 0.2], num_samples)
    print(f"blending index (3 datasets)     {seconds:6.2f} s, peak {peak / 2**20:,.0f} MiB "
          f"({peak / num_samples:.0f} B/sample)")
    doc_idx, n = arrays["doc_idx"], 200_000
    _, vectorised, _ = measure(build_sample_index, sizes, doc_idx, seq_length, num_samples)
    # Megatron's per-sample algorithm as a Python loop (it has a C++ helper), timed on 200k samples.
    start = time.perf_counter()
    index, offset = 0, 0
    for _ in range(n):
        remaining = seq_length + 1
        while remaining:
            length = int(sizes[doc_idx[index]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                index, offset = index + 1, 0
    loop = (time.perf_counter() - start) * num_samples / n
    print(f"sample index alone: vectorised {vectorised:.2f} s vs a per-sample Python loop {loop:.1f} s "
          f"(extrapolated from {n:,} samples): {loop / vectorised:.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=float, default=1e10, help="tokens in the synthetic length table")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs; the best is reported")
    parser.add_argument("--demo-dir", default=None, help="reuse a prepared demo corpus (default: a temp dir)")
    args = parser.parse_args()
    if args.demo_dir:
        bench_preprocess(args.demo_dir, args.workers, args.repeats)
    else:
        with tempfile.TemporaryDirectory() as demo_dir:
            bench_preprocess(demo_dir, args.workers, args.repeats)
    bench_indices(args.tokens, args.seq_length)


if __name__ == "__main__":
    main()
