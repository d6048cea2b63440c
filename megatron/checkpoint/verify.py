"""`--verify-checkpoint`: every checkpoint file is read back and compared with what was asked to be written.

Habana's Megatron-DeepSpeed launch scripts pass `--verify-checkpoint` (with `--verify-checkpoint-model-type`). Here
each rank, after writing its files into the staging folder and before the folder is committed, loads every file it
wrote (`torch.load(weights_only=True)`, memory-mapped: the file's tensors are not copied into memory at once) and
compares it with the object it handed to `torch.save`, the live training state of that moment: the weights, the
optimizer state (our optimizers' or DeepSpeed's ZeRO partitions), the FP8 scaling state, the RNG state, bit for bit
(NaNs and signed zeros included). A difference is one `CheckpointError` naming the file and the first entry that
differs; the staging folder is removed and the tracker keeps pointing at the previous checkpoint.
"""
from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron.checkpoint.store import CheckpointError


def first_difference(saved: Any, expected: Any, where: str = "") -> Optional[str]:
    """Where `saved` (read back) and `expected` (what was written) differ, or None when they are the same."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            return f"{where or 'the file'}: a {type(saved).__name__} where a tensor was written"
        if saved.dtype != expected.dtype or saved.shape != expected.shape:
            return (f"{where}: {saved.dtype} {tuple(saved.shape)} read back, {expected.dtype} {tuple(expected.shape)} "
                    "written")
        a, b = (t.detach().cpu().contiguous().reshape(-1) for t in (saved, expected))
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True
        return None if same else f"{where}: the tensor's bytes differ"
    if isinstance(expected, dict):
        if not isinstance(saved, dict) or set(saved) != set(expected):
            missing = set(expected) - set(saved) if isinstance(saved, dict) else set(expected)
            return f"{where or 'the file'}: keys differ (not read back: {sorted(map(str, missing))[:5]})"
        for key in expected:
            found = first_difference(saved[key], expected[key], f"{where}/{key}" if where else str(key))
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(expected):
            return f"{where}: a sequence of another length"
        for i, (s, e) in enumerate(zip(saved, expected)):
            found = first_difference(s, e, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, float) and isinstance(saved, float) and math.isnan(expected) and math.isnan(saved):
        return None
    if saved == expected:
        return None
    if hasattr(expected, "__dict__") and type(saved) is type(expected):  # DeepSpeed's loss scaler: plain data
        return first_difference(vars(saved), vars(expected), where)
    return f"{where}: {saved!r} read back, {expected!r} written"


def verify_file(path: Path, expected: Any, safe_globals: Callable[[], list] = list) -> None:
    """Raise a `CheckpointError` naming `path` unless it reads back as `expected`."""
    try:
        with torch.serialization.safe_globals(safe_globals()):  # mmap needs the zip format (not DeepSpeed's legacy)
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # an unreadable file is a failed verification like any other
        raise CheckpointError(f"--verify-checkpoint: {path} cannot be read back ({exc.__class__.__name__}: "
                              f"{str(exc)[:200]}); the checkpoint was not committed") from exc
    found = first_difference(saved, expected)
    if found:
        raise CheckpointError(f"--verify-checkpoint: {path} does not hold what was written ({found}); the checkpoint "
                              "was not committed and the tracker still names the previous one")
