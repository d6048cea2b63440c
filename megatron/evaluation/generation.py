"""Autoregressive sampling from a `GPTModel`: greedy, temperature, top-k and top-p (nucleus).

No KV cache: every step re-reads the last `max_length` tokens. That costs O(n^2) work in the
generated length, which is fine for the small demo models this repository trains; long generations
from big models belong to an inference engine (export with tools/convert_to_hf.py).
Sampling draws from a private `torch.Generator`, so `--seed` makes it reproducible and it never
disturbs the global RNG.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    greedy: bool = False
    stop_at_eod: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set of mass >= top_p."""
    logits = logits.clone()
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """One token id from the FP32 logits of the last position."""
    if sampling.is_greedy:
        return int(logits.argmax(-1).item())
    filtered = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = filtered.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


@torch.no_grad()
def generate(model: nn.Module, prompt: Sequence[int], sampling: SamplingConfig, max_length: int,
             eod: Optional[int] = None, seed: int = 0, vocab_size: Optional[int] = None) -> list[int]:
    """The new token ids that follow `prompt` (the prompt itself is not returned).

    `vocab_size` (the tokenizer's, unpadded) keeps the padding rows of the embedding table, which
    no tokenizer can decode, from ever being drawn.
    """
    if not prompt:
        raise ValueError("empty prompt: give at least one token (an empty text becomes the end-of-document token)")
    device = next(model.parameters()).device
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(sampling.max_new_tokens):
        window = torch.tensor([tokens[-max_length:]], device=device)
        logits = model(window)[0, -1].float()
        if vocab_size is not None:
            logits[vocab_size:] = float("-inf")
        token = next_token(logits, sampling, generator)
        if sampling.stop_at_eod and eod is not None and token == eod:
            break
        tokens.append(token)
        new.append(token)
    return new


def decode_continuation(tokenizer, prompt: Sequence[int], new: Sequence[int]) -> str:
    """The text that `new` adds after `prompt`.

    Decoding `new` alone can lose a leading space (SentencePiece drops the "▁" of a sequence's first
    piece), so the prompt is decoded with it and its own text cut off.
    """
    full, head = tokenizer.detokenize(list(prompt) + list(new)), tokenizer.detokenize(list(prompt))
    return full[len(head):] if full.startswith(head) else tokenizer.detokenize(list(new))
