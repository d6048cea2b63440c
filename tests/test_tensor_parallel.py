"""Tensor parallelism (2 processes, gloo): TP=2 equals TP=1.

One spawn of two workers runs every model-level case (the start-up of two processes costs more than all the
cases together): each rank builds the full TP=1 model and its TP=2 copy from the same weights, trains both,
and measures the relative error of its shard against the same slice of the TP=1 tensors. The tests then
assert on those numbers. Launcher-level tests (`pretrain_gpt.py` under torchrun) follow at the end.

Tolerances:
- FP32: the only differences are the order of fp32 sums (row-parallel partial sums, all-reduces), ~1e-7
  relative; Adam's division by sqrt(v) amplifies them on near-zero gradients: 1e-4 after 3 steps.
- BF16 (autocast): row-parallel partial sums are rounded to bf16 before the all-reduce (as in Megatron),
  an extra rounding of ~2^-8 relative on a few tensors: 2e-2.
- FP8 (hybrid, delayed scaling): both runs start from the same amax histories (the first delayed step has
  no history and scales each shard by its own amax, see docs/tensor_parallel.md). After that, with amaxes
  max-reduced over the TP x DP group, both quantize every tensor with the same scale, so the quantized values
  are identical except where an fp32 summation-order difference moves a value across an FP8 rounding
  boundary: measured ~3e-7. The bound, 1e-4, is two orders of magnitude below the FP8 quantization noise of
  the same model (FP8 vs FP32 logits, ~2e-2, asserted > 1e-2 so that the bound means something): scales
  that drifted apart by even one rounding would show at the noise level.
"""
from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron.arguments import parse_config
from megatron.config import ParallelConfig
from tests.conftest import REPO, tiny_argv

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ------------------------------------------------------------------------------------------------- workers
def _make_engine(model, cfg, parallel):
    from megatron.optimizer import build_optimizer
    from megatron.optimizer.lr_scheduler import LrScheduler
    from megatron.training.engine import TorchEngine

    optimizer = build_optimizer(model, cfg.optimizer)
    return TorchEngine(model, optimizer, LrScheduler(optimizer, cfg.scheduler), parallel, cfg.optimizer.clip_grad)


def _batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    tokens = torch.randint(0, 128, (4, cfg.model.seq_length), generator=g)
    labels = torch.randint(0, 128, (4, cfg.model.seq_length), generator=g)
    return tokens, labels


def _compare_case(parallel, switches: tuple, overrides: dict, sequence_parallel: bool, bf16: bool,
                  steps: int = 3) -> dict:
    """Train a TP=1 model and its TP=2 copy side by side; relative errors of this rank's shards."""
    from megatron.fp8 import convert_to_fp8, fp8_optimizer_step, fp8_state_dict, load_fp8_state_dict
    from megatron.model import GPTModel
    from megatron.parallel import parallelize_tensor, shard_state_dict
    from megatron.parallel_state import ParallelState

    sp = ("--sequence-parallel",) if sequence_parallel else ()
    drop = set(overrides.pop("drop", ()))
    argv = tiny_argv(*switches, *sp, tensor_model_parallel_size=2, clip_grad=0.05, **overrides)
    cfg = parse_config([a for a in argv if a not in drop], world_size=WORLD)
    torch.manual_seed(1234)
    ref = GPTModel(cfg.model)
    tp = copy.deepcopy(ref)
    parallelize_tensor(tp, parallel, sequence_parallel)
    if cfg.fp8 is not None:
        convert_to_fp8(ref, cfg.fp8, amax_group=parallel.data_parallel_group)  # this rank alone
        convert_to_fp8(tp, cfg.fp8, amax_group=parallel.amax_group)
    engines = {"ref": _make_engine(ref, cfg, ParallelState()), "tp": _make_engine(tp, cfg, parallel)}
    if cfg.fp8 is not None:
        # Start both from the same amax histories (those of one TP=1 pass): the first delayed-scaling step
        # has no history and scales each shard by its own amax, which would make the runs differ at the
        # level of FP8 noise from the start. From here on, scales agree only if amaxes are reduced right.
        ref(*_batch(cfg, -1)[:1], labels=_batch(cfg, -1)[1]).mean().backward()
        fp8_optimizer_step(ref)
        engines["ref"].zero_grad()
        load_fp8_state_dict(tp, cfg.fp8, fp8_state_dict(ref, cfg.fp8))
    rank, size = parallel.tensor_parallel_rank, parallel.tensor_parallel_size
    out: dict = {"loss": [], "grad_norm": [], "grad": 0.0}
    tokens, _ = _batch(cfg, 100)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out["logits_first"] = _rel(tp.eval()(tokens), ref.eval()(tokens))  # same weights: only scales can differ
    tp.train(), ref.train()
    for step in range(steps):
        tokens, labels = _batch(cfg, step)
        losses, norms, grads = {}, {}, {}
        for name, engine in engines.items():
            engine.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = engine.module(tokens, labels=labels).mean()
            engine.backward(loss)
            norms[name], _ = engine.step(step, True)
            losses[name] = loss.detach()
            grads[name] = {n: p.grad for n, p in engine.model.named_parameters()}
            if cfg.fp8 is not None:
                fp8_optimizer_step(engine.model)
        out["loss"].append(_rel(losses["tp"], losses["ref"]))
        out["grad_norm"].append(abs(norms["tp"] - norms["ref"]) / norms["ref"])
        ref_grads = shard_state_dict(grads["ref"], cfg.model, rank, size)
        out["grad"] = max(out["grad"], max(_rel(grads["tp"][n], ref_grads[n]) for n in ref_grads))
    ref_weights = shard_state_dict(ref.state_dict(), cfg.model, rank, size)
    out["weights"] = max(_rel(tp.state_dict()[n], ref_weights[n]) for n in ref_weights)
    tokens, _ = _batch(cfg, 100)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits_ref, logits_tp = ref(tokens), tp(tokens)
    out["logits"] = _rel(logits_tp, logits_ref)
    out["logits_shape_equal"] = logits_tp.shape == logits_ref.shape
    return out


def _fp8_scale_agreement(parallel, group) -> bool:
    """After one FP8 step with amaxes reduced over `group`: do both TP ranks hold the same weight scales?"""
    from megatron.fp8 import Fp8Linear, convert_to_fp8, fp8_optimizer_step
    from megatron.fp8.scaling import Fp8Role
    from megatron.model import GPTModel
    from megatron.parallel import parallelize_tensor

    cfg = parse_config(tiny_argv(tensor_model_parallel_size=2, fp8_format="hybrid"), world_size=WORLD)
    torch.manual_seed(1234)
    model = parallelize_tensor(GPTModel(cfg.model), parallel)
    convert_to_fp8(model, cfg.fp8, amax_group=group)
    tokens, labels = _batch(cfg, 0)
    model(tokens, labels=labels).mean().backward()
    fp8_optimizer_step(model)
    scales = torch.stack([m.fp8_scale[Fp8Role.WEIGHT] for m in model.modules() if isinstance(m, Fp8Linear)])
    gathered = [torch.empty_like(scales) for _ in range(WORLD)]
    dist.all_gather(gathered, scales, group=parallel.tensor_parallel_group)
    return bool(torch.equal(gathered[0], gathered[1]))


def _cross_entropy_case(parallel) -> dict:
    from megatron.parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 256, generator=g) * 4
    target = torch.randint(0, 256, (64,), generator=g)
    weight = torch.rand(64, generator=g)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, target, reduction="none")
    (ref * weight).sum().backward()
    rank = parallel.tensor_parallel_rank
    local = logits[:, rank * 128:(rank + 1) * 128].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, parallel.tensor_parallel_group)
    (loss * weight).sum().backward()
    return {"loss": _rel(loss, ref), "grad": _rel(local.grad, full.grad[:, rank * 128:(rank + 1) * 128])}


CASES = {
    # name: (switches, overrides, sequence_parallel, bf16)
    "fp32": ((), {}, False, False),
    "fp32_sp": ((), {}, True, False),
    "fp32_tied_learned_layernorm_sp": ((), {"normalization": "LayerNorm", "drop": (
        "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights")}, True, False),
    "bf16": (("--bf16",), {}, False, True),
    "fp8": ((), {"fp8_format": "hybrid"}, False, False),
    "fp8_sp": ((), {"fp8_format": "hybrid"}, True, False),
    "fp8_smooth_channel_sp": (("--smooth-swiglu",), {"fp8_format": "hybrid", "smooth_swiglu_granularity": "channel"},
                           True, False),
    "fp8_smooth_token_sp": (("--smooth-swiglu",), {"fp8_format": "hybrid", "smooth_swiglu_granularity": "token"},
                            True, False),
}


def _fp8_vs_fp32_noise(parallel) -> float:
    """Relative logits error of FP8 vs FP32 on the TP=1 model: the FP8 quantization noise to compare against."""
    from megatron.fp8 import convert_to_fp8
    from megatron.model import GPTModel

    cfg = parse_config(tiny_argv(tensor_model_parallel_size=2, fp8_format="hybrid"), world_size=WORLD)
    torch.manual_seed(1234)
    fp32 = GPTModel(cfg.model)
    fp8 = copy.deepcopy(fp32)
    convert_to_fp8(fp8, cfg.fp8, amax_group=parallel.data_parallel_group)
    tokens, _ = _batch(cfg, 100)
    with torch.no_grad():
        return _rel(fp8(tokens), fp32(tokens))


def _worker(rank: int, port: int, out_dir: str) -> None:
    from megatron.accelerator import get_accelerator
    from megatron.parallel_state import initialize_parallel_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    parallel = initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=2), get_accelerator("cpu"))
    results = {name: _compare_case(parallel, sw, dict(ov), sp, bf16) for name, (sw, ov, sp, bf16) in CASES.items()}
    results["cross_entropy"] = _cross_entropy_case(parallel)
    results["fp8_noise"] = _fp8_vs_fp32_noise(parallel)
    # Collective calls in the same order on both ranks: the DP group of a TP=2 x DP=1 world is one rank.
    results["scales_agree_tp_x_dp_group"] = _fp8_scale_agreement(parallel, parallel.amax_group)
    results["scales_agree_dp_group_only"] = _fp8_scale_agreement(parallel, parallel.data_parallel_group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


# ------------------------------------------------------------------------------------------- model tests
@pytest.mark.parametrize("case", ["fp32", "fp32_sp", "fp32_tied_learned_layernorm_sp"])
def test_tp2_equals_tp1_fp32(tp_results, case):
    for rank, results in enumerate(tp_results):
        r = results[case]
        assert r["logits_shape_equal"]
        assert max(r["loss"]) < 1e-6 and r["logits"] < 1e-5, (rank, r)
        assert r["grad"] < 1e-5 and max(r["grad_norm"]) < 1e-6, (rank, r)  # clipping active (clip 0.05)
        assert r["weights"] < 1e-4, (rank, r)


def test_tp2_equals_tp1_bf16(tp_results):
    for rank, results in enumerate(tp_results):
        r = results["bf16"]
        assert max(r["loss"]) < 2e-3 and r["logits"] < 2e-2, (rank, r)
        assert r["grad"] < 2e-2 and max(r["grad_norm"]) < 1e-2, (rank, r)
        assert r["weights"] < 2e-2, (rank, r)


def _assert_fp8_matches(results: list[dict], case: str) -> None:
    for rank, r in enumerate(results):
        noise = r["fp8_noise"]
        assert noise > 1e-2, noise  # FP8 really quantizes: the bound below is meaningful
        c = r[case]
        assert c["logits_first"] < 1e-5, (rank, c)  # same weights and histories: same scales
        assert max(c["loss"]) < 1e-4 and c["logits"] < 1e-4, (rank, c)
        assert c["grad"] < 1e-4 and max(c["grad_norm"]) < 1e-4, (rank, c)
        assert c["weights"] < 1e-4, (rank, c)


@pytest.mark.parametrize("case", ["fp8", "fp8_sp", "fp8_smooth_token_sp"])
def test_tp2_equals_tp1_fp8(tp_results, case):
    _assert_fp8_matches(tp_results, case)


def test_tp2_equals_tp1_fp8_smooth_swiglu_channel(tp_results):
    """The channel form quantizes fc2's column-scaled weight W diag(1/s) afresh at every call; its amax is
    max-reduced over the TP group so both shards use the scale of the whole weight. Measured with these
    batches: logits before any step 8e-8 (6e-3 when each shard used its own amax), losses <= 2e-7 at every
    step (6e-5). One E5M2 rounding of a layer-0 gradient flips at step 3 (an fp32 summation-order difference
    on a rounding boundary: 1.5e-2 on that gradient, 6.5e-4 on the weights after it, against 1.2e-1 and 4.5e-2
    with per-shard scales), so the training bounds sit between the two."""
    for rank, r in enumerate(tp_results):
        c = r["fp8_smooth_channel_sp"]
        assert c["logits_first"] < 1e-5 and max(c["loss"]) < 1e-6, (rank, c)
        assert c["grad"] < 5e-2 and c["weights"] < 5e-3, (rank, c)


def test_fp8_amax_reduced_over_dp_only_lets_tp_ranks_disagree(tp_results):
    for results in tp_results:
        assert results["scales_agree_tp_x_dp_group"]
        assert not results["scales_agree_dp_group_only"]


def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(tp_results):
    for results in tp_results:
        assert results["cross_entropy"]["loss"] < 1e-6
        assert results["cross_entropy"]["grad"] < 1e-6


# ---------------------------------------------------------------------------------------- launcher tests
def _pretrain(nproc: int, *extra: str) -> subprocess.CompletedProcess:
    argv = tiny_argv(*extra, micro_batch_size=2, global_batch_size=4, train_iters=4, eval_iters=1,
                     eval_interval=4, lr_warmup_iters=0, log_interval=1)
    if nproc == 1:
        cmd = [sys.executable, "pretrain_gpt.py", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), "pretrain_gpt.py", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(log: str) -> list[str]:
    return [line.split("lm loss: ")[1].split(" ")[0] for line in log.splitlines() if "lm loss: " in line]


def test_pretrain_gpt_tp2_matches_tp1(tmp_path):
    from megatron.parallel import merge_state_dicts
    from megatron.training import checkpointing as ckpt

    # The padded vocabulary is a multiple of 128 x tp: give the TP=1 run the same 256 rows.
    single = _pretrain(1, "--save", str(tmp_path / "tp1"), "--make-vocab-size-divisible-by", "256")
    tp2 = _pretrain(2, "--save", str(tmp_path / "tp2"), "--tensor-model-parallel-size", "2")
    l1, l2 = [float(x) for x in _losses(single.stderr)], [float(x) for x in _losses(tp2.stderr)]
    assert len(l1) == len(l2) == 4
    for a, b in zip(l1, l2):
        assert abs(a - b) / a < 1e-5, (l1, l2)
    full = ckpt.load_checkpoint_files(tmp_path / "tp1")["payload"]["model"]
    shards = [ckpt.load_checkpoint_files(tmp_path / "tp2", mp_rank=r)["payload"]["model"] for r in range(2)]
    assert shards[0]["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == full[
        "decoder.layers.0.mlp.linear_fc1.weight"].shape[0] // 2
    merged = merge_state_dicts(shards, parse_config(tiny_argv(), world_size=1).model)
    assert merged.keys() == full.keys()
    for key in full:
        # Adam divides by sqrt(v): gradients equal to fp32 rounding can still move a weight by ~1e-5.
        diff = (merged[key] - full[key]).abs().max()
        assert torch.allclose(merged[key], full[key], rtol=1e-3, atol=5e-5), (key, diff)


def test_tp2_fp8_sequence_parallel_resume_is_exact(tmp_path):
    from megatron.training import checkpointing as ckpt

    flags = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--fp8-format", "hybrid")
    straight = _pretrain(2, *flags, "--save", str(tmp_path / "a"), "--save-interval", "2")
    # Resume from the iteration-2 checkpoint of the same run.
    (tmp_path / "b").mkdir()
    os.rename(tmp_path / "a" / "iter_0000002", tmp_path / "b" / "iter_0000002")
    (tmp_path / "b" / ckpt.TRACKER_FILE).write_text("2")
    resumed = _pretrain(2, *flags, "--load", str(tmp_path / "b"), "--save", str(tmp_path / "c"))
    assert _losses(resumed.stderr)[:2] == _losses(straight.stderr)[2:4]
    for rank in range(2):
        a = ckpt.load_checkpoint_files(tmp_path / "a", mp_rank=rank)["payload"]
        c = ckpt.load_checkpoint_files(tmp_path / "c", mp_rank=rank)["payload"]
        for key in a["model"]:
            assert torch.equal(a["model"][key], c["model"][key]), key
        assert a["fp8"]["layers"].keys() == c["fp8"]["layers"].keys()
        for name, entry in a["fp8"]["layers"].items():
            assert torch.equal(entry["weight"]["scale"], c["fp8"]["layers"][name]["weight"]["scale"]), name

    # The same checkpoint at another tensor-parallel size is refused with the flag to fix.
    from megatron.training.loop import Trainer

    with pytest.raises(ckpt.CheckpointError, match="--tensor-model-parallel-size 2"):
        Trainer(parse_config(tiny_argv("--load", str(tmp_path / "c"), "--fp8-format", "hybrid"), world_size=1))


@pytest.mark.parametrize("overrides, switches, message", [
    (dict(num_key_value_heads=1), [], "--num-key-value-heads 1 must be divisible by --tensor-model-parallel-size 2"),
    (dict(seq_length=31, max_position_embeddings=32), ["--sequence-parallel"],
     "--sequence-parallel needs --seq-length"),
    (dict(ffn_hidden_size=171), [], "--ffn-hidden-size 171 must be divisible"),
])
def test_tensor_parallel_validation(overrides, switches, message):
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(tiny_argv(*switches, tensor_model_parallel_size=2, **overrides), world_size=2)


def test_bias_and_world_size_validation():
    argv = [a for a in tiny_argv(tensor_model_parallel_size=2) if a != "--disable-bias-linear"]
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        parse_config(argv, world_size=2)
    with pytest.raises(ValueError, match="world size 3 is not divisible"):
        parse_config(tiny_argv(tensor_model_parallel_size=2), world_size=3)
    assert not parse_config(tiny_argv("--sequence-parallel"), world_size=1).parallel.sequence_parallel
