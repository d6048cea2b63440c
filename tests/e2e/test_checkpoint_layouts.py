"""One checkpoint reader for every layout the trainer writes (megatron/checkpoint/layouts.py).

Each layout is written by a real run of pretrain_gpt.py from the same seed with the learning rate at 0: one
step changes no weight (AdamW with lr 0 also decays nothing), and every layout starts from the same full
model (built whole, then sharded, partitioned or cut into stages). So the reader's merged state dict must
equal the single-process checkpoint's *bitwise*; a merge in the wrong order, a missing pipeline layer or a
wrong key map cannot pass. Then each is exported to Hugging Face and its logits compared with the merged
weights run here, and tools/evaluate.py must report the same loss for every layout.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron.checkpoint.layouts import detect_layout, read_checkpoint, resolve_checkpoint_dir
from megatron.checkpoint_conversion import export_to_hf, load_gpt_checkpoint
from tests.support.config import REPO, load_tool, tiny_argv
from tests.support.launch import free_port, launch_checked
from tests.support.data import VOCAB, write_indexed

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

FROZEN = dict(train_iters=1, lr=0.0, min_lr=0.0, lr_warmup_iters=0, eval_iters=0, micro_batch_size=2,
              global_batch_size=8)
# The padded vocabulary is a multiple of --make-vocab-size-divisible-by x TP: 256 rows everywhere.
PAD_256 = ("--make-vocab-size-divisible-by", "256")
LAYOUTS = {  # name: (processes, switches)
    "single": (1, PAD_256),
    "tensor_parallel": (2, ("--tensor-model-parallel-size", "2")),
    "deepspeed": (2, ("--deepspeed", "--zero-stage", "1", *PAD_256)),
    "deepspeed_zero3": (2, ("--deepspeed", "--zero-stage", "3", "--bf16", *PAD_256)),
    "pipeline": (2, ("--deepspeed", "--zero-stage", "1", "--pipeline-model-parallel-size", "2", *PAD_256)),
    "torch_dist": (2, ("--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2")),
}


def _train(nproc: int, switches: tuple, save) -> None:
    argv = tiny_argv(*switches, save=save, **FROZEN)
    launch_checked(nproc, argv, stdout_tail=0, stderr_tail=3000)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    for name, (nproc, switches) in LAYOUTS.items():
        _train(nproc, switches, root / name)
    return {name: root / name for name in LAYOUTS}


def test_every_layout_reads_back_as_the_same_full_model(checkpoints) -> None:
    reference, _, _ = read_checkpoint(resolve_checkpoint_dir(checkpoints["single"]))
    for name, save in checkpoints.items():
        folder = resolve_checkpoint_dir(save)
        assert detect_layout(folder) == name, (name, sorted(p.name for p in folder.iterdir()))
        payload, _, train_state = read_checkpoint(folder)
        assert payload["layout"] == name and train_state["iteration"] == 1
        state = payload["model"]
        assert state.keys() == reference["model"].keys(), (name, set(state) ^ set(reference["model"]))
        for key, tensor in reference["model"].items():
            assert torch.equal(state[key].float(), tensor.float()), (name, key)
        if name != "deepspeed_zero3":  # the run's LR schedule travels with the weights
            assert "lr_scheduler" in payload, name


def test_every_layout_exports_to_hugging_face_and_evaluates_alike(checkpoints, tmp_path) -> None:
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    evaluate = load_tool("evaluate")
    data = write_indexed(tmp_path / "valid", 40, seed=5)
    losses = {}
    for name, save in checkpoints.items():
        loaded = load_gpt_checkpoint(save)
        out = export_to_hf(save, tmp_path / name, with_tokenizer=False)
        hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            ours, theirs = loaded.model(tokens), hf(tokens).logits
        # FP32 both ways, same weights: they differ only by the order of fp32 operations (~1e-6 of the logits'
        # scale); 1e-5 is the bar.
        assert ((ours - theirs).abs().max() / ours.abs().max()).item() <= 1e-5, name
        out = evaluate.main(["--load", str(save), "--data-path", data, "--eval-samples", "8", "--device", "cpu",
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)])
        losses[name] = out["data_path"]["loss"]
    assert len(set(losses.values())) == 1, losses  # identical weights: identical evaluation


def test_the_7b_scripts_checkpoints_export(tmp_path) -> None:
    """examples/llama2_7b_2t.sh's own flags (FP8 + Smooth-SwiGLU + Fp8AdamW, DeepSpeed ZeRO-1, recompute,
    scaled_mm backend), shrunk by SMOKE=1 to 2 layers on 2 CPU processes: its checkpoint exports to HF."""
    import os

    env = dict(os.environ, SMOKE="1", PRECISION="fp8", PLATFORM="cuda", RUN_DIR=str(tmp_path / "run"),
               PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    out = subprocess.run(["bash", "examples/llama2_7b_2t.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    save = tmp_path / "run" / "checkpoints"
    folder = resolve_checkpoint_dir(save)
    assert detect_layout(folder) == "deepspeed"
    payload, config, _ = read_checkpoint(folder)
    assert config["fp8"]["backend"] == "scaled_mm" and config["model"]["smooth_swiglu"] == "channel"
    assert config["optimizer"]["optimizer"] == "fp8adam" and "fp8" in payload  # FP8 scaling state travels too
    loaded = load_gpt_checkpoint(save)
    hf_dir = export_to_hf(save, tmp_path / "hf", with_tokenizer=False)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = loaded.model(tokens), hf(tokens).logits
    assert ((ours - theirs).abs().max() / ours.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("name", ["deepspeed", "deepspeed_zero3"])
def test_deepspeeds_zero_to_fp32_consolidates_our_zero_checkpoints(checkpoints, name) -> None:
    """DeepSpeed's own consolidation (its zero_to_fp32.py, which DeepSpeed copies beside the iteration folders of every
    --save folder we write) reads our folders through its `latest` tracker and gives the FP32 weights our reader
    gives, bit for bit."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatron.checkpoint.full_state import read_full_state

    folder = resolve_checkpoint_dir(checkpoints[name])
    assert (checkpoints[name] / "zero_to_fp32.py").exists()
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(checkpoints[name]))
    ours = read_full_state(folder).model
    assert theirs.keys() == ours.keys(), set(theirs) ^ set(ours)
    for key, tensor in ours.items():
        assert theirs[key].dtype == torch.float32 and torch.equal(theirs[key], tensor.float()), key
