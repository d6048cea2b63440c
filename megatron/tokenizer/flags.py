"""The tokenizer flags (Megatron names), shared by every tool that needs a tokenizer.

`tools/preprocess_data.py`, `tools/prepare_demo_data.py` and `bench/bench_data.py` call
`add_tokenizer_args` and `tokenizer_config` instead of repeating the argparse block; the result is a
`DataConfig` slice that `build_tokenizer` accepts, exactly as in training.
"""
from __future__ import annotations

import argparse

from megatron.config import DataConfig
from megatron.tokenizer.tokenizer import TOKENIZER_TYPES


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, default=None,
                       help=f"one of {', '.join(TOKENIZER_TYPES)}")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece .model file, or a local HF tokenizer folder / tokenizer.json")
    group.add_argument("--vocab-file", type=str, default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", type=str, default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="number of ids for NullTokenizer (eod is the extra id N)")
    return group


def tokenizer_config(args: argparse.Namespace) -> DataConfig:
    """The `DataConfig` carrying only the tokenizer fields of `args`."""
    return DataConfig(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                      vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
