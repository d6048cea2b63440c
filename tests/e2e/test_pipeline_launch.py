"""Pipeline parallelism (DeepSpeed PipelineModule, 2 stages x 1 replica, gloo on CPU): PP=2 equals PP=1.

PP=1 is the same DeepSpeed ZeRO-1 (or ZeRO-0) run in one process (4 micro-batches of 2 per step, as the pipeline's).
Without dropout the two compute the same math, but not in the same order: the gradient norm (clipping) is
summed per stage and then over stages, and a stage boundary can change how a kernel blocks its sums. So the
runs differ by rounding that the steps amplify, bounded by the noise of the run itself (tests/support/run_noise.py):
the control is PP=1 on two data-parallel ranks, the same micro-batches (hence the same FP8 amaxes and
Smooth-SwiGLU scales) with the gradients summed in yet another order. With BF16 autocast and Fp8AdamW the
ZeRO-1 partition, hence Fp8AdamW's per-partition moment scale, is per stage under PP and per rank in the
control: differences of the same kind again. Resuming at the same layout repeats the same operations: exact.
"""
import pytest

from tests.support.launch import run
from tests.support.logs import values
from tests.support.run_noise import assert_losses_within_noise

pytest.importorskip("deepspeed")

PP = ("--deepspeed", "--zero-stage", "1")
FP8 = ("--smooth-swiglu",)
FP8_OVERRIDES = dict(fp8_format="hybrid", eval_interval=2)


def pp1_and_control(*argv: str, **overrides) -> tuple[list[float], list[float]]:
    """PP=1 in one process, and its noise control: PP=1 on two data-parallel ranks."""
    return values(run(1, *argv, **overrides)), values(run(2, *argv, **overrides))


@pytest.fixture(scope="module")
def fp8_pp1():
    return pp1_and_control(*PP, *FP8, **FP8_OVERRIDES)


@pytest.fixture(scope="module")
def fp8_pp2(tmp_path_factory):
    save = tmp_path_factory.mktemp("pp2")
    log = run(2, *PP, *FP8, "--pipeline-model-parallel-size", "2", save=save, **FP8_OVERRIDES)
    return values(log), save, log


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("stage", ["0", "1"])
def test_pp2_equals_pp1_fp32(stage, pp2_fp32_log):
    """ZeRO 0: our step guard clips and checks (clip 0.05 is active); ZeRO 1: DeepSpeed's optimizer does.
    The PP = 2 run is tests/conftest.py's `pp2_fp32_log`, shared with test_upstream_scripts_launch."""
    zero = ("--deepspeed", "--zero-stage", stage)
    one, control = pp1_and_control(*zero, eval_interval=2, clip_grad=0.05)
    two = values(pp2_fp32_log(stage))
    assert_losses_within_noise(two, one, control)


@pytest.mark.isa_sensitive
def test_pp2_equals_pp1_fp8_smooth_swiglu(fp8_pp1, fp8_pp2):
    one, control = fp8_pp1
    assert_losses_within_noise(fp8_pp2[0], one, control)
    assert fp8_pp2[0][3] < fp8_pp2[0][0]  # it trains


def test_pp2_stages_hold_their_layers(fp8_pp2):
    _, save, log = fp8_pp2
    assert "pipeline stage 0 of 2: layers 0..1 of 3" in log  # the embedding and the first transformer layer
    folder = next(save.glob("iter_*"))
    names = sorted(p.name for p in folder.iterdir())
    # one file per pipeline layer (embedding, 2 transformer layers, head), one model-states file per stage
    assert [n for n in names if n.startswith("layer_")] == [f"layer_{i:02d}-model_00-model_states.pt" for i in range(4)]
    assert "mp_rank_00_model_states.pt" in names and "mp_rank_01_model_states.pt" in names


def test_pp2_resume_at_the_same_layout_continues_the_run(tmp_path, fp8_pp2):
    save = tmp_path / "ckpt"
    argv = (*PP, *FP8, "--pipeline-model-parallel-size", "2")
    first = values(run(2, *argv, save=save, exit_interval=2, **FP8_OVERRIDES))
    second = values(run(2, *argv, save=save, load=save, **FP8_OVERRIDES))
    full = fp8_pp2[0]  # train 1-4, then valid@2, valid@4, test
    # The same operations in the same order as the uninterrupted run: the printed values are identical.
    assert first == full[:2] + full[4:5]  # train 1-2, valid@2, then the exit (no test)
    assert second == full[2:4] + full[5:]  # weights, optimizer, FP8 scales and data position restored


@pytest.mark.isa_sensitive
def test_pp2_bf16_fp8adam_tracks_pp1():
    # Fp8AdamW eager (compiling costs seconds per process): each stage steps through the same DeepSpeed ZeRO-1
    # optimizer as test_deepspeed_launch.py's test_fp8adam_and_fp8_linears_under_zero1_track_the_torch_engine, which
    # runs the compiled kernel.
    argv = (*PP, *FP8, "--bf16", "--optimizer", "fp8adam", "--no-fp8-optimizer-compile")
    one, control = pp1_and_control(*argv, **FP8_OVERRIDES)
    two = values(run(2, *argv, "--pipeline-model-parallel-size", "2", **FP8_OVERRIDES))
    assert_losses_within_noise(two, one, control)


PP_NAN_SCRIPT = r'''
import os, sys, json, torch
sys.path.insert(0, os.getcwd())
import megatron.training.pipeline_engine as pe
from megatron.arguments import parse_config
from megatron.training.loop import Trainer
real_loss, calls = pe.pipeline_loss, {"n": 0}

def loss_fn(logits, target):  # the last stage's 6th micro-batch (iteration 2 of 4 micro-batches) is NaN
    calls["n"] += 1
    loss = real_loss(logits, target)
    return loss * float("nan") if calls["n"] == 6 else loss

pe.pipeline_loss = loss_fn
trainer = Trainer(parse_config(sys.argv[1:]))
real_batch, report = trainer.engine.train_batch, []

def train_batch(iteration, batches, *rest):
    before = [p.detach().clone() for p in trainer.model.parameters()]
    loss, norm, stepped = real_batch(iteration, batches, *rest)
    same = all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    report.append([stepped, same])
    return loss, norm, stepped

trainer.engine.train_batch = train_batch
result = trainer.train()
rank = int(os.environ["RANK"])
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"report_{rank}.json"), "w") as f:
    json.dump({"steps": report, "skipped": result.state.skipped_iterations, "losses": result.losses}, f)
from megatron.parallel_state import finish_distributed_run
finish_distributed_run(0)
'''


@pytest.mark.parametrize("stage", ["0", "1"])
def test_pp2_non_finite_loss_skips_the_step_on_every_stage(tmp_path, stage):
    import json

    script = tmp_path / "pp_nan.py"
    script.write_text(PP_NAN_SCRIPT)
    run(2, "--deepspeed", "--zero-stage", stage, "--pipeline-model-parallel-size", "2", script=str(script),
        train_iters=3, eval_iters=0)
    for rank in range(2):  # stage 0 never sees the loss: it must skip all the same
        r = json.loads((tmp_path / f"report_{rank}.json").read_text())
        assert r["skipped"] == 1 and r["steps"] == [[True, False], [False, True], [True, False]], r
