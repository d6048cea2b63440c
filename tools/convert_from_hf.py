"""Import a local Hugging Face Llama folder as one of our checkpoints (iteration 0), ready to train.

    python tools/convert_from_hf.py --hf-dir path/to/llama --save runs/llama-ft/checkpoints [--seq-length 2048]
        [--tokenizer-type T --tokenizer-model PATH]

Writes `--save`/iter_0000000 (FP32 weights, no optimizer state) and prints the pretrain_gpt.py
model flags that rebuild the same model. Continue with `--load SAVE --finetune` (new optimizer and
iteration count: the usual way to fine-tune) or plain `--load SAVE --no-load-optim --no-load-rng`.
The tokenizer (tokenizer.model, else tokenizer.json) is copied to `--save`/tokenizer. Nothing is
downloaded: `--hf-dir` must be a local folder.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint_conversion.convert import import_from_hf  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", required=True, help="local folder with config.json and *.safetensors")
    p.add_argument("--save", required=True, help="checkpoint folder to write (iteration 0)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="training sequence length (default min(max_position_embeddings, 4096))")
    p.add_argument("--tokenizer-type", default=None, help="override the tokenizer detected in --hf-dir")
    p.add_argument("--tokenizer-model", default=None)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = import_from_hf(args.hf_dir, args.save, args.seq_length, args.tokenizer_type, args.tokenizer_model)
    print(f"wrote {result.checkpoint}\ncontinue training with (add data and schedule flags):\n"
          f"  python pretrain_gpt.py {shlex.join(result.flags)} --finetune")
    return 0


if __name__ == "__main__":
    from megatron.errors import run_cli

    sys.exit(run_cli(main))
