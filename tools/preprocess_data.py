"""Tokenize a corpus into Megatron `.bin/.idx` files (flags as in Megatron-LM's tool).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix data/my \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 4

writes `data/my_text_document.bin/.idx` and `data/my_text_document.manifest.json`, which the training reader
checks (sizes, hashes, largest token id). `--input` is a file, a directory (every .jsonl/.json/.txt under it,
also .gz/.zst, and every .parquet/.arrow/.feather) or a quoted glob such as 'redpajama/**/*.jsonl.zst'; files are
taken in path order. JSONL when the name ends in .jsonl/.json (before .gz/.zst), a table when it ends in .parquet
(Parquet) or .arrow/.feather (Arrow IPC file or stream), otherwise plain text with one document per line.

A table's rows are its documents and `--json-keys` names its columns (`--input 'fineweb/data/*.parquet' --json-keys
text`); it is read in record batches of the named columns (needs pyarrow: pip install pyarrow). A row whose named
column is null or not a string is a bad line named by file and row number; a named column the file lacks stops the
run naming the file and its columns.

`--partitions N` cuts the input into N contiguous parts of about equal size (tables between row groups),
tokenized in parallel by N processes (each with `--workers` tokenizer processes) into `data/my_{k}_text_document`
(k = 0..N-1, zero-padded), then merged into `data/my_text_document` and removed; `--no-merge` keeps the partition
pairs instead (blend them with `--data-path` or `--data-args-path`). A malformed line (or table row) stops the
run (exit status 1) with its file and line (row) number, unless `--skip-bad-lines`; so does an input without
documents. Errors print one line, without a traceback. Interrupted runs leave no new files under the final names.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocess import preprocess  # noqa: E402
from megatron.errors import show_tracebacks  # noqa: E402
from megatron.tokenizer.flags import add_tokenizer_args, tokenizer_config  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True,
                       help="a file, a directory or a quoted glob of JSONL (.jsonl/.json) or plain-text files, "
                            "optionally .gz/.zst compressed, or of Parquet (.parquet) or Arrow (.arrow/.feather) "
                            "tables (these need pyarrow); taken in path order")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="JSON keys, or table columns, to extract (default: text)")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip and count malformed lines (table rows) instead of stopping at the first")
    add_tokenizer_args(parser).add_argument("--append-eod", action="store_true",
                                            help="append the end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="writes {prefix}_{key}_document.bin/.idx for every key")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes per partition")
    group.add_argument("--partitions", type=int, default=1,
                       help="split the input into this many contiguous parts tokenized in parallel, then merged")
    group.add_argument("--no-merge", action="store_true",
                       help="with --partitions: keep the partition pairs {prefix}_{k}_{key}_document, do not merge")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # SIGTERM becomes SystemExit, so the temporary outputs are removed like on Ctrl-C.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        stats = preprocess(args.input, args.output_prefix, tokenizer_config(args), args.json_keys,
                           append_eod=args.append_eod, workers=args.workers, skip_bad_lines=args.skip_bad_lines,
                           progress=not args.no_progress, partitions=args.partitions, merge=not args.no_merge)
    except (ValueError, OSError) as err:  # bad flags, files or lines, a full disk: the message names them
        if show_tracebacks():  # MEGATRON_TRACEBACK=1, as for the other entry points
            raise
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the temporary files are already removed
        print("preprocess_data.py: interrupted; unfinished outputs were removed", file=sys.stderr)
        return 130
    print(stats.summary())
    for prefix in stats.output_prefixes:
        print(f"wrote {prefix}.bin, {prefix}.idx and {prefix}.manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
