"""Train a SentencePiece BPE tokenizer on text or JSONL files.

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --vocab-size 32000 \\
        --output-prefix data/tokenizer

writes `data/tokenizer.model` (use with `--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model
data/tokenizer.model`) and `data/tokenizer.vocab`. Inputs are read like tools/preprocess_data.py
reads them (.jsonl/.json: JSON lines; else one document per line). Long documents are cut into
chunks below `--max-sentence-length` bytes, because SentencePiece silently drops longer sentences.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.text_input import iter_documents  # noqa: E402
from megatron.tokenizer.train import DEFAULT_MAX_SENTENCE_BYTES, train_sentencepiece  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSONL (.jsonl/.json) or plain text files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys holding text (default: text)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--output-prefix", "--model-prefix", dest="output_prefix", required=True,
                        help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--character-coverage", type=float, default=1.0,
                        help="fraction of characters covered by the vocabulary (byte fallback covers the rest)")
    parser.add_argument("--max-sentence-length", type=int, default=DEFAULT_MAX_SENTENCE_BYTES,
                        help="longest training chunk in bytes; longer lines are split")
    return parser.parse_args(argv)


def iter_texts(paths: Sequence[str], json_keys: Sequence[str]) -> Iterator[str]:
    for path in paths:
        keys = json_keys if path.endswith((".jsonl", ".json")) else json_keys[:1]
        for doc in iter_documents(path, keys):
            yield from doc.values()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        for path in args.input:
            if not os.path.isfile(path):
                raise ValueError(f"--input {path!r} is not a file")
        model = train_sentencepiece(iter_texts(args.input, args.json_keys), args.output_prefix, args.vocab_size,
                                    max_sentence_length=args.max_sentence_length, model_type=args.model_type,
                                    character_coverage=args.character_coverage)
    except ValueError as err:
        print(f"train_tokenizer.py: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {model}: use --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
