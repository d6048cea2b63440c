"""Parity of our GPTModel with Hugging Face LlamaForCausalLM through the converters (CPU, FP32)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron.arguments import parse_config
from megatron.checkpoint_conversion import (
    NotLlamaCompatibleError, check_llama_compatible, export_to_hf, fold_smooth_swiglu_scales, import_from_hf,
    load_gpt_checkpoint, training_flags,
)
from megatron.checkpoint.store import save_checkpoint
from megatron.config import Normalization, PositionEmbedding, SmoothSwiGLUGranularity
from megatron.model import GPTModel
from tests.support.config import tiny_argv

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # max |logit difference| in FP32 (observed ~1e-6)


def _tiny_config(tied: bool = False, **overrides):
    argv = tiny_argv(**overrides)
    if tied:
        argv.remove("--untie-embeddings-and-output-weights")
    return parse_config(argv)


def _save(tmp_path, config, data_overrides=None):
    """A tiny GQA model (4 heads, 2 kv heads) saved as iteration 7 with optimizer and FP8 state."""
    torch.manual_seed(0)
    model = GPTModel(config.model).eval()
    with torch.no_grad():  # non-trivial norm weights, so swapped norms would show
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    cfg = config.to_dict()
    cfg["data"].update(data_overrides or {})
    payload = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []},
               "fp8": {"scale": torch.ones(3)}}
    save_checkpoint(tmp_path / "ckpt", 7, payload, {"iteration": 7}, cfg)
    return tmp_path / "ckpt", model


def _tokens(vocab: int, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tied", [False, True])
def test_ours_to_hf_logits_match(tmp_path, tied):
    config = _tiny_config(tied)
    save_dir, model = _save(tmp_path, config)
    out = export_to_hf(save_dir, tmp_path / "hf", with_tokenizer=False)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["num_key_value_heads"] == 2 and hf_cfg["head_dim"] == 16
    assert hf_cfg["tie_word_embeddings"] is tied and hf_cfg["vocab_size"] == config.model.padded_vocab_size
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens(config.model.padded_vocab_size)
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < TOL
    assert not list(tmp_path.glob(".tmp_*")), "temporary export folder left behind"


def test_hf_to_ours_logits_match(tmp_path):
    hf_config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500.0,
        tie_word_embeddings=False)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    result = import_from_hf(tmp_path / "hf", tmp_path / "ours", seq_length=32)
    loaded = load_gpt_checkpoint(tmp_path / "ours")
    assert loaded.iteration == 0 and loaded.model_config.kv_channels == 12
    tokens = _tokens(96, 32)
    with torch.no_grad():
        diff = (loaded.model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < TOL
    # The printed flags rebuild exactly this model config.
    assert "--finetune" not in result.flags and result.flags[-2:] == ["--load", str(tmp_path / "ours")]
    flags = training_flags(loaded.model_config)
    rebuilt = parse_config(flags + ["--mock-data", "--vocab-size", "96", "--micro-batch-size", "1",
                                    "--train-iters", "1", "--lr", "1e-4", "--hidden-dropout", "0",
                                    "--attention-dropout", "0", "--init-method-std", "0.02"]).model
    assert rebuilt == loaded.model_config


def test_round_trip_is_exact(tmp_path):
    config = _tiny_config()
    save_dir, model = _save(tmp_path, config)
    export_to_hf(save_dir, tmp_path / "hf", with_tokenizer=False)
    import_from_hf(tmp_path / "hf", tmp_path / "back", seq_length=config.model.seq_length)
    back = load_gpt_checkpoint(tmp_path / "back").model.state_dict()
    original = model.state_dict()
    assert back.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor), key


def test_iteration_selection_and_iteration_folder(tmp_path):
    config = _tiny_config()
    save_dir, _ = _save(tmp_path, config)
    assert load_gpt_checkpoint(save_dir / "iter_0000007").iteration == 7
    assert load_gpt_checkpoint(save_dir, iteration=7).iteration == 7
    with pytest.raises(FileNotFoundError, match="iter_0000007"):
        load_gpt_checkpoint(save_dir, iteration=3)
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_to_hf(save_dir, tmp_path, with_tokenizer=False)


@pytest.mark.parametrize("change, reason", [
    ({"normalization": Normalization.LAYERNORM}, "LayerNorm"),
    ({"swiglu": False, "ffn_hidden_size": 256}, "GeLU"),
    ({"add_bias_linear": True}, "biases"),
    ({"position_embedding_type": PositionEmbedding.LEARNED_ABSOLUTE}, "learned_absolute"),
])
def test_rejects_what_llama_cannot_express(tmp_path, change, reason):
    model_config = dataclasses.replace(_tiny_config().model, **change)
    with pytest.raises(NotLlamaCompatibleError, match=reason):
        check_llama_compatible(model_config)
    config = dataclasses.replace(_tiny_config(), model=model_config)
    save_checkpoint(tmp_path / "ckpt", 1, {"model": GPTModel(model_config).state_dict()}, {}, config.to_dict())
    with pytest.raises(ValueError, match=reason):
        export_to_hf(tmp_path / "ckpt", tmp_path / "hf", with_tokenizer=False)
    assert not (tmp_path / "hf").exists()


def test_smooth_swiglu_model_exports_its_plain_weights(tmp_path):
    config = _tiny_config().model
    state = GPTModel(config).state_dict()
    assert fold_smooth_swiglu_scales(state, config) is state
    full = parse_config(tiny_argv("--smooth-swiglu", fp8_format="hybrid", smooth_swiglu_granularity="channel"))
    smooth = full.model
    assert smooth.smooth_swiglu is SmoothSwiGLUGranularity.CHANNEL
    folded = fold_smooth_swiglu_scales(state, smooth)
    assert all(torch.equal(folded[k], state[k]) for k in state)
    # The training-time scales are a per-micro-batch re-parametrisation: the weights export unchanged.
    save_checkpoint(tmp_path / "ckpt", 1, {"model": state}, {}, full.to_dict())
    export_to_hf(tmp_path / "ckpt", tmp_path / "hf", with_tokenizer=False)
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.layers.0.mlp.down_proj.weight"], state["decoder.layers.0.mlp.linear_fc2.weight"])


def test_sentencepiece_tokenizer_exported(tmp_path):
    pytest.importorskip("sentencepiece")
    from megatron.tokenizer import GPTSentencePieceTokenizer
    from megatron.tokenizer.train import train_sentencepiece

    words = "in the beginning god created heavens and earth light darkness water day night said let be".split()
    gen = torch.Generator().manual_seed(0)
    docs = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (40,), generator=gen)).capitalize() + "."
            for _ in range(200)]
    model_file = train_sentencepiece(docs, str(tmp_path / "tok"), vocab_size=320)
    ours_tok = GPTSentencePieceTokenizer(model_file)
    config = _tiny_config(vocab_size=ours_tok.vocab_size)
    save_dir, _ = _save(tmp_path, config, {"tokenizer_type": "GPTSentencePieceTokenizer",
                                           "tokenizer_model": model_file})
    out = export_to_hf(save_dir, tmp_path / "hf")
    assert (out / "tokenizer.model").exists() and (out / "tokenizer.json").exists()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "Let there be light, and the earth said: day and night.\nIn the beginning"
    assert hf_tok.encode(text, add_special_tokens=False) == ours_tok.tokenize(text)
    assert hf_tok.decode(ours_tok.tokenize(text)) == text
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours_tok.eod


def test_import_refuses_a_tokenizer_that_does_not_fit_the_vocabulary(tmp_path):
    """A 300-token SentencePiece model for a 512-row table: refused at import, naming both sizes."""
    pytest.importorskip("sentencepiece")
    from megatron.checkpoint_conversion.convert import import_from_hf as import_hf
    from megatron.tokenizer.train import train_sentencepiece

    words = "in the beginning god created heavens and earth light darkness water day night".split()
    docs = [" ".join(words[(i * 5 + j) % len(words)] for j in range(30)) for i in range(100)]
    tok_file = train_sentencepiece(docs, str(tmp_path / "tok"), vocab_size=300)
    hf_config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"has 300 tokens but the model's vocabulary table has 512 rows"):
        import_hf(tmp_path / "hf", tmp_path / "ours", tokenizer_type="GPTSentencePieceTokenizer",
                  tokenizer_model=tok_file)
    assert not (tmp_path / "ours").exists()


def test_null_tokenizer_checkpoint_exports_the_model_alone(tmp_path, caplog):
    config = _tiny_config()
    save_dir, _ = _save(tmp_path, config, {"tokenizer_type": "NullTokenizer"})
    with caplog.at_level("WARNING"):
        out = export_to_hf(save_dir, tmp_path / "hf")
    assert (out / "config.json").exists() and not (out / "tokenizer_config.json").exists()
    assert "exporting the model alone" in caplog.text and "not found" not in caplog.text


def test_the_safetensors_file_follows_the_umask_like_its_folder(tmp_path):
    import os
    import stat

    from megatron.checkpoint_conversion.hf_folder import save_safetensors

    umask = os.umask(0o022)
    try:
        save_safetensors({"w": torch.ones(2, 2)}, tmp_path / "model.safetensors", torch.bfloat16)
        (tmp_path / "config.json").write_text("{}")
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644}
