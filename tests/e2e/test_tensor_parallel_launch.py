"""Tensor parallelism (2 processes, gloo): TP=2 equals TP=1.

One spawn of two workers runs every model-level case (the start-up of two processes costs more than all the
cases together): each rank builds the full TP=1 model and its TP=2 copy from the same weights, trains both,
and measures the relative error of its shard against the same slice of the TP=1 tensors. The tests then
assert on those numbers. Launcher-level tests (`pretrain_gpt.py` under torchrun) follow at the end.

Tolerances come from the noise of the same run, never from constants measured on one CPU (summation
orders differ between ISAs: AVX-512 and AVX2 kernels block their sums differently). Each case trains a third
model next to TP=1 and TP=2 that shows the size of its rounding noise, and the TP error is bounded by it:
- "FP32" cases run in float64, end to end (norms, RoPE, cross-entropy and gradient norm compute in at least
  the input's precision). TP sums in another order: a reordered sum of n terms moves by up to ~n float64 ulps;
  the control is TP=1 with every weight moved by up to n = hidden-size float64 ulps, such a difference from
  the start.
- BF16 (autocast): the control is the float64 run; TP's extra bf16 roundings (partial sums before the
  all-reduce) are of the same kind as BF16's own, so the TP error stays within a few times BF16's error.
- FP8 (hybrid, delayed scaling): the control is TP=2 with each shard scaled by its own amax (amaxes reduced
  over DP only: a TP scale bug). The correct run starts from the TP=1 histories and, with amaxes reduced
  over TP x DP, quantizes every tensor with the TP=1 scales: its values differ only where an fp32
  summation-order difference crosses an FP8 rounding boundary, far fewer than the control's.
"""
from __future__ import annotations

import copy
import os
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.arguments import parse_config
from megatron.config import ParallelConfig
from tests.support import forkserver
from tests.support.config import tiny_argv
from tests.support.launch import free_port, launch_checked
from tests.support.logs import printed_losses as _losses
from tests.support.processes import init_gloo
from tests.support.run_noise import printed_unit, relative_error
from tests.support.tensor_parallel import batch, errors, train_side_by_side

WORLD = 2


# ------------------------------------------------------------------------------------------------- workers
def _compare_case(parallel, switches: tuple, overrides: dict, sequence_parallel: bool, precision: str,
                  steps: int = 3) -> dict:
    """Train a TP=1 model and its TP=2 copy side by side (plus the case's noise reference, see the module
    docstring); the relative errors of this rank's shards."""
    from megatron.fp8 import convert_to_fp8, fp8_optimizer_step, fp8_state_dict, load_fp8_state_dict
    from megatron.model import GPTModel
    from megatron.parallel import parallelize_tensor

    sp = ("--sequence-parallel",) if sequence_parallel else ()
    drop = set(overrides.pop("drop", ()))
    argv = tiny_argv(*switches, *sp, tensor_model_parallel_size=2, clip_grad=0.05, **overrides)
    cfg = parse_config([a for a in argv if a not in drop], world_size=WORLD)
    torch.manual_seed(1234)
    base = GPTModel(cfg.model)

    def tp_copy(model):
        return parallelize_tensor(copy.deepcopy(model), parallel, sequence_parallel)

    if precision == "fp64":
        ref = base.double()
        # The noise reference: TP=1 again, every weight moved by up to `hidden` float64 ulps (hidden x 2^-52
        # relative), the size of the differences TP's reordered sums (of up to ~hidden terms per output) give;
        # what follows shows how far such differences grow in this run.
        control = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            ulps = cfg.model.hidden_size * 2.0**-52
            for p in control.parameters():
                p.mul_(1 + (torch.rand(p.shape, generator=g, dtype=p.dtype) * 2 - 1) * ulps)
        models, bf16 = {"ref": ref, "tp": tp_copy(ref), "control": control}, {n: False for n in ("ref", "tp", "control")}
    elif precision == "bf16":
        models = {"ref": base, "tp": tp_copy(base), "exact": copy.deepcopy(base).double()}
        bf16 = {"ref": True, "tp": True, "exact": False}
    else:  # fp8
        ref, tp, control = base, tp_copy(base), tp_copy(base)
        convert_to_fp8(ref, cfg.fp8, amax_group=parallel.data_parallel_group)  # this rank alone
        convert_to_fp8(tp, cfg.fp8, amax_group=parallel.amax_group)
        # The noise reference: each shard scaled by its own amax (the DP-only group, no TP reduction) and
        # no shared start; a TP scale bug would look like this.
        convert_to_fp8(control, cfg.fp8, amax_group=parallel.data_parallel_group)
        # Start the TP model from the histories of one TP=1 pass: the first delayed-scaling step has no
        # history and scales each shard by its own amax. From here on, scales agree only if amaxes are
        # reduced over the TP group.
        tokens, labels = batch(cfg, -1)
        ref(tokens, labels=labels).mean().backward()
        fp8_optimizer_step(ref)
        for p in ref.parameters():
            p.grad = None
        load_fp8_state_dict(tp, cfg.fp8, fp8_state_dict(ref, cfg.fp8))
        models, bf16 = {"ref": ref, "tp": tp, "control": control}, {n: False for n in ("ref", "tp", "control")}
    traces = train_side_by_side(parallel, cfg, models, {"tp"} | ({"control"} if precision == "fp8" else set()),
                                bf16, steps)
    out = {"tp": errors(traces["tp"], traces["ref"])}
    if "exact" in traces:
        out["noise"] = errors(traces["ref"], traces["exact"])
    if "control" in traces:
        out["noise"] = errors(traces["control"], traces["ref"])
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
    tokens, labels = batch(cfg, 0)
    model(tokens, labels=labels).mean().backward()
    fp8_optimizer_step(model)
    scales = torch.stack([m.fp8_scale[Fp8Role.WEIGHT] for m in model.modules() if isinstance(m, Fp8Linear)])
    gathered = [torch.empty_like(scales) for _ in range(WORLD)]
    dist.all_gather(gathered, scales, group=parallel.tensor_parallel_group)
    return bool(torch.equal(gathered[0], gathered[1]))


def _cross_entropy_case(parallel) -> dict:
    from megatron.parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 256, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, 256, (64,), generator=g)
    weight = torch.rand(64, generator=g, dtype=torch.float64)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, target, reduction="none")
    (ref * weight).sum().backward()
    rank = parallel.tensor_parallel_rank
    local = logits[:, rank * 128:(rank + 1) * 128].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, parallel.tensor_parallel_group)
    (loss * weight).sum().backward()
    return {"loss": relative_error(loss, ref),
            "grad": relative_error(local.grad, full.grad[:, rank * 128:(rank + 1) * 128])}


CASES = {
    # name: (switches, overrides, sequence_parallel, precision)
    "fp32": ((), {}, False, "fp64"),
    "fp32_sp": ((), {}, True, "fp64"),
    "fp32_tied_learned_layernorm_sp": ((), {"normalization": "LayerNorm", "drop": (
        "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights")}, True, "fp64"),
    "bf16": (("--bf16",), {}, False, "bf16"),
    "fp8": ((), {"fp8_format": "hybrid"}, False, "fp8"),
    "fp8_sp": ((), {"fp8_format": "hybrid"}, True, "fp8"),
    "fp8_smooth_channel_sp": (("--smooth-swiglu",), {"fp8_format": "hybrid", "smooth_swiglu_granularity": "channel"},
                              True, "fp8"),
    "fp8_smooth_token_sp": (("--smooth-swiglu",), {"fp8_format": "hybrid", "smooth_swiglu_granularity": "token"},
                            True, "fp8"),
}


def _worker(rank: int, port: int, out_dir: str) -> None:
    from megatron.accelerator import get_accelerator
    from megatron.parallel_state import initialize_parallel_state

    torch.set_num_threads(1)
    init_gloo(rank, port, WORLD)
    parallel = initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=2), get_accelerator("cpu"))
    results = {name: _compare_case(parallel, sw, dict(ov), sp, precision)
               for name, (sw, ov, sp, precision) in CASES.items()}
    results["cross_entropy"] = _cross_entropy_case(parallel)
    # Collective calls in the same order on both ranks: the DP group of a TP=2 x DP=1 world is one rank.
    results["scales_agree_tp_x_dp_group"] = _fp8_scale_agreement(parallel, parallel.amax_group)
    results["scales_agree_dp_group_only"] = _fp8_scale_agreement(parallel, parallel.data_parallel_group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    forkserver.spawn(_worker, (free_port(), str(out)), WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


# ------------------------------------------------------------------------------------------- model tests
_QUANTITIES = ("loss", "grad_norm", "grad", "grad_all", "weights", "weights_all", "logits_first", "logits")


def _worst(value) -> float:
    return max(value) if isinstance(value, list) else value


def _assert_within(results: list[dict], case: str, bound) -> None:
    """Every quantity of the TP=2 run against TP=1 stays within `bound(quantity, noise)`."""
    for rank, results_of_rank in enumerate(results):
        r = results_of_rank[case]
        assert r["tp"]["logits_shape_equal"]
        for q in _QUANTITIES:
            err, noise = _worst(r["tp"][q]), _worst(r["noise"][q])
            assert err <= bound(q, noise), (rank, q, err, noise)


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("case", ["fp32", "fp32_sp", "fp32_tied_learned_layernorm_sp"])
def test_tp2_equals_tp1_fp32(tp_results, case):
    # Twice the control (two runs' rounding differences add up), plus 8 float64 ulps for the loss and grad norm,
    # which can differ by their own final roundings whatever the inputs.
    _assert_within(tp_results, case, lambda q, noise: 2 * noise + 8 * 2.0**-53)


@pytest.mark.isa_sensitive
def test_tp2_equals_tp1_bf16(tp_results):
    # TP rounds each row-parallel partial sum to bf16 before the all-reduce and the sum after it: up to three
    # bf16 roundings where TP=1 has one, so |tp - ref| <= |tp - exact| + |ref - exact| is about 4 x noise.
    _assert_within(tp_results, "bf16", lambda q, noise: 4 * noise)


def _fp8_bound(q: str, noise: float) -> float:
    if q == "logits_first":
        # Same weights and scales, no step yet: only where an fp32 summation-order difference crosses an FP8
        # rounding boundary can a value differ. k such flips among N values give ~sqrt(k/N) x the error of
        # re-rounding all N (the control); 1/32 allows one value in a thousand.
        return noise / 32
    # After steps, Adam can amplify an isolated flip for the rest of the run; a scale bug re-rounds everything
    # at every step, which is the control's error (ratio 1). Half of it separates the two.
    return noise / 2


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("case", ["fp8", "fp8_sp", "fp8_smooth_token_sp", "fp8_smooth_channel_sp"])
def test_tp2_equals_tp1_fp8(tp_results, case):
    """The channel form of Smooth-SwiGLU quantizes fc2's column-scaled weight W diag(1/s) afresh at every call;
    its amax is max-reduced over the TP group so both shards use the scale of the whole weight."""
    for results in tp_results:
        assert results[case]["noise"]["logits_first"] > 1e-3  # FP8 really quantizes: the control is noise
    _assert_within(tp_results, case, _fp8_bound)


def test_fp8_amax_reduced_over_dp_only_lets_tp_ranks_disagree(tp_results):
    for results in tp_results:
        assert results["scales_agree_tp_x_dp_group"]
        assert not results["scales_agree_dp_group_only"]


def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(tp_results):
    # float64 logits computed in float64: a few roundings (2^-53) of a log-sum-exp and a softmax, whose sums the
    # vocab split reorders; 64 ulps is far below any real error (a wrong max or sum is O(1)).
    for results in tp_results:
        assert results["cross_entropy"]["loss"] < 64 * 2.0**-53
        assert results["cross_entropy"]["grad"] < 64 * 2.0**-53


# ---------------------------------------------------------------------------------------- launcher tests
def _pretrain(nproc: int, *extra: str) -> subprocess.CompletedProcess:
    argv = tiny_argv(*extra, micro_batch_size=2, global_batch_size=4, train_iters=4, eval_iters=1,
                     eval_interval=4, lr_warmup_iters=0, log_interval=1)
    return launch_checked(nproc, argv, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout_tail=0, stderr_tail=3000)


def _adam_update_bound(beta1: float, beta2: float, steps: int) -> list[float]:
    """Per step t, the largest |m_hat_t| / sqrt(v_hat_t) Adam can produce, whatever the gradients.

    m_hat_t = sum_i a_i g_i and v_hat_t = sum_i b_i g_i^2 with a_i = (1-beta1) beta1^(t-i) / (1-beta1^t) and
    b_i = (1-beta2) beta2^(t-i) / (1-beta2^t); by Cauchy-Schwarz |m_hat| <= sqrt(sum a_i^2 / b_i) sqrt(v_hat).
    """
    out = []
    for t in range(1, steps + 1):
        a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t) for i in range(1, t + 1)]
        b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t) for i in range(1, t + 1)]
        out.append(sum(x * x / y for x, y in zip(a, b)) ** 0.5)
    return out


def test_pretrain_gpt_tp2_matches_tp1(tmp_path):
    """The CLI's TP=2 run (torchrun, sharded checkpoints, merge) against TP=1, with bounds from the arithmetic.

    TP=2 equals TP=1 exactly in real arithmetic; that is asserted in float64 over several training steps by
    `test_tp2_equals_tp1_fp32` above. Here, in fp32 through the launcher, the runs differ by
    summation order only, on any CPU:
    - loss 1 (identical weights): each GEMM on the path from the weights to the loss (per layer qkv, QK^T, PV,
      proj, fc1, fc2; then the output layer) adds a relative error of at most ~K u32 (K its inner size); to
      first order these add up, so |l2 - l1| <= n_gemms K_max u32 |l1| plus a printed unit.
    - the weights after two Adam steps: Adam's normalised update |m_hat / (sqrt(v_hat) + eps)| is at most
      `_adam_update_bound` per element whatever the gradients, so two runs whose gradients differ by rounding
      (even in sign) are at most 2 lr that far apart per step, plus the decoupled weight decay of the
      difference so far and a few fp32 ulps of the weight. A mis-sharded or mis-merged tensor moves by the
      init scale (0.02) in most of its elements, far outside it.
    - loss 2 is bounded like loss 1: the first update differs only where a gradient is within its rounding
      error of zero, and those elements change the next loss by second-order amounts.
    """
    from megatron.parallel import merge_state_dicts
    from megatron.checkpoint import store as ckpt

    # The padded vocabulary is a multiple of 128 x tp: give the TP=1 run the same 256 rows.
    single = _pretrain(1, "--save", str(tmp_path / "tp1"), "--make-vocab-size-divisible-by", "256",
                       "--train-iters", "2", "--eval-interval", "2")
    tp2 = _pretrain(2, "--save", str(tmp_path / "tp2"), "--tensor-model-parallel-size", "2",
                    "--train-iters", "2", "--eval-interval", "2")
    l1, l2 = [float(x) for x in _losses(single.stderr)], [float(x) for x in _losses(tp2.stderr)]
    assert len(l1) == len(l2) == 2
    cfg = parse_config(tiny_argv(), world_size=1)
    m = cfg.model
    k_max = max(m.hidden_size, m.ffn_hidden_size, m.seq_length, m.hidden_size // m.num_attention_heads)
    n_gemms = 6 * m.num_layers + 1
    for a, b in zip(l2, l1):
        unit = max(printed_unit(a), printed_unit(b))
        assert abs(a - b) <= n_gemms * k_max * 2.0 ** -24 * abs(b) + 2 * unit, (l2, l1)

    full = ckpt.load_checkpoint_files(tmp_path / "tp1")["payload"]["model"]
    shards = [ckpt.load_checkpoint_files(tmp_path / "tp2", mp_rank=r)["payload"]["model"] for r in range(2)]
    assert shards[0]["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == full[
        "decoder.layers.0.mlp.linear_fc1.weight"].shape[0] // 2
    merged = merge_state_dicts(shards, m)
    o = cfg.optimizer
    bound = 0.0
    for c in _adam_update_bound(o.adam_beta1, o.adam_beta2, 2):
        bound = bound * (1 + o.lr * o.weight_decay) + 2 * o.lr * c  # lr_t <= lr (no warm-up, then decay)
    assert merged.keys() == full.keys()
    for key, ref in full.items():
        diff = (merged[key].double() - ref.double()).abs()
        slack = bound + 4 * 2.0 ** -23 * ref.double().abs()
        assert bool((diff <= slack).all()), (key, float(diff.max()), bound)
    # The bound is tight enough to see a sharding mistake: two rows of the TP=1 weight swapped.
    w = full["decoder.layers.0.mlp.linear_fc1.weight"].double()
    assert float((w[[1, 0]] - w[:2]).abs().max()) > bound + 4 * 2.0 ** -23 * float(w.abs().max())


def test_tp2_fp8_sequence_parallel_resume_is_exact(tmp_path):
    from megatron.checkpoint import store as ckpt

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

    # At another tensor-parallel size it is resharded (tests/e2e/test_reshard.py), keeping the padded vocabulary (a
    # multiple of 128 x TP); an explicit --make-vocab-size-divisible-by that would change it is refused, naming the
    # value that keeps it.
    from megatron.training.loop import Trainer

    with pytest.raises(ckpt.CheckpointError, match="--make-vocab-size-divisible-by 256"):
        Trainer(parse_config(tiny_argv("--load", str(tmp_path / "c"), "--fp8-format", "hybrid",
                                       "--make-vocab-size-divisible-by", "128"), world_size=1))


def test_swiglu_diagnostics_are_the_whole_layers_under_tp_and_dp(tmp_path):
    """The first logged iteration's SwiGLU statistics (the same initial weights, kept by a zero learning rate, and
    the same 4 samples in every layout) agree between one process, TP=2 (each rank holds half of fc1's channels) and DP=2 (each replica sees
    half of the batch): the maxima are reduced over the replicas and the channels gathered over the TP ranks.
    The alignment statistics read identical weights: equal. The activations go through GEMMs whose sums TP splits
    differently (row-parallel partial sums): within the rounding bound of the loss test above, twice for the
    ratio of two maxima. Before the reductions each TP rank saw half the channels, each replica half the batch."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def first_values(name: str, nproc: int, *extra: str) -> dict[str, float]:
        _pretrain(nproc, "--tensorboard-dir", str(tmp_path / name), "--make-vocab-size-divisible-by", "256",
                  "--train-iters", "1", "--eval-iters", "0", "--lr", "0", "--min-lr", "0", *extra)
        acc = EventAccumulator(str(tmp_path / name))
        acc.Reload()
        return {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]
                if tag.startswith("swiglu/") and not tag.endswith(" vs tokens")}

    single = first_values("tp1", 1)
    tp2 = first_values("tp2", 2, "--tensor-model-parallel-size", "2")
    dp2 = first_values("dp2", 2)
    m = parse_config(tiny_argv(), world_size=1).model
    bound = (6 * m.num_layers + 1) * max(m.hidden_size, m.ffn_hidden_size, m.seq_length) * 2.0 ** -24
    assert len(single) == 10 and single.keys() == tp2.keys() == dp2.keys()
    for tag, want in single.items():
        for got in (tp2[tag], dp2[tag]):
            if "/align" in tag:
                assert got == want, (tag, got, want)
            else:  # act_max, outlier_ratio (TensorBoard keeps float32: one more fp32 rounding)
                assert abs(got - want) <= (2 * bound + 2.0 ** -23) * abs(want), (tag, got, want)
