"""FP8 inside the training loop: a tiny GPT trains like BF16, resumes exactly, logs statistics."""
import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.fp8 import Fp8Linear
from megatron.fp8.layer_state import Fp8LayerState
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.training import assert_resume_is_exact

FP8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max")


def _stale_fp8_weights(monkeypatch) -> None:
    """A broken FP8 layer for the negative control: it keeps quantizing the weights of its first forward."""
    quantized_weight = Fp8LayerState.quantized_weight
    monkeypatch.setattr(Fp8LayerState, "quantized_weight", lambda self, weight, backend, spec: (
        self.weight_cache or quantized_weight(self, weight, backend, spec)))
    monkeypatch.setattr(Fp8LayerState, "forget_weights", lambda self: None)


@pytest.mark.isa_sensitive
def test_fp8_loss_tracks_bf16_within_its_rounding_noise(monkeypatch):
    """FP8 vs BF16 from the same seed and data, bounded by BF16 vs FP32 measured in the same run.

    In this short run the loss responds about linearly to rounding, so its deviation scales with the rounding
    unit: FP8 rounds with up to 2^5 times BF16's unit (E5M2 gradients: 2 mantissa bits vs 7), so FP8's distance
    from BF16 should stay within 32 x BF16's distance from FP32; another 2x for the spread of a 10-iteration
    mean. A broken FP8 layer (stale weights) must fall outside that bound.
    """
    def run(*switches):
        return pretrain(parse_config(tiny_argv(*switches, train_iters=20)))

    fp32, bf16, fp8 = run(), run("--bf16"), run("--bf16", *FP8)
    _stale_fp8_weights(monkeypatch)
    broken = run("--bf16", *FP8)

    def distance(a, b) -> float:  # mean |loss difference| over the last 10 iterations
        return sum(abs(x - y) for x, y in zip(a.losses[-10:], b.losses[-10:], strict=True)) / 10

    noise = distance(bf16, fp32)
    bound = 2 * 32 * noise
    assert 0 < noise < 1e-2, noise  # BF16 really rounds, and the run is in its linear regime
    assert noise < distance(fp8, bf16) < bound, (noise, distance(fp8, bf16), bound)
    assert abs(fp8.valid[-1][1] - bf16.valid[-1][1]) < bound, (fp8.valid, bf16.valid, bound)
    assert distance(broken, bf16) > bound, (distance(broken, bf16), bound)  # the check catches a broken layer
    assert fp8.losses[-1] < fp8.losses[0] - 1.5  # and FP8 learns


def test_scaling_update_runs_once_per_iteration_and_records_the_observed_amaxes():
    """After `pretrain`, every Fp8Linear has seen one delayed-scaling update per iteration and its amax
    history holds the step amaxes of the last iterations, newest first (max over the step's micro-batches)."""
    from megatron.fp8.scaling import Fp8Role
    from megatron.training.loop import Trainer

    iters, history_len = 6, 4
    trainer = Trainer(parse_config(tiny_argv("--bf16", *FP8, train_iters=iters, eval_interval=3)))
    fp8_layers = {n: m for n, m in trainer.model.named_modules() if isinstance(m, Fp8Linear)}
    observed = {n: {"iteration": [], "input": [], "weight": []} for n in fp8_layers}

    def record(name):
        def hook(module, args):
            if module.training:  # evaluation passes must not feed the scaling state
                seen = observed[name]
                seen["iteration"].append(trainer.state.iteration)
                seen["input"].append(args[0].detach().abs().amax().float())
                seen["weight"].append(module.weight.detach().abs().amax().float())
        return hook

    for name, module in fp8_layers.items():
        module.register_forward_pre_hook(record(name))
    trainer.train()
    assert len(fp8_layers) == 8
    for name, m in fp8_layers.items():
        assert m.fp8.num_updates == iters, name
        seen = observed[name]
        for role in ("input", "weight"):
            per_step = [max(a for it, a in zip(seen["iteration"], seen[role]) if it == step) for step in range(iters)]
            newest_first = torch.stack(per_step[::-1][:history_len])
            assert torch.equal(m.fp8_amax_history[Fp8Role[role.upper()]], newest_first), (name, role)
        grads = m.fp8_amax_history[Fp8Role.GRAD_OUTPUT]
        assert torch.isfinite(grads).all() and (grads > 0).all(), (name, grads)
        assert (m.fp8_nonfinite_steps == 0).all(), name


def test_only_block_linears_are_fp8():
    model = pretrain(parse_config(tiny_argv("--bf16", *FP8, train_iters=1, eval_iters=0, lr_warmup_iters=0))).model
    fp8_names = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(fp8_names) == 8  # 2 layers x (qkv, proj, fc1, fc2)
    assert type(model.output_layer) is nn.Linear
    assert type(model.embedding.word_embeddings) is nn.Embedding
    assert "Fp8Linear" in repr(model)


def test_fp8_exact_resume(tmp_path):
    assert_resume_is_exact(tmp_path, ("--bf16", *FP8), 4, train_iters=8, eval_interval=4, hidden_dropout=0.1)


def test_checkpoint_from_another_recipe_says_what_differs(tmp_path):
    pretrain(parse_config(tiny_argv("--bf16", *FP8, save=tmp_path / "c", train_iters=2, eval_iters=0,
                                    lr_warmup_iters=0)))
    other = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "8", "--fp8-amax-compute-algo", "max")
    with pytest.raises(ValueError, match="amax_history_len"):
        pretrain(parse_config(tiny_argv("--bf16", *other, load=tmp_path / "c", train_iters=3, eval_iters=0,
                                        lr_warmup_iters=0)))


def test_fp8_stats_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pretrain(parse_config(tiny_argv("--bf16", *FP8, "--log-fp8-stats", train_iters=5, eval_iters=0,
                                    tensorboard_dir=tmp_path / "tb")))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("fp8/")]
    assert any("decoder.layers.0.mlp.linear_fc1/input" in t for t in tags), tags[:5]


def test_bf16_checkpoint_loads_into_fp8_run(tmp_path):
    """Weights are plain nn.Linear keys, so a BF16 run can continue in FP8 (scales start fresh)."""
    pretrain(parse_config(tiny_argv("--bf16", save=tmp_path / "c", train_iters=2, eval_iters=0, lr_warmup_iters=0)))
    result = pretrain(parse_config(tiny_argv("--bf16", *FP8, load=tmp_path / "c", train_iters=4, eval_iters=0,
                                             lr_warmup_iters=0)))
    assert result.state.iteration == 4
