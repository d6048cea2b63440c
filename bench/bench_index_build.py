"""Peak memory and time of the GPT sample-index build at 10B / 100B / 400B tokens, extrapolated to 2T.

    python bench/bench_index_build.py                        # new build at 1e10 1e11 4e11, 400B under 3.2 GB
    python bench/bench_index_build.py --tokens 1e10 --old    # also the former whole-array build, for comparison

No tokens are needed: a synthetic document-length table stands for the `.idx` (log-normal lengths with a
mean of ~1,111 tokens, RedPajama's shape: 2T tokens in ~1.8B documents), written once per scale to
`--work-dir` as an int32 `.npy` and memory-mapped by the build, as the `.idx` is in training. Each build
runs in a fresh child process (`--child`) that imports numpy and the index modules only, so its peaks are
the build's own:

* peak RSS (VmHWM; it includes the pages of the length table the build touched, file-backed),
* peak address space (VmPeak; what RLIMIT_AS limits: every mapping, the table's included),
* wall time of the build (into a real cache folder, files written as built and published; mapping them
  afterwards is the load, not measured here), and of the md5 of the length table that names the cache
  entry (GPTDataset computes it at every start).

`--rlimit-as GB` runs the builds at `--rlimit-at` tokens under a hard address-space limit (RLIMIT_AS set in
the child): running out raises MemoryError there and the benchmark exits with status 1. The extrapolation
fits peak = a + b * tokens through the two largest scales and evaluates it at 2T tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TOKENS_PER_DOCUMENT = 2e12 / 1.8e9  # RedPajama-shaped: 2T tokens in ~1.8B documents
TARGET_TOKENS = 2e12
SEED = 1234


def synthetic_table(tokens: float, path: str, seed: int = SEED) -> int:
    """Write `tokens / TOKENS_PER_DOCUMENT` log-normal document lengths (int32, mean ~1,111) to `path`."""
    from megatron.data.gpt_index import NpyFileSink

    num_docs = int(tokens / TOKENS_PER_DOCUMENT)
    if os.path.isfile(path) and np.load(path, mmap_mode="r").shape == (num_docs,):
        return num_docs
    rng = np.random.default_rng(seed)
    sink = NpyFileSink(path + ".tmp", np.int32, (num_docs,))
    mu = math.log(TOKENS_PER_DOCUMENT) - 0.5  # log-normal(mu, 1) has mean exp(mu + 1/2)
    for start in range(0, num_docs, 1 << 22):
        n = min(1 << 22, num_docs - start)
        sink.append(np.clip(rng.lognormal(mu, 1.0, n), 1, 1 << 20).astype(np.int32))
    sink.close()
    os.replace(path + ".tmp", path)
    return num_docs


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmPeak, VmHWM, VmSize, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(table: str, seq_length: int, mode: str, cache_dir: str, rlimit_as: float, budget_per_token: float,
          chunk: int) -> dict:
    """One build in this (fresh) process; returns its measurements."""
    import resource

    from megatron.data import gpt_index
    from megatron.data.index_cache import array_digest, build_entry

    if chunk:
        gpt_index.CHUNK = chunk
    sizes = np.load(table, mmap_mode="r")
    tokens = int(sizes.sum(dtype=np.int64))
    num_samples = (tokens - 1) // seq_length
    baseline = _status("VmSize") - sizes.nbytes  # interpreter and libraries, without the table
    limit = int(rlimit_as) if rlimit_as else (int(baseline + budget_per_token * tokens) if budget_per_token else 0)
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    start = time.perf_counter()
    digest_seconds = 0.0
    if mode == "new":
        array_digest(sizes)
        digest_seconds = time.perf_counter() - start
        build_entry(cache_dir, "bench", {"table": table, "seq": seq_length}, ("doc_idx", "sample_idx", "shuffle_idx"),
                      lambda sinks: gpt_index.write_gpt_indices(sizes, (0, len(sizes)), seq_length, num_samples, SEED,
                                                                sinks))
    else:
        from tests.support.index_reference import build_gpt_indices

        build_gpt_indices(sizes, np.arange(len(sizes)), seq_length, num_samples, SEED)
    seconds = time.perf_counter() - start
    return {"documents": len(sizes), "tokens": tokens, "samples": num_samples, "seconds": seconds,
            "digest_seconds": digest_seconds, "peak_rss": _status("VmHWM"), "peak_as": _status("VmPeak"),
            "baseline": baseline, "table_bytes": sizes.nbytes, "limit": limit}


def run_child(table: str, seq_length: int, mode: str, rlimit_as: float = 0.0, budget_per_token: float = 0.0,
              chunk: int = 0, timeout: float = 3600) -> dict:
    """`child` in a subprocess; raises RuntimeError (with its stderr) when the build failed, e.g. out of memory."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(table)) as cache_dir:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", table, "--seq-length", str(seq_length),
               "--mode", mode, "--cache-dir", cache_dir, "--rlimit-as-bytes", str(rlimit_as),
               "--budget-per-token", str(budget_per_token), "--chunk", str(chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} build of {table} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e10, 1e11, 4e11])
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--old", action="store_true", help="also run the former whole-array build (<= 1e11 tokens)")
    parser.add_argument("--rlimit-as", type=float, default=3.2, help="GB of address space for the --rlimit-at build")
    parser.add_argument("--rlimit-at", type=float, default=4e11, help="the scale built under --rlimit-as")
    parser.add_argument("--work-dir", default=None, help="keeps the synthetic tables (default: a temporary folder)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="new", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rlimit-as-bytes", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--budget-per-token", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seq_length, args.mode, args.cache_dir, args.rlimit_as_bytes,
                               args.budget_per_token, args.chunk)))
        return 0
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-index-")
    os.makedirs(work, exist_ok=True)
    print(f"seq {args.seq_length}, {TOKENS_PER_DOCUMENT:,.0f} tokens/document (log-normal), one epoch; "
          f"{os.cpu_count()} CPUs")
    print(f"{'build':>5} {'tokens':>7} {'documents':>13} {'samples':>12} {'time s':>7} {'md5 s':>6} "
          f"{'peak RSS MiB':>12} {'peak AS MiB':>11} {'table MiB':>9}  limit")
    rows = []
    status = 0
    for tokens in args.tokens:
        table = os.path.join(work, f"sizes-{tokens:.0e}.npy")
        synthetic_table(tokens, table)
        modes = ["old", "new"] if args.old and tokens <= 1e11 else ["new"]
        for mode in modes:
            limit = args.rlimit_as * 1e9 if mode == "new" and tokens == args.rlimit_at else 0.0
            try:
                r = run_child(table, args.seq_length, mode, rlimit_as=limit)
            except RuntimeError as err:
                print(f"{mode:>5} {tokens:7.0e}  FAILED{' under RLIMIT_AS %.1f GB' % args.rlimit_as if limit else ''}:"
                      f" {str(err).splitlines()[-1]}")
                status = 1
                continue
            print(f"{mode:>5} {tokens:7.0e} {r['documents']:13,} {r['samples']:12,} {r['seconds']:7.1f} "
                  f"{r['digest_seconds']:6.1f} {mib(r['peak_rss']):>12} {mib(r['peak_as']):>11} "
                  f"{mib(r['table_bytes']):>9}  {'%.2f GB held' % (limit / 1e9) if limit else ''}")
            if mode == "new":
                rows.append(r)
    if len(rows) >= 2:
        (t1, r1), (t2, r2) = sorted((r["tokens"], r) for r in rows)[-2:]
        for key, name in (("peak_rss", "peak RSS"), ("peak_as", "peak address space")):
            slope = (r2[key] - r1[key]) / (t2 - t1)
            at_target = r2[key] + slope * (TARGET_TOKENS - t2)
            print(f"extrapolated to 2T tokens ({TARGET_TOKENS / TOKENS_PER_DOCUMENT:,.0f} documents, "
                  f"{int(TARGET_TOKENS / args.seq_length):,} samples): {name} {at_target / 1e9:.1f} GB "
                  f"({slope * 1e12 / 1e9:.2f} GB per 1T tokens)")
        slope = (r2["seconds"] - r1["seconds"]) / (t2 - t1)
        print(f"extrapolated build time at 2T: {(r2['seconds'] + slope * (TARGET_TOKENS - t2)) / 60:.1f} min "
              f"(+ {r2['digest_seconds'] * TARGET_TOKENS / t2:.0f} s of md5 at every start)")
    return status


if __name__ == "__main__":
    sys.exit(main())
