"""`grads.clip_grad_norm`'s rule for `--clip-grad 0` (Megatron's "no clipping"), which every engine's step uses:
the norm is computed, the gradients are left as they are (a coefficient of exactly 1)."""
from __future__ import annotations

import torch

from megatron.parallel.grads import clip_grad_norm


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    for p in params:
        p.grad = torch.randn_like(p) * 100  # a norm far above any clip
    return params


def test_clip_0_computes_the_norm_and_clips_nothing():
    params = _params()
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 0.0, None)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))
    assert torch.equal(norm, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before])))


def test_a_positive_clip_clips_as_torch_does():
    got, want = _params(), _params()
    assert torch.equal(clip_grad_norm(got, 1.0, None), torch.nn.utils.clip_grad_norm_(want, 1.0))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(got, want))
