"""Tokenizers: round trips per `--tokenizer-type` on tiny tokenizer files built here, the Megatron
conventions (eod ids, vocabulary sizes, padding rule) and the errors for bad flags."""
import json
import os

import pytest

from megatron.config import DataConfig
from megatron.tokenizer import build_tokenizer, pad_vocab_size
from megatron.tokenizer.train import chunk_text, train_sentencepiece

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "an old sphinx of black quartz judge my vow").split()
TEXT = "The quick brown fox, jumps over the lazy dog.\nSeven wizards!"


def corpus(n: int = 300) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 9)) + "." for i in range(n)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    return train_sentencepiece(corpus(), str(tmp_path_factory.mktemp("sp") / "tok"), vocab_size=400)


def roundtrip(tok, text: str = TEXT) -> list[int]:
    ids = tok.tokenize(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text
    return ids


def test_gpt_sentencepiece_roundtrip(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model))
    assert (tok.vocab_size, tok.bos, tok.eod) == (400, 1, 2)  # unk 0, bos 1, eos 2 as trained
    ids = roundtrip(tok)
    assert len(ids) < len(TEXT) / 2  # real merges, not one piece per character


def test_megatron_sentencepiece_adds_special_tokens(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    # <CLS> <SEP> <EOD> <MASK> and <PAD> (the model has no pad) are appended; <s> and </s> exist.
    assert tok.vocab_size == 405
    assert tok.eod == 402 and (tok.bos, tok.eos, tok.pad) == (1, 2, 404)
    roundtrip(tok)
    ids = tok.tokenize("quick fox<EOD>lazy dog")
    assert ids.count(tok.eod) == 1
    assert tok.detokenize(ids) == "quick fox<EOD>lazy dog"


def test_hf_tokenizer_file_and_folder(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    raw.save(str(path))
    for model in (str(path), str(tmp_path)):  # file, and a folder holding only tokenizer.json
        tok = build_tokenizer(DataConfig(tokenizer_type="HFTokenizer", tokenizer_model=model))
        assert (tok.bos, tok.eod, tok.vocab_size) == (0, 1, raw.get_vocab_size())
        roundtrip(tok)
    saved = tmp_path / "saved"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>").save_pretrained(str(saved))
    assert (saved / "tokenizer_config.json").exists()
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(saved)))
    assert tok.eod == 1
    roundtrip(tok)


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus(), vocab_size=320, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(tmp_path))
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                     merge_file=str(tmp_path / "merges.txt"))
    tok = build_tokenizer(cfg)
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert tok.eod == vocab["<|endoftext|>"] and tok.bos is None and tok.vocab_size == len(vocab)
    ids = roundtrip(tok)
    assert len(ids) < len(TEXT) / 2


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert (tok.vocab_size, tok.eod, tok.bos) == (101, 100, None)
    assert tok.tokenize(" 5 7\t99 100 ") == [5, 7, 99, 100]
    assert tok.detokenize([5, 7, 100]) == "5 7 100"
    with pytest.raises(ValueError, match="integer ids"):
        tok.tokenize("5 seven")
    with pytest.raises(ValueError, match="--vocab-size"):
        tok.tokenize("101")


@pytest.mark.parametrize("cfg, flag", [
    (DataConfig(tokenizer_type=None), "--tokenizer-type is required"),
    (DataConfig(tokenizer_type="GPT2Tokenizer"), "unknown --tokenizer-type 'GPT2Tokenizer'"),
    (DataConfig(tokenizer_type="GPTSentencePieceTokenizer"), "needs --tokenizer-model"),
    (DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nonexistent/tok.model"),
     "--tokenizer-model '/nonexistent/tok.model' does not exist"),
    (DataConfig(tokenizer_type="HFTokenizer", tokenizer_model="/nonexistent"), "--tokenizer-model"),
    (DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="/nonexistent/vocab.json"), "--vocab-file"),
    (DataConfig(tokenizer_type="NullTokenizer"), "needs --vocab-size"),
])
def test_bad_flags_name_the_flag(cfg, flag):
    with pytest.raises(ValueError, match=flag.replace("(", r"\(")):
        build_tokenizer(cfg)


def test_gpt2_missing_merge_file(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json")))


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 128) == 50304
    assert pad_vocab_size(50257, 128, tensor_model_parallel_size=2) == 50432
    assert pad_vocab_size(4096, 128, 4) == 4096 and pad_vocab_size(4097, 128) == 4224
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        pad_vocab_size(100, 0)


def test_chunk_text_keeps_every_word_under_the_limit():
    line = " ".join(f"word{i}" for i in range(3000)) + " " + "x" * 250
    chunks = list(chunk_text("short line\n\n" + line, max_bytes=100))
    assert chunks[0] == "short line"
    assert all(len(c.encode()) <= 100 for c in chunks)
    assert " ".join(chunks[1:]).split() == line.split()[:-1] + ["x" * 100, "x" * 100, "x" * 50]


def test_sentencepiece_training_sees_long_documents(tmp_path):
    # "ж" occurs only in lines far longer than SentencePiece's sentence limit: without chunking
    # those lines would be dropped and "ж" would fall back to bytes.
    long_doc = " ".join(["жук"] * 3000)
    model = train_sentencepiece(corpus(200) + [long_doc] * 3, str(tmp_path / "tok"), vocab_size=400)
    assert sorted(os.listdir(tmp_path)) == ["tok.model", "tok.vocab"]
    tok = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model))
    assert tok.sp.piece_to_id("ж") != tok.sp.unk_id()
    assert len(tok.tokenize("жук")) <= 2


def test_a_tokenizer_file_of_the_wrong_kind_is_one_line_naming_the_kinds(sp_model, tmp_path):
    """The .vocab that tools/train_tokenizer.py writes beside the .model, a tokenizer.json given to a SentencePiece
    type, and a .model given to HFTokenizer: each one ValueError line naming --tokenizer-model and what to pass."""
    vocab = sp_model[:-len(".model")] + ".vocab"
    assert os.path.exists(vocab)
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}))
    cases = [("GPTSentencePieceTokenizer", vocab, f"(its model is {sp_model!r})"),
             ("SentencePieceTokenizer", str(tokenizer_json), "--tokenizer-type HFTokenizer"),
             ("HFTokenizer", sp_model, "--tokenizer-type GPTSentencePieceTokenizer or SentencePieceTokenizer")]
    for kind, path, hint in cases:
        with pytest.raises(ValueError) as err:
            build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=path))
        message = str(err.value)
        assert "\n" not in message and f"--tokenizer-model {path!r} is not a" in message and hint in message, message


@pytest.mark.parametrize("vocab_size,needle", [(40, r"is too small for this corpus: it needs at least (\d+) pieces"),
                                               (50000, r"is too large for this corpus: SentencePiece can make at "
                                                       r"most (\d+) pieces")])
def test_a_vocab_size_the_corpus_cannot_fill_names_the_bound_and_the_way_to_move(tmp_path, vocab_size, needle):
    """Each refusal names SentencePiece's own bound, on the side the value must move to."""
    import re

    docs = corpus(50)
    with pytest.raises(ValueError, match=f"^--vocab-size {vocab_size} {needle}[^\n]*$") as err:
        train_sentencepiece(docs, str(tmp_path / "bad"), vocab_size=vocab_size)
    bound = int(re.search(needle, str(err.value)).group(1))
    assert (bound > vocab_size) == (vocab_size == 40)
