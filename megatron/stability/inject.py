"""The controlled injection: put a checkpoint at the paper's fixed point (w1 = +-c w2) for a few channels.

Theorem 1 of the Smooth-SwiGLU paper: under weight decay, at a stationary point with a saturated Swish, a
channel's up row w1 and gate row w2 align, w1 -> +-w2; the channel becomes quadratic in its input and its
product Swish(x w2) * (x w1) grows outliers. Natural alignment takes ~200B tokens at 7B; here it is written
into a checkpoint directly: for `channels` channels of every layer, up_i := s_i * c * gate_i with signs
alternating +, -, + ... (both branches of the theorem), and the run resumes from the edited checkpoint as an
ordinary `--load` run. The channels chosen are the ones already most aligned (largest |cos(w1_i, w2_i)|):
the ones training was moving towards the fixed point, ties broken by index so the choice is deterministic.

Only the model weights change. The optimizer moments of the edited rows are left as saved (an ordinary
resume), the FP8 scaling state too: delayed scaling meets the outlier with the history of the healthy run,
which is the situation of the paper's late divergence.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron.checkpoint import manifest
from megatron.checkpoint.store import TRACKER_FILE, iteration_dir, model_file, read_tracker

_FC1 = "mlp.linear_fc1.weight"


def copy_checkpoint(src: Path, dst: Path) -> int:
    """Copy the newest checkpoint of `src` (and its tracker) into a fresh `dst`; return its iteration."""
    iteration = read_tracker(src)
    if iteration is None:
        raise ValueError(f"{src} holds no checkpoint to copy: did the base run reach its --save-interval?")
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    shutil.copytree(iteration_dir(src, iteration), iteration_dir(dst, iteration))
    (dst / TRACKER_FILE).write_text(f"{iteration}\n")
    return iteration


def fc1_keys(model_state: dict) -> list[str]:
    """The `linear_fc1.weight` keys of every layer, in layer order."""
    keys = [k for k in model_state if k.endswith(_FC1)]
    if not keys:
        raise ValueError("checkpoint has no mlp.linear_fc1.weight: the injection needs a --swiglu model")
    return sorted(keys, key=lambda k: int(k.split("layers.")[1].split(".")[0]))


def channel_cosines(fc1_weight: torch.Tensor) -> torch.Tensor:
    """Signed cos(w1_i, w2_i) per channel, float64; fc1 is laid out [gate | up] ([2F, H])."""
    gate, up = fc1_weight.detach().double().chunk(2, dim=0)
    return F.cosine_similarity(up, gate, dim=-1, eps=1e-30)


def inject_aligned_channels(ckpt_root: Path, c: float, channels: int) -> dict:
    """Edit the newest checkpoint under `ckpt_root` in place; return what was done, per layer.

    Returns {"iteration", "c", "layers": {index: {"channels", "signs", "cos_before", "cos_after"}}}; the cosines
    are the signed values of the chosen channels, measured from the saved tensors before and after.
    """
    if not c > 0:
        raise ValueError(f"--inject-c values must be > 0, got {c}")
    iteration = read_tracker(ckpt_root)
    if iteration is None:
        raise ValueError(f"{ckpt_root} holds no checkpoint to inject into")
    path = model_file(iteration_dir(ckpt_root, iteration))
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = state["model"]
    report: dict = {"iteration": iteration, "c": c, "layers": {}}
    for layer, key in enumerate(fc1_keys(model)):
        weight = model[key]
        ffn = weight.shape[0] // 2
        if not 0 < channels <= ffn:
            raise ValueError(f"--inject-channels must be in [1, {ffn}] (the FFN width), got {channels}")
        before = channel_cosines(weight)
        # Most aligned first; the stable sort on -|cos| breaks ties by index.
        order = torch.sort(-before.abs(), stable=True).indices[:channels]
        chosen = sorted(int(i) for i in order)
        signs = [1.0 if j % 2 == 0 else -1.0 for j in range(len(chosen))]
        edited = weight.clone()
        for i, s in zip(chosen, signs):
            edited[ffn + i] = (s * c) * weight[i]  # up row := +-c x gate row
        model[key] = edited
        after = channel_cosines(edited)
        report["layers"][layer] = {"channels": chosen, "signs": signs,
                                   "cos_before": [float(before[i]) for i in chosen],
                                   "cos_after": [float(after[i]) for i in chosen]}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    folder = iteration_dir(ckpt_root, iteration)
    manifest.refresh(folder, str(path.relative_to(folder)))
    return report


def checkpoint_alignment(ckpt_root: Path, iteration: int) -> list[torch.Tensor]:
    """|cos(w1_i, w2_i)| per channel of every layer (float64) in the checkpoint of `iteration`."""
    state = torch.load(model_file(iteration_dir(ckpt_root, iteration)), map_location="cpu", weights_only=True)
    model = state["model"]
    return [channel_cosines(model[k]).abs() for k in fc1_keys(model)]
