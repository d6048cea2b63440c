"""Gradient accumulation gives the gradient of the global batch: the same 8 samples as 8 micro-batches of 1, 1 of 8
and 4 of 2 give the same gradients and the same grad norm, with clipping off (so nothing rescales a wrong gradient
back into range). The model runs in float64: the three layouts add the same terms in different orders, so each
gradient element differs by a few float64 roundings of its summands (relative ~1e-15 per operation); 1e-10 leaves
five orders of magnitude for the dozens of chained operations, while a micro-batch's loss not divided by the
accumulation steps scales a gradient by up to 8. Every token counts in the loss here (no --eod-mask-loss): with a
varying mask, Megatron's mean of micro-batch means depends on the layout by design."""
import torch

from megatron.arguments import parse_config
from megatron.data.provider import make_batch
from megatron.training.loop import Trainer
from tests.support.config import tiny_argv

SAMPLES = 8
RTOL = 1e-10


def _step(micro_batch_size: int, text: torch.Tensor) -> tuple[float, dict]:
    """One optimizer step of the tiny model in float64 over `text` cut into micro-batches: (grad norm, gradients)."""
    config = parse_config(tiny_argv(micro_batch_size=micro_batch_size, global_batch_size=SAMPLES,
                                    clip_grad=0, train_iters=1, eval_iters=0, lr_warmup_iters=0),
                          world_size=1, env={})
    trainer = Trainer(config)
    trainer.model.double()  # in place: the optimizer keeps the same parameters
    batches = [make_batch(chunk, trainer.eod, config.data) for chunk in text.split(micro_batch_size)]
    _, grad_norm, stepped = trainer.engine.train_batch(0, batches, trainer._forward_loss)
    assert stepped
    return float(grad_norm), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_accumulated_gradients_and_grad_norm_do_not_depend_on_the_micro_batch_layout():
    text = torch.randint(0, 128, (SAMPLES, 33), generator=torch.Generator().manual_seed(7))
    norm, grads = _step(SAMPLES, text)
    direct = torch.cat([g.reshape(-1) for g in grads.values()]).norm().item()
    assert abs(norm - direct) <= RTOL * direct, (norm, direct)
    for micro_batch_size in (1, 2):
        other_norm, other = _step(micro_batch_size, text)
        assert abs(other_norm - norm) <= RTOL * norm, (micro_batch_size, other_norm, norm)
        for name, grad in grads.items():
            assert grad.dtype == torch.float64
            assert (other[name] - grad).norm() <= RTOL * grad.norm(), (micro_batch_size, name)
