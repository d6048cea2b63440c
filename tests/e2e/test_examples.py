"""Example scripts stay runnable: the 7B configuration resolves (dry run), the tiny CPU run trains."""
import os
import subprocess
import sys

import pytest

from tests.support.config import REPO


def _run(script, *extra):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", f"examples/{script}", *extra], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_llama2_7b_dry_run():
    out = _run("llama2_7b_model.sh")
    assert out.returncode == 0, out.stderr
    assert "parameters: 6,738,415,616" in out.stdout


def test_tiny_cpu_example_trains():
    out = _run("pretrain_tiny_cpu.sh", "--train-iters", "6", "--lr-warmup-iters", "2", "--log-interval", "3", "--eval-interval", "6",
               "--eval-iters", "1")
    assert out.returncode == 0, out.stderr
    assert "iteration        6/       6" in out.stderr


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
@pytest.mark.parametrize("platform", ["gaudi2", "cuda"])
def test_llama2_7b_2t_launch_scripts_resolve(precision, platform):
    project = precision == "fp8" and platform == "gaudi2"  # the projection of the others adds nothing to check
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", PRECISION=precision, PLATFORM=platform,
               **({} if project else {"PROJECT_ON": ""}))
    out = subprocess.run(["bash", "examples/llama2_7b_2t.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "parameters: 6,738,415,616" in out.stdout
    assert "gradient accumulation steps: 4" in out.stdout  # 1024 / (1 x 256 ranks)
    assert ('"smooth_swiglu": "channel"' in out.stdout) == (precision == "fp8")
    assert ('"optimizer": "fp8adam"' in out.stdout) == (precision == "fp8")
    # Megatron-DeepSpeed's layout: BF16 weights, FP32 master and moments sharded by ZeRO-1
    assert "bytes/param (--params-dtype bf16, ZeRO 1, data parallel 256)" in out.stdout
    assert ("projected (megatron/perf" in out.stdout) == project
    if project:
        for device in ("256 x gaudi2 (projected):", "256 x h200 (projected):"):
            section = out.stdout[out.stdout.index(device):]
            assert "this run (FP8 hybrid delayed + Smooth-SwiGLU): step" in section
            assert "the same run in BF16: step" in section and "FP8 / BF16 speed-up (projected):" in section
            assert "476,837 iterations in" in section and "device-hours" in section
        assert "calibration: ratios within" in out.stdout


def test_llama2_7b_2t_with_pipeline_stages_and_the_fp8_controller_resolves():
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", PRECISION="fp8", PLATFORM="cuda", PP="4",
               AUTOHEAL="1", PROJECT_ON="")
    out = subprocess.run(["bash", "examples/llama2_7b_2t.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "gradient accumulation steps: 16" in out.stdout  # 1024 / (1 x 64 data-parallel replicas)
    assert '"pipeline_model_parallel_size": 4' in out.stdout
    # AUTOHEAL=1: the controller with the rungs that apply (Smooth-SwiGLU is on for every layer: no smooth rung)
    autoheal = out.stdout[out.stdout.index('"fp8_autoheal"'):]
    assert '"enabled": true' in autoheal[:300] and '"smooth"' not in autoheal[:300], autoheal[:300]


def test_the_slurm_script_starts_torchrun_with_the_c10d_rendezvous_and_restarts_on_every_node(tmp_path):
    """examples/llama2_7b_2t.sbatch for 2 nodes x 8 devices (a stand-in `scontrol` lists the nodes): the srun line,
    the same torchrun command on each node (parsed by torchrun's own parser), and the configuration resolved for 16
    ranks by --dry-run."""
    import shlex

    from torch.distributed.run import get_args_parser

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho gpu-a\necho gpu-b\n")
    (fake / "scontrol").chmod(0o755)
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", PROJECT_ON="", PATH=f"{fake}:{os.environ['PATH']}",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_JOB_ID="4242")
    out = subprocess.run(["bash", "examples/llama2_7b_2t.sbatch"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "srun: srun --nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 bash examples/llama2_7b_2t.sh"
    commands = [line.split(": ", 1)[1] for line in lines[1:3]]
    assert [line.split(":")[0] for line in lines[1:3]] == ["node gpu-a", "node gpu-b"]
    assert commands[0] == commands[1]  # the rendezvous assigns the node ranks
    argv = shlex.split(commands[0])
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    torchrun = get_args_parser().parse_args(argv[3:])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend, torchrun.rdzv_endpoint,
            torchrun.rdzv_id, torchrun.max_restarts) == ("2", "8", "c10d", "gpu-a:29500", "4242", 3)
    assert torchrun.training_script == "pretrain_gpt.py"
    script = torchrun.training_script_args
    save, load = script[script.index("--save") + 1], script[script.index("--load") + 1]
    assert save == load and "--exit-signal-handler" in script  # each attempt resumes where the last one saved
    assert "parameters: 6,738,415,616" in out.stdout
    assert "gradient accumulation steps: 64" in out.stdout  # 1024 / (1 x 16 ranks)


def test_llama2_70b_fsdp2_resolves_for_64_devices_and_fits_an_h200():
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", PROJECT_ON="")
    out = subprocess.run(["bash", "examples/llama2_70b_fsdp2.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "parameters: 68,976,648,192" in out.stdout
    assert "gradient accumulation steps: 4" in out.stdout  # 1024 / (8 x 32 data-parallel ranks)
    # FSDP2 shards each TP rank's FP32 weights, gradients and both moments 32 ways: 16 / 32 bytes per parameter held
    assert "persistent state per device: 0.500 bytes/param (--params-dtype fp32, FSDP2, data parallel 32)" in out.stdout
    estimate = out.stdout[out.stdout.index("memory estimate per device (GiB):"):].splitlines()[0]
    assert float(estimate.rsplit("total ", 1)[1]) < 141  # an H200's memory
