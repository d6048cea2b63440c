"""Merge `.bin/.idx` pairs into one (flags as in Megatron-LM's and Megatron-DeepSpeed's merge tools).

    python tools/merge_datasets.py --input data/parts --output-prefix data/corpus_text_document
    python tools/merge_datasets.py --datasets data/a_text_document data/b_text_document \\
        --output-prefix data/corpus_text_document

`--input DIR` merges every pair in DIR in the order of their names (Megatron-LM's tool); `--datasets` merges the
prefixes in the order given (Megatron-DeepSpeed's `merge_preprocessed_data.py`). The output is byte for byte what
tokenizing the inputs' texts one after the other writes, plus `PREFIX.manifest.json`; it is written by streaming
(constant memory) under temporary names and published atomically. Errors print one line (exit status 1).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.merge import merge_datasets, pairs_in_directory  # noqa: E402
from megatron.errors import show_tracebacks  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=str, help="folder whose .bin/.idx pairs are merged, sorted by name")
    source.add_argument("--datasets", nargs="+", help="prefixes (without .bin/.idx) merged in this order")
    parser.add_argument("--output-prefix", type=str, required=True, help="writes PREFIX.bin, .idx, .manifest.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # temporaries removed as on Ctrl-C
    try:
        prefixes = pairs_in_directory(args.input) if args.input else list(args.datasets)
        out = os.path.abspath(args.output_prefix)
        prefixes = [p for p in prefixes if os.path.abspath(p) != out] if args.input else prefixes
        stats = merge_datasets(prefixes, args.output_prefix, progress=not args.no_progress)
    except (ValueError, OSError) as err:
        if show_tracebacks():
            raise
        print(f"merge_datasets.py: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("merge_datasets.py: interrupted; unfinished outputs were removed", file=sys.stderr)
        return 130
    print(stats.summary())
    print(f"wrote {args.output_prefix}.bin, {args.output_prefix}.idx and {args.output_prefix}.manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
