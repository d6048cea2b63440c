"""Export one of our checkpoints as a Hugging Face `LlamaForCausalLM` folder.

    python tools/convert_to_hf.py --load runs/demo/checkpoints --output runs/demo/hf [--iteration N]
        [--dtype float32|bfloat16|float16] [--tokenizer-model PATH | --no-tokenizer] [--overwrite]

`--load` is a run's `--save` folder (the newest checkpoint, through latest_checkpointed_iteration.txt,
or `--iteration N`) or an `iter_XXXXXXX` folder. The output holds config.json, model.safetensors,
generation_config.json and the tokenizer files, and loads offline with
`LlamaForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)`. Optimizer and FP8
scaling state are dropped. Models Llama cannot express (LayerNorm, GeLU, biases, learned positions)
are refused with the reason. The folder is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint_conversion.convert import DTYPES, export_to_hf  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="run folder (--save of training) or an iter_XXXXXXX folder")
    p.add_argument("--iteration", type=int, default=None, help="default: the newest (tracker file)")
    p.add_argument("--output", required=True, help="Hugging Face folder to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the saved weights")
    p.add_argument("--tokenizer-model", default=None,
                   help="tokenizer file to export instead of the path recorded in the checkpoint")
    p.add_argument("--no-tokenizer", action="store_true", help="write the model only")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = export_to_hf(args.load, args.output, args.iteration, args.dtype, args.tokenizer_model,
                       with_tokenizer=not args.no_tokenizer, overwrite=args.overwrite)
    print(f"wrote {out}: load it with transformers.LlamaForCausalLM.from_pretrained({str(out)!r})")
    return 0


if __name__ == "__main__":
    from megatron.errors import run_cli

    sys.exit(run_cli(main))
