"""The two conversions end to end: our checkpoint -> HF Llama folder, and HF Llama folder -> our checkpoint.

`tools/convert_to_hf.py` and `tools/convert_from_hf.py` are thin command lines over these functions.
"""
from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron.checkpoint_conversion import hf_folder, llama
from megatron.checkpoint_conversion.checkpoint_io import (
    data_config_from_dict, model_config_from_dict, read_checkpoint, resolve_checkpoint_dir, save_converted_checkpoint,
)
from megatron.config import DataConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_to_hf(load: str | Path, output: str | Path, iteration: Optional[int] = None, dtype: str = "float32",
                 tokenizer_model: Optional[str] = None, with_tokenizer: bool = True,
                 overwrite: bool = False) -> Path:
    """Write the checkpoint at `load` as a `LlamaForCausalLM` folder at `output` (atomically)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    path = resolve_checkpoint_dir(load, iteration)
    payload, config, _ = read_checkpoint(path)
    model_config = model_config_from_dict(config, path)
    llama.check_llama_compatible(model_config)  # before reading anything else: the clearest error first
    hf_state = llama.to_hf_state_dict(payload["model"], model_config)
    if payload.get("fp8") is not None:
        logger.info("FP8 scaling state of %s dropped: the exported weights are the high-precision masters", path)
    data = data_config_from_dict(config, path)

    def fill(tmp: Path) -> None:
        ids = {}
        if with_tokenizer:
            ids = hf_folder.export_tokenizer(data, tmp, model_config.max_position_embeddings, tokenizer_model)
        hf_config = llama.to_hf_config(model_config, dtype, ids.get("bos_token_id"), ids.get("eos_token_id"))
        hf_folder.write_json(tmp / "config.json", hf_config)
        hf_folder.write_json(tmp / "generation_config.json",
                             {"bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id")})
        hf_folder.save_safetensors(hf_state, tmp / hf_folder.SAFETENSORS_FILE, DTYPES[dtype])

    out = hf_folder.write_folder_atomically(output, fill, overwrite)
    logger.info("exported %s (iteration %s) to %s", path, payload.get("iteration"), out)
    return out


@dataclass
class ImportResult:
    checkpoint: Path
    flags: list[str]


def _import_tokenizer(hf_dir: Path, save_dir: Path, tokenizer_type: Optional[str],
                      tokenizer_model: Optional[str]) -> DataConfig:
    """Copy the HF folder's tokenizer next to the checkpoint and describe it as our tokenizer flags."""
    if tokenizer_type:
        return DataConfig(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model)
    target = save_dir / "tokenizer"
    if (hf_dir / "tokenizer.model").exists():
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(hf_dir / "tokenizer.model", target / "tokenizer.model")
        return DataConfig(tokenizer_type="GPTSentencePieceTokenizer",
                          tokenizer_model=str((target / "tokenizer.model").resolve()))
    if (hf_dir / "tokenizer.json").exists():
        target.mkdir(parents=True, exist_ok=True)
        for name in hf_folder.HF_TOKENIZER_FILES:
            if (hf_dir / name).exists():
                shutil.copyfile(hf_dir / name, target / name)
        return DataConfig(tokenizer_type="HFTokenizer", tokenizer_model=str(target.resolve()))
    logger.warning("%s has no tokenizer.model or tokenizer.json: pass the tokenizer flags when training", hf_dir)
    return DataConfig()


def _check_tokenizer_fits(data: DataConfig, model_config) -> None:
    """The tokenizer must pad back to the model's vocabulary table (`training_flags` sets the divisor), else
    training from the import fails later with an embedding shape mismatch; refuse it now, naming both sizes."""
    if not data.tokenizer_type:
        return
    from megatron.tokenizer import build_tokenizer, pad_vocab_size

    vocab = build_tokenizer(data).vocab_size
    table = model_config.padded_vocab_size
    divisor = math.gcd(table, 128)
    if pad_vocab_size(vocab, divisor) != table:
        raise ValueError(f"the tokenizer ({data.tokenizer_type} {data.tokenizer_model}) has {vocab} tokens but the "
                         f"model's vocabulary table has {table} rows (vocab_size in config.json): they must match up "
                         f"to padding to a multiple of {divisor}; pass the model's own tokenizer with "
                         "--tokenizer-type/--tokenizer-model")


def import_from_hf(hf_dir: str | Path, save: str | Path, seq_length: Optional[int] = None,
                   tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None) -> ImportResult:
    """Write a local HF Llama folder as iteration 0 of `save`; returns the path and the training flags."""
    hf_dir, save_dir = Path(hf_dir), Path(save)
    hf_config = hf_folder.load_hf_config(hf_dir)
    model_config = llama.from_hf_config(hf_config, seq_length)
    state = llama.from_hf_state_dict(hf_folder.load_hf_weights(hf_dir), model_config)
    state = {k: v.float() for k, v in state.items()}  # FP32 master weights, as training keeps them
    data = _import_tokenizer(hf_dir, save_dir, tokenizer_type, tokenizer_model)
    _check_tokenizer_fits(data, model_config)
    path = save_converted_checkpoint(save_dir, state, model_config, data, str(hf_dir))
    flags = llama.training_flags(model_config)
    if data.tokenizer_type:
        flags += ["--tokenizer-type", data.tokenizer_type]
        if data.tokenizer_model:
            flags += ["--tokenizer-model", data.tokenizer_model]
    flags += ["--load", str(save_dir)]
    return ImportResult(checkpoint=path, flags=flags)
