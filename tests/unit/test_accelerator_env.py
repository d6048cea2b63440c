"""What importing megatron tells DeepSpeed: on a CPU-only torch build, DS_ACCELERATOR=cpu (DeepSpeed then does not warn
in every process that it found no GPU); a CUDA build is left to DeepSpeed's detection; a user's choice is kept."""
from __future__ import annotations

import importlib.util
import os

import torch

import megatron


def test_deepspeeds_accelerator_on_a_cpu_build(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    megatron._quiet_deepspeed_detection()
    cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    gaudi = importlib.util.find_spec("habana_frameworks") is not None
    assert os.environ.get("DS_ACCELERATOR") == ("cpu" if cpu_build and not gaudi else None)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    megatron._quiet_deepspeed_detection()
    assert os.environ["DS_ACCELERATOR"] == "cuda"
