"""Checkpoint conversion: our GPT checkpoints <-> Hugging Face Llama, and rebuilding models from checkpoints.

* `llama`: config and state-dict mapping (pure functions, layouts documented there);
* `checkpoint_io`: `load_gpt_checkpoint` (a `GPTModel` + config slices from any of our checkpoints, read by
  `megatron.checkpoint.layouts`),
  `save_converted_checkpoint`;
* `hf_folder`: HF folder reading/writing (safetensors, config.json, tokenizer files), atomic;
* `convert`: `export_to_hf` and `import_from_hf`, used by tools/convert_to_hf.py and tools/convert_from_hf.py.
"""
from megatron.checkpoint_conversion.checkpoint_io import LoadedCheckpoint, load_gpt_checkpoint, resolve_checkpoint_dir
from megatron.checkpoint_conversion.convert import export_to_hf, import_from_hf
from megatron.checkpoint_conversion.llama import (
    NotLlamaCompatibleError, check_llama_compatible, fold_smooth_swiglu_scales, from_hf_config, from_hf_state_dict,
    to_hf_config, to_hf_state_dict, training_flags,
)

__all__ = ["LoadedCheckpoint", "NotLlamaCompatibleError", "check_llama_compatible", "export_to_hf",
           "fold_smooth_swiglu_scales", "from_hf_config", "from_hf_state_dict", "import_from_hf",
           "load_gpt_checkpoint", "resolve_checkpoint_dir", "to_hf_config", "to_hf_state_dict", "training_flags"]
