"""Build a zero-shot "next verse" multiple-choice task from the demo corpus's held-out books.

    python tools/make_demo_tasks.py [--input data/demo/valid.jsonl] [--output data/demo/tasks/next_verse_valid.jsonl]
        [--max-items 500] [--seed 0]

Input: the JSONL written by tools/prepare_demo_data.py, one chapter a line: {"text": verses joined by
newlines, "book", "chapter"}. For every pair of consecutive verses of a chapter, the item is
context = the verse, choices = the true next verse plus 3 other verses of the same book, label = the
index of the true one. Distractors and the position of the answer are drawn from a random generator
seeded by (seed, book, chapter, verse), so the file is the same on every machine and run. Held-out
books (valid: Ruth, Mark; test: Jonah, James) were never seen in training.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Optional

NUM_CHOICES = 4


def read_books(path: str) -> dict[str, list[list[str]]]:
    """book -> chapters (in file order) -> verses."""
    books: dict[str, list[list[str]]] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text, book = record["text"], record.get("book", "all")
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{line_no}: expected {{'text', 'book', 'chapter'}} ({err})") from None
            verses = [v.strip() for v in text.split("\n") if v.strip()]
            books.setdefault(book, []).append(verses)
    if not books:
        raise ValueError(f"{path} holds no chapters: run tools/prepare_demo_data.py first")
    return books


def build_items(books: dict[str, list[list[str]]], seed: int = 0) -> list[dict]:
    items = []
    for book, chapters in books.items():
        pool = sorted({v for chapter in chapters for v in chapter})  # sorted: independent of set order
        for c, verses in enumerate(chapters):
            for i in range(len(verses) - 1):
                context, answer = verses[i], verses[i + 1]
                candidates = [v for v in pool if v not in (context, answer)]
                if len(candidates) < NUM_CHOICES - 1:
                    continue
                rng = random.Random(f"{seed}/{book}/{c}/{i}")
                choices = rng.sample(candidates, NUM_CHOICES - 1)
                label = rng.randrange(NUM_CHOICES)
                choices.insert(label, answer)
                items.append({"context": context, "choices": choices, "label": label, "book": book,
                              "chapter": c + 1, "verse": i + 1})
    return items


def subsample(items: list[dict], max_items: Optional[int], seed: int) -> list[dict]:
    if max_items is None or len(items) <= max_items:
        return items
    keep = sorted(random.Random(f"{seed}/subsample").sample(range(len(items)), max_items))
    return [items[k] for k in keep]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", default=os.path.join("data", "demo", "valid.jsonl"))
    p.add_argument("--output", default=None, help="default data/demo/tasks/next_verse_<input name>.jsonl")
    p.add_argument("--max-items", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not os.path.exists(args.input):
        raise SystemExit(f"--input {args.input} not found: run tools/prepare_demo_data.py first")
    name = os.path.splitext(os.path.basename(args.input))[0]
    output = args.output or os.path.join(os.path.dirname(args.input), "tasks", f"next_verse_{name}.jsonl")
    items = subsample(build_items(read_books(args.input), args.seed), args.max_items, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    os.replace(tmp, output)
    print(f"wrote {len(items)} items to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
