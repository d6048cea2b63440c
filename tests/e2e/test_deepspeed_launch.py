"""DeepSpeed on CPU (gloo, 2 processes): ZeRO equals the torch path, exact resume, Fp8AdamW, BF16.

Every DeepSpeed run is a subprocess (DeepSpeed keeps process-global state: the process group, its
communication backend), each on its own free port (tests/support/launch.py). Runs shared by several tests are
module fixtures; the torch engine's reference and its noise control are session fixtures (tests/conftest.py).
"""
import json
import math
import re

import pytest
import torch

from megatron.checkpoint import store as ckpt
from megatron.checkpoint.deepspeed_io import deepspeed_safe_globals
from tests.support.flags import EAGER_FP8ADAM as EAGER
from tests.support.launch import run
from tests.support.logs import losses
from tests.support.run_noise import assert_losses_within_noise, assert_weights_within_noise

pytest.importorskip("deepspeed")


def ds_weights(save_dir) -> dict:
    """Module weights of a DeepSpeed (ZeRO 0-2) checkpoint; the file holds tensors and plain data only."""
    folder = ckpt.iteration_dir(save_dir, ckpt.read_tracker(save_dir))
    return torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["module"]


def torch_weights(save_dir) -> dict:
    return ckpt.load_checkpoint_files(save_dir)["payload"]["model"]


@pytest.fixture(scope="module")
def zero1(deepspeed_zero1):
    """DeepSpeed ZeRO-1, 2 processes: 2 micro-batches of 2 per rank per step (tests/conftest.py, shared with
    test_launchers)."""
    log, save = deepspeed_zero1
    return losses(log), save


# ----------------------------------------------------------------------------- equivalence
# The paths add the same fp32 gradients in another order (per-rank halves, then an all-reduce; DeepSpeed's own
# gradient-norm code), so they differ by rounding that the steps amplify: bounded by the `control` run's.
@pytest.mark.isa_sensitive
def test_zero1_dp2_equals_single_process_with_double_accumulation(torch_reference, torch_control, zero1):
    (l_ref, w_ref), (l_ds, save), control = torch_reference, zero1, torch_control
    assert len(l_ref) == len(l_ds) == 4
    assert_losses_within_noise(l_ds, l_ref, control[0])
    assert_weights_within_noise(ds_weights(save), w_ref, control[1])


@pytest.mark.isa_sensitive
def test_zero2_dp2_equals_single_process_with_double_accumulation(torch_reference, torch_control, tmp_path):
    (l_ref, w_ref), control = torch_reference, torch_control
    l_ds = losses(run(2, "--deepspeed", "--zero-stage", "2", save=tmp_path / "z2"))
    assert_losses_within_noise(l_ds, l_ref, control[0])
    assert_weights_within_noise(ds_weights(tmp_path / "z2"), w_ref, control[1])


@pytest.mark.isa_sensitive
def test_zero0_single_process_equals_torch_path(torch_reference, torch_control, tmp_path):
    # Same process count, same accumulation order: only the clipping code differs (DeepSpeed's
    # clip_grad_norm_ sums squared per-tensor norms; same formula max/(norm+1e-6) as torch).
    (l_ref, w_ref), control = torch_reference, torch_control
    l_ds = losses(run(1, "--deepspeed", save=tmp_path / "z0"))
    assert_losses_within_noise(l_ds, l_ref, control[0])
    assert_weights_within_noise(ds_weights(tmp_path / "z0"), w_ref, control[1])


# ------------------------------------------------------------------------------- checkpoints
def test_resume_at_the_same_layout_is_exact(zero1, tmp_path):
    l_full, full_save = zero1
    save = tmp_path / "ckpt"
    first = losses(run(2, "--deepspeed", "--zero-stage", "1", save=save, exit_interval=2))
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (save / "latest").read_text() == "iter_0000002"
    folder = save / "iter_0000002"
    names = {p.name for p in folder.iterdir()}
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt", "train_state.json", "config.json"} <= names
    assert not list(save.glob(".tmp_iter_*"))
    client = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["megatron"]
    assert {"lr_scheduler", "rng_state"} <= client.keys()
    assert json.loads((folder / "train_state.json").read_text())["consumed_train_samples"] == 16
    second = losses(run(2, "--deepspeed", "--zero-stage", "1", save=save, load=save))
    assert first + second == l_full  # printed values identical, not just close
    for key, value in ds_weights(full_save).items():
        assert torch.equal(value, ds_weights(save)[key]), key


def test_a_torch_checkpoint_resumes_under_deepspeed(torch_reference_save, tmp_path):
    """Switching engines between jobs: a torch checkpoint (the session's torch_reference, iteration 4) loads into
    ZeRO-1 through resharding (weights exact)."""
    torch_save, ds_save = torch_reference_save, tmp_path / "d"
    log = run(1, "--deepspeed", "--zero-stage", "1", load=torch_save, save=ds_save, eval_iters=0)
    assert "resharded" in log
    loaded = ds_weights(ds_save)  # saved straight after loading (no step: --train-iters is the loaded iteration)
    for key, value in torch_weights(torch_save).items():
        assert torch.equal(loaded[key], value), key


# ------------------------------------------------------------------------- optimizer, precision
FP8ADAM = ("--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128")


# The torch-engine runs step with the eager Fp8AdamW (tests/support/flags.py says why that keeps the bounds), the
# ZeRO-1 run with the compiled kernel (the default).
EAGER_FP8ADAM = (*FP8ADAM, *EAGER)


@pytest.fixture(scope="module")
def fp8adam_runs(tmp_path_factory):
    """FP8 linears + Fp8AdamW, 8 iterations: ZeRO-1 on 2 ranks (log, save dir), the torch engine in one process on
    the same 8 samples per step, and its noise control with micro-batches of 1 (tests/support/run_noise.py)."""
    save = tmp_path_factory.mktemp("fp8adam_zero1")
    log = run(2, "--deepspeed", "--zero-stage", "1", *FP8ADAM, "--fp8-format", "hybrid", save=save, train_iters=8,
              eval_iters=0)
    torch_fp8 = losses(run(1, *EAGER_FP8ADAM, "--fp8-format", "hybrid", train_iters=8, eval_iters=0))
    control = losses(run(1, *EAGER_FP8ADAM, "--fp8-format", "hybrid", train_iters=8, eval_iters=0,
                         micro_batch_size=1))
    return log, save, torch_fp8, control


@pytest.mark.isa_sensitive
def test_fp8adam_and_fp8_linears_under_zero1_track_the_torch_engine(fp8adam_runs):
    """FP8 linears + Fp8AdamW under ZeRO-1 (2 ranks) against the same run on the torch engine (1 process, the
    same 8 samples per step), within the run's own noise (tests/support/run_noise.py): the control is the torch run with
    micro-batches of 1. The correct DeepSpeed run differs only where summation order flips a rounding (FP8 GEMM
    inputs, Fp8AdamW moments of its partitions), which in FP8 moves a value by a whole FP8 step: as much as the
    control's reordering does, and of the order of the FP8 linears' whole effect in this short run (measured
    0.2x and 0.9x of it under two initializations), so that effect is no bound. A DeepSpeed run whose FP8 weights
    went their own way is far outside: skipping `fp8_optimizer_step` (the stale FP8 weight cache after
    DeepSpeed's update) moved the losses by 0.04-0.15, against a bound of ~4e-3."""
    log, _, torch_fp8, control = fp8adam_runs
    ls = losses(log)
    assert len(ls) == 8 and all(math.isfinite(x) for x in ls)
    assert_losses_within_noise(ls, torch_fp8, control)
    assert ls[-1] < ls[0] - 0.4, ls


def test_fp8adam_and_fp8_linears_under_zero1_state(fp8adam_runs):
    """The comparison above is not vacuous (the FP8 linears really quantize), and the ZeRO-1 run's optimizer
    states and checkpoint are FP8 where they should be. (Not isa_sensitive: a one-process run without FP8 linears
    is far from the FP8 one under any kernels, and the rest is layout.)"""
    log, save, torch_fp8, _ = fp8adam_runs
    torch_no_fp8_linears = losses(run(1, *EAGER_FP8ADAM, train_iters=8, eval_iters=0))
    distance = sum(abs(x - y) for x, y in zip(torch_fp8, torch_no_fp8_linears, strict=True)) / len(torch_fp8)
    assert distance > 1e-4  # the FP8 linears really quantize
    # ZeRO hands Fp8AdamW one flat partition per group: the matrix group keeps FP8 states, the vector one FP32.
    # Each rank's partition holds half of the matrix elements (90,112 in the unwrapped optimizer).
    assert re.search(r"Fp8AdamW: m=e4m3/block128 v=e5m2/block128 states for 1 tensors \(45,056 params\); "
                     r"FP32 states for 1 tensors", log), log[-3000:]
    client = torch.load(save / "iter_0000008" / "mp_rank_00_model_states.pt", weights_only=True)["megatron"]
    assert "fp8" in client
    with torch.serialization.safe_globals(deepspeed_safe_globals()):  # our loader's allowlist suffices
        optim = torch.load(save / "iter_0000008" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                           weights_only=True)["optimizer_state_dict"]["base_optimizer_state"]
    moments = [s["exp_avg"].dtype for s in optim["state"].values()]
    assert torch.float8_e4m3fn in moments and torch.float32 in moments


@pytest.mark.parametrize("stage", ["0", "2"])
def test_fp8adam_trains_under_zero_0_and_2(stage):
    # ZeRO-0 steps with the eager kernel: the compiled one runs under ZeRO-0 in test_deepspeed_tp_launch.py
    # (bit for bit with the torch engine), under ZeRO-1 above and under ZeRO-2 here.
    log = run(2, "--deepspeed", "--zero-stage", stage, "--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128",
              *(EAGER if stage == "0" else ()), train_iters=8, eval_iters=0)
    ls = losses(log)
    assert len(ls) == 8 and all(math.isfinite(x) for x in ls)
    assert ls[-1] < ls[0] - 0.4, ls
    assert "Fp8AdamW: m=e4m3/block128 v=e5m2/block128" in log


@pytest.mark.isa_sensitive
def test_bf16_user_json_trains_in_autocast(torch_reference):
    l_ref, _ = torch_reference
    log = run(2, "--deepspeed", "--deepspeed_config", "examples/ds_config_zero1_bf16.json", "--bf16")
    ls = losses(log)
    assert "ZeRO stage 1, BF16 autocast" in log
    assert ls[-1] < ls[0] - 0.3, ls
    rel = [abs(a - b) / b for a, b in zip(ls, l_ref, strict=True)]
    assert max(rel) < 0.02, rel  # tracks the FP32 run ...
    assert max(rel) > 1e-6, rel  # ... but is not it: autocast is on


NAN_SCRIPT = r'''
import os, sys, json, torch
sys.path.insert(0, os.getcwd())
from megatron.arguments import parse_config
from megatron.training.loop import Trainer
trainer = Trainer(parse_config(sys.argv[1:]))
rank = int(os.environ.get("RANK", "0"))
real_forward, real_step = trainer._forward_loss, trainer.engine.step
calls, report = {"n": 0}, []

def forward(model, batch):  # iteration 2, last rank only: the loss is NaN but its gradients are finite
    calls["n"] += 1
    masked, count = real_forward(model, batch)
    if (calls["n"] - 1) // trainer.config.training.num_micro_batches + 1 == 2 and rank == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        masked = masked + (float("nan") - masked.detach())
    return masked, count

def snapshot():
    w = [p.detach().clone() for p in trainer.model.parameters()]
    s = [t.clone() for st in trainer.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    return w + s

def step(iteration, loss_finite):
    before = snapshot()
    norm, stepped = real_step(iteration, loss_finite)
    same = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    report.append({"iteration": iteration + 1, "loss_finite": bool(loss_finite), "stepped": stepped, "unchanged": same})
    return norm, stepped

trainer._forward_loss, trainer.engine.step = forward, step
result = trainer.train()
# One file per rank next to this script: two ranks printing to one pipe can interleave their lines.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"report_{rank}.json"), "w") as f:
    json.dump({"rank": rank, "steps": report, "skipped": result.state.skipped_iterations}, f)
from megatron.parallel_state import finish_distributed_run
finish_distributed_run(0)  # as pretrain_gpt.py ends a multi-process run
'''


@pytest.mark.parametrize("nproc, stage", [(1, "0"), (2, "1")])
def test_non_finite_loss_skips_the_step_without_changing_anything(tmp_path, nproc, stage):
    script = tmp_path / "nan_run.py"
    script.write_text(NAN_SCRIPT)
    run(nproc, "--deepspeed", "--zero-stage", stage, script=str(script), train_iters=3, eval_iters=0)
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("report_*.json"))]
    assert len(reports) == nproc
    for r in reports:  # every rank skips, also the one whose own loss was finite
        assert r["skipped"] == 1
        assert [(s["stepped"], s["unchanged"]) for s in r["steps"]] == [(True, False), (False, True), (True, False)]
