"""Evaluation: perplexity equals the training-time validation loss; zero-shot scoring; lm-eval adapter; demo tasks."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.evaluation.lm_eval_adapter import LM_EVAL_AVAILABLE, MegatronLM
from megatron.evaluation.multiple_choice import MultipleChoiceItem, accuracy, load_task, score_items
from megatron.evaluation.scoring import (
    LogLikelihoodScorer, Window, lm_eval_rolling_windows, rolling_windows, score_windows,
)
from megatron.tokenizer import NullTokenizer
from megatron.training.loop import pretrain
from tests.support.config import load_tool, tiny_argv
from tests.support.data import VOCAB, data_argv, write_indexed


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 10 iterations on indexed data, with its validation losses and checkpoint."""
    root = tmp_path_factory.mktemp("eval")
    train = write_indexed(root / "train", 120, seed=0)
    valid = write_indexed(root / "valid", 30, seed=1)
    argv = data_argv(train, valid, train_iters=10, eval_interval=5, eval_iters=2, save=str(root / "ckpt"),
                     data_cache_path=str(root / "cache"))
    result = pretrain(parse_config(argv))
    return SimpleNamespace(root=root, train=train, valid=valid, result=result, config=parse_config(argv))


# Not isa_sensitive: the same kernels on the same shapes and samples as the run's validation, equal on any CPU.
def test_perplexity_equals_training_validation_loss(trained):
    evaluate = load_tool("evaluate")
    cfg = trained.config.training
    n = cfg.eval_iters * cfg.global_batch_size
    out = evaluate.main(["--load", str(trained.root / "ckpt"), "--data-path", trained.valid,
                         "--eval-samples", str(n), "--device", "cpu", "--json", str(trained.root / "r.json")])
    iteration, valid_loss = trained.result.valid[-1]
    assert iteration == 10
    got = out["data_path"]["loss"]
    # The run's micro-batch size and samples, the saved weights: the same fp32 micro-batch sums, added in float64
    # in the same order as the run's validation. Equal, on any CPU.
    assert got == valid_loss
    assert out["data_path"]["perplexity"] == math.exp(valid_loss)
    assert json.loads((trained.root / "r.json").read_text())["data_path"]["tokens"] == n * 32
    # The model learned something: the evaluated loss is well below chance (ln 128 = 4.85).
    assert got < math.log(128) - 0.5


def test_an_fp8_checkpoint_is_scored_with_its_high_precision_weights_and_says_so(trained, capsys):
    evaluate = load_tool("evaluate")
    save = trained.root / "fp8_ckpt"
    pretrain(parse_config(data_argv(trained.train, trained.valid, train_iters=2, eval_iters=0, save=str(save),
                                    data_cache_path=str(trained.root / "cache"))
                          + ["--fp8-format", "hybrid"]))
    capsys.readouterr()
    argv = ["--data-path", trained.valid, "--eval-samples", "4", "--device", "cpu"]
    out = evaluate.main(["--load", str(save), *argv])
    line = "trained with FP8 linears (hybrid, delayed scaling): scored with its high-precision weights in FP32"
    assert line in capsys.readouterr().out
    assert out["trained_fp8_recipe"]["format"] == "hybrid"
    # Negative control: the high-precision run's checkpoint gets no such line.
    out = evaluate.main(["--load", str(trained.root / "ckpt"), *argv])
    assert "FP8" not in capsys.readouterr().out and "trained_fp8_recipe" not in out


@pytest.mark.isa_sensitive
def test_default_is_one_pass_and_prefix_stable(trained):
    from megatron.checkpoint_conversion import load_gpt_checkpoint
    from megatron.evaluation.perplexity import indexed_perplexity, one_epoch_samples

    loaded = load_gpt_checkpoint(trained.root / "ckpt")
    tok = NullTokenizer(VOCAB)
    args = (loaded.model, [trained.valid], loaded.data_config, tok, 32, 1234)
    full = indexed_perplexity(*args)
    assert full.samples == one_epoch_samples([trained.valid], 32)
    first = indexed_perplexity(*args, num_samples=16, micro_batch_size=3)  # other batching, same samples
    # Each micro-batch's loss is an fp32 sum of its n tokens' losses (all positive); another batching sums them in
    # another order, which moves the total by at most ~n fp32 ulps (the tokens' own losses, from GEMMs with other
    # row counts, move by a few ulps).
    n = max(3, trained.config.training.micro_batch_size) * trained.config.model.seq_length
    assert abs(first.loss - trained.result.valid[-1][1]) <= n * 2.0**-24 * first.loss


def test_text_perplexity_scores_every_token(trained, tmp_path):
    from megatron.checkpoint_conversion import load_gpt_checkpoint
    from megatron.evaluation.perplexity import text_perplexity

    docs = [" ".join(str((5 + 2 * i) % VOCAB) for i in range(50)), " ".join(str(i) for i in range(70))]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    model = load_gpt_checkpoint(trained.root / "ckpt").model
    r = text_perplexity(model, str(path), NullTokenizer(VOCAB), 32, batch_size=2)
    assert r.tokens == 50 + 70 + 2  # every id and every appended eod, each scored once
    assert r.samples == math.ceil(r.tokens / 32)
    assert r.bytes == sum(len(d) for d in docs) and r.bits_per_byte > 0
    # Learned counting patterns are much more likely than chance.
    assert r.loss < math.log(128) - 0.5


class SuccessorModel(nn.Module):
    """Puts almost all probability on `token + 1`: the right answers of a counting task are known."""

    def __init__(self, vocab: int = 128) -> None:
        super().__init__()
        self.vocab = vocab
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, tokens, position_ids=None, attention_mask=None, labels=None):
        return 8.0 * nn.functional.one_hot((tokens + 1) % self.vocab, self.vocab).float() + self.anchor


def test_zero_shot_known_answers():
    scorer = LogLikelihoodScorer(SuccessorModel(), NullTokenizer(VOCAB), max_length=16, batch_size=2)
    items = [MultipleChoiceItem("1 2 3", ("7 9", "4 5", "4 6"), 1),
             MultipleChoiceItem("10 11", ("12 13 14 15", "12"), 0),  # longer right answer: acc_norm matters
             MultipleChoiceItem("", ("0", "1"), 1)]  # empty context: conditioned on eod
    r = score_items(scorer, items)
    assert r.loglikelihoods[0][1] > max(r.loglikelihoods[0][0], r.loglikelihoods[0][2])
    # acc: item 1 right; item 2 picks the short "12" (fewer tokens to pay for); item 3 picks "0", the
    # successor of eod 127. acc_norm (per byte) also gets item 2 right.
    assert (r.acc, r.acc_norm, r.num_items) == (pytest.approx(1 / 3), pytest.approx(2 / 3), 3)


def test_accuracy_arithmetic():
    items = [MultipleChoiceItem("c", ("a", "bbbb"), 1), MultipleChoiceItem("c", ("aa", "b"), 0),
             MultipleChoiceItem("c", ("x", "y"), 0), MultipleChoiceItem("c", ("é", "e"), 0)]
    lls = [[-2.0, -4.0], [-3.0, -1.0], [-1.0, -1.0], [-1.0, -0.9]]
    r = accuracy(items, lls)
    # acc: argmax picks 0, 1, 0 (first of ties), 1 -> right on item 3 only.
    assert r.acc == pytest.approx(1 / 4)
    # acc_norm per byte: [-2, -1] -> 1 ok; [-1.5, -1] -> 1 wrong; tie -> 0 ok; "é" is 2 bytes: [-0.5, -0.9] -> 0 ok.
    assert r.acc_norm == pytest.approx(3 / 4)


def test_windows_batching_and_rolling():
    model = SuccessorModel()
    torch.manual_seed(0)
    windows = [Window(tuple(torch.randint(0, 128, (n,)).tolist()), k) for n, k in ((5, 2), (9, 8), (3, 1))]
    batched = score_windows(model, windows, batch_size=3)
    alone = [score_windows(model, [w], batch_size=1)[0] for w in windows]
    assert [s for s, _ in batched] == pytest.approx([s for s, _ in alone], abs=1e-5)
    stream = list(range(70))
    wins = rolling_windows(stream, 32)
    assert sum(w.num_scored for w in wins) == 69 and wins[0].tokens[:2] == (0, 1) and wins[-1].tokens[-1] == 69


def test_lm_eval_adapter_methods():
    lm = MegatronLM(SuccessorModel(), NullTokenizer(VOCAB), max_length=16, max_gen_toks=10)
    req = lambda *args: SimpleNamespace(args=args)  # noqa: E731  (lm-eval Instances carry .args)
    (ll_right, greedy_right), (ll_wrong, greedy_wrong) = lm.loglikelihood([req("1 2", " 3 4"), req("1 2", " 5")])
    assert greedy_right and not greedy_wrong and ll_right > ll_wrong
    # 20 tokens (the first after eod 127), each the successor: log p = -log(1 + 127 e^-8) apiece.
    rolling = lm.loglikelihood_rolling([req(" ".join(str(i) for i in range(20)))])[0]
    assert rolling == pytest.approx(-20 * math.log1p(127 * math.exp(-8.0)), rel=1e-4)
    out = lm.generate_until([req("1 2 3", {"until": [" 9"], "max_gen_toks": 10})])
    assert out == [" 4 5 6 7 8"]  # the continuation keeps its leading space
    assert lm.rank == 0 and lm.world_size == 1


def test_adapter_is_an_lm_eval_model():
    """lm-eval is in the test extras (setup.py): this runs in CI, it is not skipped."""
    from lm_eval.api.model import LM

    assert LM_EVAL_AVAILABLE and issubclass(MegatronLM, LM)


def test_lm_eval_rolling_windows_are_lm_evals():
    """Our windows equal lm-eval's get_rolling_token_windows + make_disjoint_window (context_len=1)."""
    from lm_eval import utils

    for n, length in ((70, 32), (64, 32), (5, 32), (33, 32), (1, 4)):
        tokens = list(range(100, 100 + n))
        theirs = [utils.make_disjoint_window(w) for w in
                  utils.get_rolling_token_windows(tokens, prefix_token=7, max_seq_len=length, context_len=1)]
        ours = lm_eval_rolling_windows(tokens, 7, length)
        # lm-eval's (context, continuation) -> the model reads (context + continuation)[:-1], scores continuation
        assert [(tuple(c + x), len(x)) for c, x in theirs] == [(w.tokens, w.num_scored) for w in ours]


@pytest.mark.isa_sensitive
def test_rolling_perplexity_equals_lm_evals_hf_model_on_the_export(tmp_path):
    """Rolling log-likelihood through our adapter == lm-eval's own `hf` model on the exported folder.

    Both run in float64 except HF's LlamaRMSNorm, which computes in float32: the gap is float32 rounding (2^-24
    relative) of the normalised activations, carried through 2 layers to log-probabilities of size ~6 (log 320):
    of order 2^-24 x 6 x a few tens ~ 1e-5 per token at most; we allow 2^-14 (6e-5) per scored token, summed.
    A convention mismatch moves the sum by far more (negative controls below: the old one-token-context last
    window, and <s> instead of the end-of-document token as prefix, move it by 0.27-0.8 nats).
    """
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatron.checkpoint_conversion import export_to_hf
    from megatron.model import GPTModel
    from megatron.tokenizer import GPTSentencePieceTokenizer
    from megatron.tokenizer.train import train_sentencepiece
    from megatron.checkpoint.store import save_checkpoint

    words = "in the beginning god created heavens and earth light darkness water day night said let be".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(words[i] for i in rng.integers(0, len(words), 40)).capitalize() + "." for _ in range(200)]
    tok_file = train_sentencepiece(docs, str(tmp_path / "tok"), vocab_size=320)
    tok = GPTSentencePieceTokenizer(tok_file)
    config = parse_config(tiny_argv(vocab_size=tok.vocab_size), env={})
    torch.manual_seed(0)
    model = GPTModel(config.model).eval()
    cfg = config.to_dict()
    cfg["data"].update(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=tok_file)
    save_checkpoint(tmp_path / "ckpt", 1, {"model": model.state_dict()}, {"iteration": 1}, cfg)
    out = export_to_hf(tmp_path / "ckpt", tmp_path / "hf")

    texts = [docs[1] + " " + docs[2], docs[3][:60], docs[4] + " " + docs[5] + " " + docs[6]]
    n_tokens = [len(tok.tokenize(t)) for t in texts]
    assert max(n_tokens) > 2 * 32 and any(n % 32 for n in n_tokens)  # several windows, a partial last one
    requests = [Instance("loglikelihood_rolling", None, (t,), i) for i, t in enumerate(texts)]
    hf = HFLM(pretrained=str(out), device="cpu", dtype="float64", batch_size=4)
    theirs = hf.loglikelihood_rolling(requests, disable_tqdm=True)
    ours_lm = MegatronLM(model.double(), tok, max_length=config.model.seq_length)
    ours = ours_lm.loglikelihood_rolling(requests)
    tolerance = [n * 2.0 ** -14 for n in n_tokens]
    for a, b, tol in zip(ours, theirs, tolerance):
        assert abs(a - b) <= tol, (a, b, tol)

    # Negative controls: the conventions this test guards change the result by far more than the tolerance.
    scorer = ours_lm.scorer
    old = [sum(t for t, _ in score_windows(scorer.model, rolling_windows([tok.eod] + tok.tokenize(x), 32)))
           for x in texts]
    assert max(abs(a - b) - tol for a, b, tol in zip(old, theirs, tolerance)) > 0
    bos = [sum(t for t, _ in score_windows(scorer.model, lm_eval_rolling_windows(tok.tokenize(x), tok.bos, 32)))
           for x in texts]
    assert all(abs(a - b) > tol for a, b, tol in zip(bos, theirs, tolerance))


def test_make_demo_tasks(tmp_path):
    chapters = [{"text": "\n".join(f"verse {b}{c}{v} of the book." for v in range(6)), "book": f"B{b}", "chapter": c}
                for b in range(2) for c in range(2)]
    src = tmp_path / "valid.jsonl"
    src.write_text("".join(json.dumps(ch) + "\n" for ch in chapters))
    tool = load_tool("make_demo_tasks")
    tool.main(["--input", str(src), "--output", str(tmp_path / "a.jsonl")])
    tool.main(["--input", str(src), "--output", str(tmp_path / "b.jsonl")])
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()  # deterministic
    items = load_task(str(tmp_path / "a.jsonl"))
    assert len(items) == 2 * 2 * 5
    for raw, item in zip(map(json.loads, (tmp_path / "a.jsonl").read_text().splitlines()), items):
        book, ch, v = raw["book"][1], raw["chapter"] - 1, raw["verse"] - 1
        assert item.choices[item.label] == f"verse {book}{ch}{v + 1} of the book."
        assert len(set(item.choices)) == 4 and all(c.startswith(f"verse {book}") for c in item.choices)
    labels = {item.label for item in items}
    assert len(labels) > 1  # the answer's position varies


def test_split_scores_the_runs_held_out_documents_as_its_validation_did(tmp_path, capsys):
    """A run on one prefix cut 80,10,10: `--split valid` rebuilds the run's validation samples (same documents,
    seed and micro-batches) and equals its last validation loss; by default it reads one pass of the split.
    Scoring the whole prefix says that it holds the trained-on documents; a --split of weights is refused."""
    evaluate = load_tool("evaluate")
    corpus = write_indexed(tmp_path / "corpus", 200, seed=3)
    argv = [a for a in tiny_argv(train_iters=4, eval_interval=4, eval_iters=2, save=str(tmp_path / "ckpt"),
                                 data_cache_path=str(tmp_path / "cache")) if a != "--mock-data"]
    argv += ["--data-path", corpus, "--split", "80,10,10", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(VOCAB)]
    result = pretrain(parse_config(argv))
    load = ["--load", str(tmp_path / "ckpt"), "--device", "cpu"]
    out = evaluate.main(load + ["--split", "valid", "--eval-samples", str(2 * 8)])
    assert out["split"]["loss"] == result.valid[-1][1] and out["split"]["split"] == "80,10,10"
    tokens = int(MMapIndexedDataset(corpus).sizes[160:180].sum())  # documents [160, 180) of 200: valid
    assert evaluate.main(load + ["--split", "valid"])["split"]["samples"] == (tokens - 1) // 32
    evaluate.main(load + ["--data-path", corpus, "--eval-samples", "8"])
    assert "--split valid or --split test scores the held-out documents" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        evaluate.main(load + ["--split", "969,30,1"])
    assert "--split names a split (train, valid or test)" in capsys.readouterr().err
