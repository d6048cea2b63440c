"""Tokenizers (`build_tokenizer`), the vocabulary padding rule, tokenizer flags and training.

`build_tokenizer(cfg.data)` is the single entry point; `pad_vocab_size` is applied once when the
model config is resolved. `megatron.tokenizer.flags` holds the tokenizer flags shared by the tools.
"""
from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HFTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    pad_vocab_size,
)

__all__ = [
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HFTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "build_tokenizer",
    "pad_vocab_size",
]
