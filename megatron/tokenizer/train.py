"""Training a SentencePiece BPE tokenizer on documents (used by tools/train_tokenizer.py).

SentencePiece silently drops every input sentence longer than `max_sentence_length` bytes, which
would quietly remove long documents from the training data. Documents are therefore fed line by
line, and lines still too long are cut at whitespace into chunks that fit (`chunk_text`).
The `.model`/`.vocab` pair is trained under a temporary prefix and renamed at the end.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Iterator

DEFAULT_MAX_SENTENCE_BYTES = 4192  # SentencePiece's own default


def chunk_text(text: str, max_bytes: int = DEFAULT_MAX_SENTENCE_BYTES) -> Iterator[str]:
    """Non-blank lines of `text`, each cut at whitespace (or hard, for one huge word) to <= max_bytes."""
    for line in text.splitlines():
        if not line.strip():
            continue
        if len(line.encode("utf-8")) <= max_bytes:
            yield line
            continue
        chunk, size = [], 0
        for word in line.split():
            data = word.encode("utf-8")
            while len(data) > max_bytes:  # a single word longer than the limit: cut it on a char boundary
                head = data[:max_bytes].decode("utf-8", errors="ignore")
                if chunk:
                    yield " ".join(chunk)
                    chunk, size = [], 0
                yield head
                data = data[len(head.encode("utf-8")):]
            if size + len(data) + (1 if chunk else 0) > max_bytes:
                yield " ".join(chunk)
                chunk, size = [], 0
            if data:
                size += len(data) + (1 if chunk else 0)
                chunk.append(data.decode("utf-8"))
        if chunk:
            yield " ".join(chunk)


def train_sentencepiece(documents: Iterable[str], model_prefix: str, vocab_size: int,
                        max_sentence_length: int = DEFAULT_MAX_SENTENCE_BYTES, model_type: str = "bpe",
                        character_coverage: float = 1.0, byte_fallback: bool = True,
                        num_threads: int = 0) -> str:
    """Train on `documents`, write `{model_prefix}.model` and `.vocab`, return the .model path.

    Defaults keep text round-trippable: identity normalisation, whitespace kept as is, and byte
    fallback so characters outside the vocabulary are still encoded. Ids: unk 0, bos 1, eos 2.
    """
    import sentencepiece

    if vocab_size < 16:
        raise ValueError(f"--vocab-size {vocab_size} is too small for SentencePiece: use at least a few hundred")
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = f"{model_prefix}.tmp-{os.getpid()}"
    sentences = (chunk for doc in documents for chunk in chunk_text(doc, max_sentence_length))
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences, model_prefix=tmp_prefix, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage, byte_fallback=byte_fallback,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            max_sentence_length=max_sentence_length, num_threads=num_threads or os.cpu_count() or 1,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    except RuntimeError as err:
        for suffix in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + suffix):
                os.remove(tmp_prefix + suffix)
        if "Vocabulary size" in str(err):
            raise ValueError(vocab_size_advice(vocab_size, str(err))) from None
        raise
    os.replace(tmp_prefix + ".vocab", model_prefix + ".vocab")
    os.replace(tmp_prefix + ".model", model_prefix + ".model")
    return model_prefix + ".model"


def vocab_size_advice(vocab_size: int, reason: str) -> str:
    """One line for SentencePiece's refusal of `--vocab-size`, with the bound it names and which way to move."""
    floor = re.search(r"smaller than required_chars\. \d+ vs (\d+)", reason)
    if floor:
        return (f"--vocab-size {vocab_size} is too small for this corpus: it needs at least {floor.group(1)} pieces "
                f"(one per distinct character, plus the special and byte-fallback pieces); raise it to >= "
                f"{floor.group(1)}")
    ceiling = re.search(r"value <= (\d+)", reason)
    if ceiling:
        return (f"--vocab-size {vocab_size} is too large for this corpus: SentencePiece can make at most "
                f"{ceiling.group(1)} pieces from it; lower it to <= {ceiling.group(1)}, or train on more text")
    return f"--vocab-size {vocab_size} does not fit this corpus (SentencePiece: {reason})"
