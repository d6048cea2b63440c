"""Generation: a model trained on the mock "successor" language continues its chain; sampling controls."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from megatron.arguments import parse_config
from megatron.data.mock import MockGPTDataset
from megatron.evaluation.generation import SamplingConfig, filter_logits, generate
from megatron.training.loop import pretrain
from tests.support.config import load_tool, tiny_argv

NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]  # 128 ids = the mock vocabulary


def _generate_tool():
    return load_tool("generate").main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model trained 16 iterations on --mock-data, where every token has one likely successor."""
    save = tmp_path_factory.mktemp("gen") / "ckpt"
    pretrain(parse_config(tiny_argv(train_iters=16, eval_interval=1000, save=str(save))))
    return str(save)


def test_greedy_continues_the_learned_pattern(checkpoint):
    successor = MockGPTDataset(128, 32, 1, seed=1234).successor  # the run's --seed
    chain = [5]
    for _ in range(20):
        chain.append(int(successor[chain[-1]]))
    out = _generate_tool()(["--load", checkpoint, "--prompt", "5", "--greedy", "--max-new-tokens", "20",
                            "--ignore-eod", "--device", "cpu", *NULL_TOKENIZER])
    generated = [int(t) for t in out[0].split()]
    assert len(generated) == 20
    matches = sum(a == b for a, b in zip(generated, chain[1:]))
    assert matches >= 18, (generated, chain[1:])


def test_determinism_and_top_k_one_is_greedy(checkpoint):
    run = _generate_tool()
    base = ["--load", checkpoint, "--prompt", "3 9", "--max-new-tokens", "12", "--ignore-eod", "--device", "cpu",
            *NULL_TOKENIZER]
    greedy = run(base + ["--greedy"])
    assert run(base + ["--greedy"]) == greedy
    assert run(base + ["--top-k", "1", "--temperature", "1.3", "--seed", "7"]) == greedy
    hot = base + ["--temperature", "2.0", "--top-p", "0.99"]
    assert run(hot + ["--seed", "1"]) == run(hot + ["--seed", "1"])
    samples = run(hot + ["--seed", "1", "--num-samples", "3"])
    assert len(samples) == 3 and len(set(samples)) > 1  # different seeds, different continuations


def test_filter_logits():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda x: torch.isfinite(x).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.8)) == [0, 1]  # 0.5 + 0.3 reaches 0.8
    assert kept(filter_logits(logits, top_p=0.81)) == [0, 1, 2]
    assert kept(filter_logits(logits[[2, 0, 3, 1]], top_p=0.6)) == [1, 3]  # order does not matter
    assert kept(filter_logits(logits, top_p=0.1)) == [0]  # the most likely token always stays


class _PrefersPadding(nn.Module):
    """Most likely next token is always 127, a padding id when the tokenizer has 100 ids."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, tokens, position_ids=None, attention_mask=None, labels=None):
        logits = torch.zeros(*tokens.shape, 128) + self.anchor
        logits[..., 127] = 10.0
        logits[..., 42] = 5.0
        return logits


def test_padding_ids_never_generated_and_eod_stops():
    model = _PrefersPadding()
    out = generate(model, [1, 2], SamplingConfig(max_new_tokens=5, greedy=True), max_length=8, vocab_size=100)
    assert out == [42] * 5
    assert generate(model, [1], SamplingConfig(max_new_tokens=5, greedy=True), 8, eod=127) == []
    sampled = generate(model, [1], SamplingConfig(max_new_tokens=50, temperature=1.0), 8, seed=3, vocab_size=100)
    assert len(sampled) == 50 and max(sampled) < 100


@pytest.mark.parametrize("kwargs, flag", [({"top_p": 0.0}, "--top-p"), ({"temperature": -1.0}, "--temperature"),
                                          ({"top_k": -2}, "--top-k"), ({"max_new_tokens": -1}, "--max-new-tokens")])
def test_sampling_config_validation(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingConfig(**kwargs)
