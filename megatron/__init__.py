"""Megatron-FP8: Megatron-DeepSpeed style LLM pretraining with stable FP8."""
import importlib.util as _util
import os as _os

__version__ = "0.1.0"


def _quiet_deepspeed_detection() -> None:
    """A CPU-only torch build with no Gaudi software: tell DeepSpeed its accelerator is the CPU (DS_ACCELERATOR=cpu)
    instead of letting it warn in every process that it could not find a GPU. Only when the user did not choose;
    no device is queried (a CUDA build, which may have GPUs, is left to DeepSpeed's detection)."""
    if "DS_ACCELERATOR" in _os.environ or _util.find_spec("habana_frameworks") is not None:
        return
    try:
        import torch
    except ImportError:
        return
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        _os.environ["DS_ACCELERATOR"] = "cpu"


_quiet_deepspeed_detection()
