"""--params-dtype bf16 (Megatron's layout): BF16 weights, FP32 main gradients, FP32 masters with the optimizer.

Torch engine in-process (fast); the DeepSpeed ZeRO-1 run (2 gloo processes, `slow`) is in
tests/e2e/test_main_params_launch.py. The dry-run estimate is checked against the layout's targets.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.checkpoint import store as ckpt
from megatron.optimizer.main_params import MainParams
from megatron.perf.flops import memory_estimate_bytes
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.flags import MAIN_PARAMS_FP8 as FP8, PARAMS_BF16 as MAIN


def test_main_gradients_accumulate_in_fp32_and_masters_round_into_bf16_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].weight.tensor_parallel_dim = 0  # as a TP shard carries it: clipping counts shards per TP rank
    main = MainParams(model, opt)
    assert main.masters[0].tensor_parallel_dim == 0 and not hasattr(main.masters[1], "tensor_parallel_dim")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
    assert all(torch.equal(m, r) for m, r in zip(main.masters, reference))  # masters start as the FP32 weights
    captured = [[] for _ in main.params]
    for p, bucket in zip(main.params, captured):
        p.register_hook(lambda g, bucket=bucket: bucket.append(g.detach().clone()))
    main.zero_grad()
    for k in range(3):  # three micro-batches
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(k))
        model(x.bfloat16()).float().pow(2).mean().backward()
    assert all(p.grad is None for p in main.params)  # moved into the main gradients
    for g, bucket in zip(main.main_grads, captured):
        assert all(b.dtype == torch.bfloat16 for b in bucket)
        exact = sum(b.double() for b in bucket)
        # FP32 accumulation: within 2 fp32 roundings of the float64 sum (a BF16 one would be 2^16 x farther)
        assert (g.double() - exact).abs().max() <= 2 * 2.0**-24 * exact.abs().max()
    masters = main.reduce_and_attach(None, 1)
    opt.step()
    main.copy_to_model()
    for p, m, r, g in zip(main.params, masters, reference, main.main_grads):
        # SGD on the FP32 master with the FP32 main gradient (one or two fp32 roundings: a fused add may apply)
        assert ((m - (r - 0.1 * g)).abs() <= 2.0**-23 * r.abs().max()).all()
        assert torch.equal(p, m.bfloat16())  # round to nearest into the BF16 weight


def test_flag_checks():
    for argv, message in (((*MAIN,), "needs --bf16"),
                          (("--bf16", *MAIN, "--deepspeed", "--zero-stage", "0"), "--zero-stage 1, 2 or 3")):
        with pytest.raises(ValueError, match=message):
            parse_config(tiny_argv(*argv))


def test_torch_engine_trains_like_the_fp32_layout_and_resumes_exactly(tmp_path):
    """FP8 linears + Fp8AdamW, 8 steps: the BF16 layout against today's FP32 one over the same tokens. The
    masters get the same updates; what differs is that the forward reads BF16-rounded weights (relative
    rounding <= 2^-9 per weight), which moves an early loss by ~1e-4-1e-3 of itself; 1% is far above that
    and far below a broken layout (frozen weights: the loss would not fall by 0.4; unscaled or BF16
    accumulation would diverge from the reference)."""
    common = dict(train_iters=8, eval_iters=0)
    fp32 = pretrain(parse_config(tiny_argv(*FP8, **common)))
    straight = pretrain(parse_config(tiny_argv(*FP8, *MAIN, **common)))
    assert all(p.dtype == torch.bfloat16 for p in straight.model.parameters())
    assert max(abs(a - b) / a for a, b in zip(fp32.losses, straight.losses)) < 0.01
    assert straight.losses[-1] < straight.losses[0] - 0.4
    pretrain(parse_config(tiny_argv(*FP8, *MAIN, save=tmp_path / "c", exit_interval=4, **common)))
    saved = ckpt.load_checkpoint_files(tmp_path / "c")["payload"]["model"]
    weights = {n: t for n, t in saved.items() if not n.startswith("rotary")}
    assert weights and all(t.dtype == torch.float32 for t in weights.values())  # the masters, not BF16 copies
    assert any(not torch.equal(t, t.bfloat16().float()) for t in weights.values())
    resumed = pretrain(parse_config(tiny_argv(*FP8, *MAIN, load=tmp_path / "c", **common)))
    assert straight.losses[4:] == resumed.losses
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k


def _bytes_per_param(argv: tuple, **overrides) -> float:
    cfg = parse_config(LLAMA_7B + list(argv) + [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()])
    mem = memory_estimate_bytes(cfg)
    from megatron.perf.flops import count_parameters

    persistent = sum(mem[k] for k in ("weights_GiB", "grads_GiB", "master_GiB", "optimizer_GiB")) * 2.0**30
    return persistent / count_parameters(cfg.model)


LLAMA_7B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008", "--num-attention-heads", "32",
            "--seq-length", "4096", "--max-position-embeddings", "4096", "--swiglu", "--normalization", "RMSNorm",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--micro-batch-size", "1", "--global-batch-size", "1024", "--train-iters", "10", "--lr", "3e-4",
            "--mock-data", "--vocab-size", "32000", "--bf16", "--dry-run"]


def test_dry_run_estimate_meets_the_layout_targets(monkeypatch):
    """Llama2-7B at DP=256 under ZeRO-1 with Fp8AdamW <= 6.1 bytes/param persistent (2 + 4 + 6/256 =
    6.02); at ZeRO 0 the FP8 moments cut persistent state by >= 25% vs AdamW in either layout."""
    monkeypatch.setenv("WORLD_SIZE", "256")
    fp8adam = ("--deepspeed", "--zero-stage", "1", "--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128")
    # today's layout: FP32 weights and grads on every rank (DeepSpeed's FP32 partition copy is sharded)
    assert _bytes_per_param(fp8adam) == pytest.approx(4 + 4 + (4 + 2) / 256, abs=0.01)
    assert _bytes_per_param((*fp8adam, *MAIN)) == pytest.approx(2 + 4 + (4 + 2) / 256, abs=0.01)
    assert _bytes_per_param((*fp8adam, *MAIN)) <= 6.1
    monkeypatch.setenv("WORLD_SIZE", "1")
    for layout in ((), MAIN):
        adam = _bytes_per_param(layout)
        fp8 = _bytes_per_param((*layout, "--optimizer", "fp8adam"))
        assert 1 - fp8 / adam >= 0.25, (layout, adam, fp8)


# ------------------------------------------------------------------------------------------ DeepSpeed
def _ds_cfg(*switches):
    return parse_config(tiny_argv("--deepspeed", "--bf16", *MAIN, *switches))


def test_deepspeed_config_is_its_bf16_mode_with_fp32_accumulation():
    from megatron.training.deepspeed_config import DeepSpeedConfigError, build_deepspeed_config

    ds = build_deepspeed_config(_ds_cfg("--zero-stage", "1"))
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["torch_autocast"]["enabled"] is True  # the same BF16 compute as --bf16
    zero1 = {"zero_optimization": {"stage": 1}}
    for user, message in (({**zero1, "bf16": {"enabled": False}}, "`bf16.enabled` is false"),
                          ({**zero1, "data_types": {"grad_accum_dtype": "bf16"}}, "`data_types.grad_accum_dtype` is 'bf16'"),
                          ({"zero_optimization": {"stage": 0}}, "needs ZeRO stage 1, 2 or 3")):
        with pytest.raises(DeepSpeedConfigError, match=message):
            build_deepspeed_config(_ds_cfg(), user_json=user)
