"""Generate text from a checkpoint.

    python tools/generate.py --load runs/demo/checkpoints --prompt "In the beginning" \\
        [--max-new-tokens 64] [--greedy | --temperature 0.8 --top-k 40 --top-p 0.95] [--seed 1] [--num-samples 3]

The tokenizer is the one recorded in the checkpoint unless tokenizer flags are given. An empty
prompt starts right after an end-of-document token, as a new document would in training.
Generation stops at `--max-new-tokens` or at the end-of-document token (`--ignore-eod` to go on).
No KV cache: fine for the small demo models (see megatron/evaluation/generation.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.accelerator import get_accelerator  # noqa: E402
from megatron.checkpoint_conversion import load_gpt_checkpoint  # noqa: E402
from megatron.evaluation.generation import SamplingConfig, decode_continuation, generate  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402
from megatron.tokenizer.flags import add_tokenizer_args  # noqa: E402

TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="run folder (--save of training) or an iter_XXXXXXX folder")
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "hpu"], default="auto")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within probability mass p (1 = all)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-samples", type=int, default=1, help="independent continuations (seeds seed, seed+1, ...)")
    p.add_argument("--ignore-eod", action="store_true", help="do not stop at the end-of-document token")
    add_tokenizer_args(p)
    return p


def main(argv: Optional[list[str]] = None) -> list[str]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, greedy=args.greedy, stop_at_eod=not args.ignore_eod)
    loaded = load_gpt_checkpoint(args.load, args.iteration, get_accelerator(args.device).device)
    overrides = {f: getattr(args, f) for f in TOKENIZER_FIELDS if getattr(args, f) is not None}
    data = dataclasses.replace(loaded.data_config, **overrides)
    if data.tokenizer_type is None:
        raise SystemExit(f"{loaded.path} was trained without a tokenizer (--mock-data): pass --tokenizer-type "
                         "NullTokenizer --vocab-size N to give prompts as token ids")
    tokenizer = build_tokenizer(data)
    prompt = tokenizer.tokenize(args.prompt) if args.prompt else [tokenizer.eod]
    texts = []
    for k in range(args.num_samples):
        ids = generate(loaded.model, prompt, sampling, loaded.model_config.seq_length, tokenizer.eod,
                       seed=args.seed + k, vocab_size=tokenizer.vocab_size)
        text = decode_continuation(tokenizer, prompt, ids)
        texts.append(text)
        print(("" if args.num_samples == 1 else f"--- sample {k + 1}\n") + args.prompt + text)
    return texts


if __name__ == "__main__":
    from megatron.errors import run_cli

    sys.exit(run_cli(main))
