"""Log-likelihood scoring with a `GPTModel`: the one primitive behind perplexity, zero-shot tasks and lm-eval.

A *window* is a token list plus how many of its last tokens to score: the model reads
`tokens[:-1]` and the log-probabilities of `tokens[-n:]` given everything before them are summed.
Windows of different lengths are batched with right padding, which cannot change the scores
(attention is causal, so padding only ever follows the scored positions).

`LogLikelihoodScorer` adds the text side, following lm-evaluation-harness conventions so numbers
are comparable: a (context, continuation) pair is encoded as `tok(context + continuation)` split at
`len(tok(context))` (trailing spaces of the context move to the continuation first), an empty
context becomes the end-of-document token, and inputs longer than the model's window are
truncated on the left. Rolling (whole-text) log-likelihood follows lm-eval's rolling windows
(`get_rolling_token_windows` with `context_len=1`, made disjoint): the first window reads the prefix token and
the text's first `max_length - 1` tokens and scores `max_length` of them; each later window scores the next
`max_length` tokens (fewer in the last) and reads the `max_length` tokens before each, so a short last window
still sees a full window of context. The prefix token is the end-of-document token, the separator the model
was trained after; the Hugging Face export declares it as BOS so lm-eval's `hf` model uses the same one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron.accelerator import bf16_autocast


@dataclass(frozen=True)
class Window:
    tokens: tuple[int, ...]
    num_scored: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_scored <= len(self.tokens) - 1:
            raise ValueError(f"a window needs >= 2 tokens and 1..len-1 scored ones, got {len(self.tokens)} "
                             f"tokens and {self.num_scored} scored")


@torch.no_grad()
def score_windows(model: nn.Module, windows: Sequence[Window], batch_size: int = 8,
                  device: Optional[torch.device] = None, bf16: bool = False) -> list[tuple[float, bool]]:
    """(sum of log-probs of the scored tokens, whether each was the argmax) for every window."""
    device = device or next(model.parameters()).device
    model.eval()
    out: list[tuple[float, bool]] = []
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        width = max(len(w.tokens) - 1 for w in chunk)
        inputs = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, w in enumerate(chunk):
            inputs[row, :len(w.tokens) - 1] = torch.tensor(w.tokens[:-1])
        autocast = bf16_autocast(device.type, bf16)
        with autocast:
            logits = model(inputs.to(device))
        logprobs = F.log_softmax(logits.float(), dim=-1)
        for row, w in enumerate(chunk):
            n, length = w.num_scored, len(w.tokens) - 1
            targets = torch.tensor(w.tokens[-n:], device=device)
            rows = logprobs[row, length - n:length]
            total = rows.gather(-1, targets.unsqueeze(-1)).sum().item()
            greedy = bool((rows.argmax(-1) == targets).all().item())
            out.append((total, greedy))
    return out


def rolling_windows(stream: Sequence[int], max_length: int) -> list[Window]:
    """Disjoint windows scoring every token of `stream` after the first, `max_length` at a time.

    Window k reads `stream[k*L : k*L + L]` and scores `stream[k*L + 1 : k*L + L + 1]`: exactly the
    training samples of `seq_length + 1` tokens sharing one token with their neighbour.
    """
    windows = []
    for begin in range(0, len(stream) - 1, max_length):
        piece = tuple(stream[begin:begin + max_length + 1])
        windows.append(Window(piece, len(piece) - 1))
    return windows


def lm_eval_rolling_windows(tokens: Sequence[int], prefix: int, max_length: int) -> list[Window]:
    """Windows scoring every token of `tokens` once, with lm-eval's rolling convention (module docstring)."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [Window((prefix, *tokens[:first]), first)]
    predicted = first
    while predicted < len(tokens):
        scored = min(len(tokens) - predicted, max_length)
        end = predicted + scored
        # reads tokens[end - max_length - 1 : end - 1], scores tokens[end - scored : end]
        windows.append(Window(tuple(tokens[end - max_length - 1:end]), scored))
        predicted = end
    return windows


class LogLikelihoodScorer:
    """Scores text under a model and tokenizer (our tokenizer interface: tokenize/detokenize/eod)."""

    def __init__(self, model: nn.Module, tokenizer, max_length: int, batch_size: int = 8,
                 device: Optional[torch.device] = None, bf16: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = device or next(model.parameters()).device
        self.bf16 = bf16

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.tokenizer.eod], self.tokenizer.tokenize(continuation)
        whole = self.tokenizer.tokenize(context + continuation)
        context_ids = self.tokenizer.tokenize(context)
        return context_ids, whole[len(context_ids):]

    def pair_window(self, context_ids: Sequence[int], continuation_ids: Sequence[int]) -> Window:
        if not continuation_ids:
            raise ValueError("empty continuation: nothing to score (is a choice an empty string?)")
        if len(continuation_ids) > self.max_length:
            raise ValueError(f"a continuation of {len(continuation_ids)} tokens exceeds the model's window "
                             f"of {self.max_length} tokens")
        tokens = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1):]
        return Window(tuple(tokens), len(continuation_ids))

    def loglikelihood(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        """log P(continuation | context) and greediness for each (context, continuation) string pair."""
        windows = [self.pair_window(*self.encode_pair(c, x)) for c, x in pairs]
        return score_windows(self.model, windows, self.batch_size, self.device, self.bf16)

    def loglikelihood_tokens(self, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        windows = [self.pair_window(c, x) for c, x in pairs]
        return score_windows(self.model, windows, self.batch_size, self.device, self.bf16)

    def rolling_loglikelihood(self, text: str) -> float:
        """log P(text), every token scored once after an end-of-document token, in lm-eval's windows."""
        windows = lm_eval_rolling_windows(self.tokenizer.tokenize(text), self.tokenizer.eod, self.max_length)
        return sum(total for total, _ in score_windows(self.model, windows, self.batch_size, self.device, self.bf16))
