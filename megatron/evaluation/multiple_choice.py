"""Zero-shot multiple-choice accuracy by log-likelihood, as lm-evaluation-harness scores such tasks.

Task files are JSONL, one item a line: `{"context": str, "choices": [str, ...], "label": int}`.
Each choice is scored as the continuation `delimiter + choice` of the context (lm-eval's
`target_delimiter`, a space by default). The prediction is the choice with the highest summed
log-probability (`acc`), or the highest log-probability per UTF-8 byte of the choice (`acc_norm`,
which removes the bias towards short answers; lm-eval divides by characters, the same for ASCII).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from megatron.errors import json_reason


@dataclass(frozen=True)
class MultipleChoiceItem:
    context: str
    choices: tuple[str, ...]
    label: int


@dataclass
class MultipleChoiceResult:
    acc: float
    acc_norm: float
    num_items: int
    acc_stderr: float
    loglikelihoods: list[list[float]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {"acc": self.acc, "acc_norm": self.acc_norm, "acc_stderr": self.acc_stderr, "num_items": self.num_items}


def load_task(path: str, limit: Optional[int] = None) -> list[MultipleChoiceItem]:
    """Items of a task JSONL file; a malformed line raises ValueError naming `path:line`."""
    items = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: bad JSON ({json_reason(err)})") from None
            if not isinstance(obj, dict) or not {"context", "choices", "label"} <= set(obj):
                raise ValueError(f"{where}: expected an object with keys context, choices, label")
            choices = obj["choices"]
            if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"{where}: 'choices' must be a list of at least two non-empty strings")
            label = obj["label"]
            if not isinstance(label, int) or not 0 <= label < len(choices):
                raise ValueError(f"{where}: 'label' {label!r} is not an index into the {len(choices)} choices")
            items.append(MultipleChoiceItem(str(obj["context"]), tuple(choices), label))
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise ValueError(f"task file {path} holds no items")
    return items


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # first of ties, as numpy.argmax


def accuracy(items: Sequence[MultipleChoiceItem], loglikelihoods: Sequence[Sequence[float]]) -> MultipleChoiceResult:
    """acc and acc_norm of per-choice log-likelihoods (pure arithmetic, no model)."""
    if len(items) != len(loglikelihoods) or not items:
        raise ValueError(f"{len(items)} items but {len(loglikelihoods)} score lists")
    hits, hits_norm = 0, 0
    for item, lls in zip(items, loglikelihoods):
        if len(lls) != len(item.choices):
            raise ValueError(f"{len(item.choices)} choices but {len(lls)} scores")
        hits += _argmax(lls) == item.label
        per_byte = [ll / len(choice.encode("utf-8")) for ll, choice in zip(lls, item.choices)]
        hits_norm += _argmax(per_byte) == item.label
    n = len(items)
    acc = hits / n
    stderr = math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else float("nan")
    return MultipleChoiceResult(acc=acc, acc_norm=hits_norm / n, num_items=n, acc_stderr=stderr,
                                loglikelihoods=[list(lls) for lls in loglikelihoods])


def score_items(scorer, items: Iterable[MultipleChoiceItem], delimiter: str = " ") -> MultipleChoiceResult:
    """Score every choice of every item with `scorer.loglikelihood` (one batched call) and compute accuracy."""
    items = list(items)
    pairs = [(item.context, delimiter + choice) for item in items for choice in item.choices]
    flat = [ll for ll, _ in scorer.loglikelihood(pairs)]
    per_item, k = [], 0
    for item in items:
        per_item.append(flat[k:k + len(item.choices)])
        k += len(item.choices)
    return accuracy(items, per_item)
