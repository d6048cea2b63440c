"""Evaluate a checkpoint: perplexity on indexed data or text/JSONL, and zero-shot multiple-choice accuracy.

    python tools/evaluate.py --load runs/demo/checkpoints \\
        --split valid | --data-path data/demo/valid_text_document [--eval-samples N] \\
        --text-file data/demo/test.jsonl \\
        --task data/demo/tasks/next_verse_valid.jsonl [--task-limit 200] \\
        [--json results.json]

Perplexity on `--data-path` uses the training pipeline (same samples, masks and token-weighted
mean as the run's validation; the run's seed and micro-batch size by default), over one pass of
the data unless `--eval-samples` sets N. `--split valid` (or train, test) scores that split of the run's own data
(or of `--data-path`), cut by the run's `--split` as training cut it: the held-out documents. `--text-file`
scores every token of a raw file. Each `--task` is a JSONL file of {"context", "choices", "label"} scored by log-likelihood (acc, acc_norm).
The tokenizer is the one recorded in the checkpoint unless tokenizer flags are given. A checkpoint of an FP8 run
is scored with its high-precision weights (FP32, or BF16 autocast with --bf16), which one output line says.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.accelerator import get_accelerator  # noqa: E402
from megatron.checkpoint_conversion import load_gpt_checkpoint  # noqa: E402
from megatron.evaluation.multiple_choice import load_task, score_items  # noqa: E402
from megatron.evaluation.perplexity import indexed_perplexity, split_perplexity, text_perplexity  # noqa: E402
from megatron.evaluation.scoring import LogLikelihoodScorer  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402
from megatron.tokenizer.flags import add_tokenizer_args  # noqa: E402

TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def _split_name(value: str) -> str:
    if value not in ("train", "valid", "test"):
        raise argparse.ArgumentTypeError(
            f"{value!r}: evaluate.py's --split names a split (train, valid or test); the documents are cut by the "
            "run's own --split weights, read from the checkpoint's config.json")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("checkpoint")
    g.add_argument("--load", required=True, help="run folder (--save of training) or an iter_XXXXXXX folder")
    g.add_argument("--iteration", type=int, default=None)
    g.add_argument("--device", choices=["auto", "cpu", "cuda", "hpu"], default="auto")
    g.add_argument("--bf16", action="store_true", help="BF16 autocast, as a --bf16 run evaluates")
    g = p.add_argument_group("indexed data (as training evaluates)")
    g.add_argument("--data-path", nargs="*", default=None, help="PREFIX or WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ...")
    g.add_argument("--split", type=_split_name, default=None, metavar="{train,valid,test}",
                   help="score this split of the run's data (or of --data-path), cut by the run's own --split (from "
                        "the checkpoint's config.json): valid and test are documents the run never trained on")
    g.add_argument("--eval-samples", type=int, default=None, help="N samples (default: one pass over the data)")
    g.add_argument("--micro-batch-size", type=int, default=None, help="default: the run's")
    g.add_argument("--seed", type=int, default=None, help="sample-shuffle seed (default: the run's --seed)")
    g.add_argument("--data-cache-path", default=None)
    g = p.add_argument_group("raw text")
    g.add_argument("--text-file", action="append", default=[], help="a .jsonl/.json or plain-text file (repeatable)")
    g.add_argument("--json-key", default="text")
    g.add_argument("--max-documents", type=int, default=None)
    g = p.add_argument_group("zero-shot multiple choice")
    g.add_argument("--task", action="append", default=[], help="JSONL {context, choices, label} (repeatable)")
    g.add_argument("--task-limit", type=int, default=None, help="first N items of each task")
    g.add_argument("--target-delimiter", default=" ", help="put between context and each choice")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per forward for text and tasks")
    add_tokenizer_args(p)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p


def main(argv: Optional[list[str]] = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not (args.data_path or args.split or args.text_file or args.task):
        raise SystemExit("nothing to evaluate: pass --split, --data-path, --text-file and/or --task")
    device = get_accelerator(args.device).device
    loaded = load_gpt_checkpoint(args.load, args.iteration, device)
    model, mcfg = loaded.model, loaded.model_config
    overrides = {f: getattr(args, f) for f in TOKENIZER_FIELDS if getattr(args, f) is not None}
    data = dataclasses.replace(loaded.data_config, **overrides)
    if args.data_cache_path:
        data = dataclasses.replace(data, data_cache_path=args.data_cache_path)
    tokenizer = build_tokenizer(data)
    if tokenizer.vocab_size > mcfg.padded_vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {mcfg.padded_vocab_size}: "
                         "pass the --tokenizer-type/--tokenizer-model the checkpoint was trained with")
    training = loaded.training_config
    results: dict = {"checkpoint": str(loaded.path), "iteration": loaded.iteration}
    print(f"checkpoint {loaded.path} (iteration {loaded.iteration}), seq_length {mcfg.seq_length}")
    fp8 = loaded.raw_config.get("fp8")
    if fp8:
        # The checkpoint holds the high-precision (master) weights; the tools build plain nn.Linear layers from them.
        results["trained_fp8_recipe"] = fp8
        print(f"trained with FP8 linears ({fp8['format']}, {fp8['scaling']} scaling): scored with its high-precision "
              f"weights in {'BF16 autocast' if args.bf16 else 'FP32'}, not through FP8 GEMMs")

    if args.data_path or args.split:
        _score_indexed(args, model, mcfg.seq_length, data, tokenizer, training, results)
    for path in args.text_file:
        r = text_perplexity(model, path, tokenizer, mcfg.seq_length, args.json_key, args.batch_size,
                            args.max_documents, args.bf16)
        results.setdefault("text", {})[path] = r.to_dict()
        print(f"text {path}: loss {r.loss:.6f} | ppl {r.perplexity:.4f} | bits/byte {r.bits_per_byte:.4f} | "
              f"{r.tokens} tokens")
    if args.task:
        scorer = LogLikelihoodScorer(model, tokenizer, mcfg.seq_length, args.batch_size, bf16=args.bf16)
        for path in args.task:
            items = load_task(path, args.task_limit)
            r = score_items(scorer, items, args.target_delimiter)
            results.setdefault("tasks", {})[path] = r.to_dict()
            print(f"task {path}: acc {r.acc:.4f} (+- {r.acc_stderr:.4f}) | acc_norm {r.acc_norm:.4f} | "
                  f"{r.num_items} items")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _score_indexed(args, model, seq_length: int, data, tokenizer, training, results: dict) -> None:
    """--split (a split of the run's data, or of --data-path) or --data-path (all of it), as training evaluates."""
    seed = args.seed if args.seed is not None else (training.seed if training else 1234)
    mbs = args.micro_batch_size or (training.micro_batch_size if training else 4)
    if args.split:
        if args.data_path:
            data = dataclasses.replace(data, data_path=tuple(args.data_path), train_data_path=(), valid_data_path=(),
                                       test_data_path=())
        r = split_perplexity(model, data, args.split, tokenizer, seq_length, seed, args.eval_samples, mbs, args.bf16)
        results["split"] = dict(r.to_dict(), name=args.split, split=data.split)
        source = (f"data {' '.join(data.data_path)} --split {data.split}" if data.data_path else
                  f"the run's --{args.split}-data-path")
        print(f"{args.split} split of {source}: loss {r.loss:.6f} | ppl {r.perplexity:.4f} | {r.samples} samples, "
              f"{r.tokens} tokens")
        return
    if tuple(args.data_path) == tuple(data.data_path):
        print(f"note: --data-path is the run's own data, whose train split (--split {data.split}) it trained on: "
              f"this scores trained-on tokens; --split valid or --split test scores the held-out documents")
    r = indexed_perplexity(model, args.data_path, data, tokenizer, seq_length, seed, args.eval_samples, mbs, args.bf16)
    results["data_path"] = r.to_dict()
    print(f"data {' '.join(args.data_path)}: loss {r.loss:.6f} | ppl {r.perplexity:.4f} | "
          f"{r.samples} samples, {r.tokens} tokens")


if __name__ == "__main__":
    from megatron.errors import run_cli

    sys.exit(run_cli(main))
