"""Cross-entropy over logits split along the vocabulary: never gathers the full [tokens, vocab] logits.

Each TP rank holds logits for vocabulary ids [start, start + V/tp). With m = max over the whole
vocabulary (MAX all-reduce), the loss of a token with target t is

    loss = log(sum_v exp(z_v - m)) - (z_t - m)

where the sum is a SUM all-reduce of each rank's partial sum and z_t - m comes from the one rank that
owns t (the others contribute 0 to a SUM all-reduce). Three all-reduces of [tokens] floats instead of
an all-gather of [tokens, vocab]. The gradient is local: d loss / d z_v = softmax_v - [v == t].
The max is a constant of the computation (the loss does not depend on it), so it carries no gradient.
Everything runs in at least FP32 (float64 logits stay float64).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron.dtypes import at_least_fp32
from megatron.parallel.tensor_parallel import all_reduce_max, all_reduce_sum, group_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
        logits = at_least_fp32(logits)
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        logits_max = all_reduce_max(logits.max(dim=-1).values, group)
        shifted = logits - logits_max.unsqueeze(-1)

        owned = (target >= start) & (target < start + local_vocab)
        local_target = torch.where(owned, target - start, torch.zeros_like(target))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = all_reduce_sum(torch.where(owned, target_logit, torch.zeros_like(target_logit)), group)

        exp = shifted.exp()
        sum_exp = all_reduce_sum(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), owned, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, owned, local_target = ctx.saved_tensors
        grad = softmax  # saved for this backward only: reuse its memory
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any) -> torch.Tensor:
    """Per-token loss (at least FP32) [...] from this rank's logits [..., V/tp] and the full-vocabulary targets [...].

    Equals `F.cross_entropy(full_logits, target, reduction="none")`; with `group` None it is exactly that.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group)
