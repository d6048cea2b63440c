"""The tokenizers behind `--tokenizer-type`, all exposing one small interface.

Every tokenizer has `vocab_size` (unpadded), `eod` (the end-of-document id appended by
`tools/preprocess_data.py --append-eod`), `bos` (an id or None), `tokenize(text) -> list[int]` and
`detokenize(ids) -> str`. Padding the vocabulary for the embedding table is a separate, pure rule
(`pad_vocab_size`), applied once by whoever builds the model config.

Conventions follow Megatron-LM so that existing `.bin/.idx` files and launch scripts keep working:

* `SentencePieceTokenizer` appends Megatron's special tokens (`<CLS>`, `<SEP>`, `<EOD>`, `<MASK>`,
  and `<PAD>`/`<BOS>`/`<EOS>` when the model lacks them) after the SentencePiece vocabulary;
  `eod` is the id of `<EOD>`.
* `GPTSentencePieceTokenizer` uses the model as is: `eod` is its `</s>` (eos) id.
* `HFTokenizer` (alias `HuggingFaceTokenizer`) loads a local folder or `tokenizer.json`; `eod` is
  the eos token. Text is encoded without automatically added special tokens.
* `GPT2BPETokenizer` reads `vocab.json` + `merges.txt`; `eod` is `<|endoftext|>`.
* `NullTokenizer` reads whitespace-separated ids. As in Megatron-LM, `--vocab-size N` gives a
  vocabulary of N + 1 ids, and `eod = N` (= `vocab_size - 1`) is the extra one.

Optional dependencies (sentencepiece, tokenizers, transformers) are imported only when needed.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterable, Optional, Sequence

from megatron.config import DataConfig

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HFTokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


def pad_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int,
                   tensor_model_parallel_size: int = 1) -> int:
    """Megatron's rule: round up to a multiple of `divisible_by * tp` so each TP shard is aligned."""
    if orig_vocab_size <= 0:
        raise ValueError(f"vocabulary size must be positive, got {orig_vocab_size}")
    if make_vocab_size_divisible_by <= 0 or tensor_model_parallel_size <= 0:
        raise ValueError("--make-vocab-size-divisible-by and --tensor-model-parallel-size must be positive, "
                         f"got {make_vocab_size_divisible_by} and {tensor_model_parallel_size}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def _require_file(path: Optional[str], flag: str, tokenizer_type: str, what: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}: pass {what}")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path!r} does not exist: pass {what} "
                         "(tools/train_tokenizer.py or tools/prepare_demo_data.py can make one)")
    return path


def _load_sentencepiece(model_file: str):
    """The SentencePiece model in `model_file`, or one line naming the flag and the kinds of file accepted."""
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as err:
        hint = ""
        if model_file.endswith(".vocab") and os.path.exists(model_file[:-len(".vocab")] + ".model"):
            hint = f" (its model is {model_file[:-len('.vocab')] + '.model'!r})"
        raise ValueError(f"--tokenizer-model {model_file!r} is not a SentencePiece model{hint}: pass the .model "
                         "file (tools/train_tokenizer.py writes NAME.model beside NAME.vocab); for a Hugging Face "
                         "tokenizer.json or folder use --tokenizer-type HFTokenizer "
                         f"(sentencepiece: {str(err).splitlines()[0] if str(err) else type(err).__name__})") from None


class SentencePieceTokenizer:
    """Megatron-LM's `SentencePieceTokenizer`: SentencePiece plus appended special tokens."""

    SPECIAL_TOKENS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")

    def __init__(self, model_file: str) -> None:
        self.sp = _load_sentencepiece(model_file)
        self._vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self._special: dict[str, int] = {}
        for token in self.SPECIAL_TOKENS:
            self._add_special(token)
        ids = {}
        for name, model_id, fallback in (("pad", self.sp.pad_id(), "<PAD>"), ("bos", self.sp.bos_id(), "<BOS>"),
                                         ("eos", self.sp.eos_id(), "<EOS>")):
            ids[name] = self._add_special(self.sp.id_to_piece(model_id) if model_id >= 0 else fallback)
        self.pad, self.bos, self.eos = ids["pad"], ids["bos"], ids["eos"]
        self.eod = self._special["<EOD>"]
        self._inv_special = {i: t for t, i in self._special.items()}
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in self._special) + ")")

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
        self._special[token] = self._vocab[token]
        return self._vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize(self, text: str) -> list[int]:
        # Special-token strings written in the text map to their ids, as in Megatron-LM.
        ids: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:
                ids.append(self._special[part])
            elif part:
                ids.extend(self.sp.encode_as_ids(part))
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        text, run = "", []
        for i in ids:
            i = int(i)
            if i in self._inv_special:
                text += self.sp.decode_ids(run) + self._inv_special[i]
                run = []
            else:
                run.append(i)
        return text + self.sp.decode_ids(run)


class GPTSentencePieceTokenizer:
    """A SentencePiece model used as is (Llama style): `eod` is the model's eos id."""

    def __init__(self, model_file: str) -> None:
        self.sp = _load_sentencepiece(model_file)
        if self.sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_file!r} has no eos piece, which GPTSentencePieceTokenizer "
                             "uses as end of document: retrain it with an eos id (tools/train_tokenizer.py does)")
        self.eod = self.sp.eos_id()
        self.bos = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


class HFTokenizer:
    """A local Hugging Face tokenizer: a folder (`AutoTokenizer`) or a `tokenizer.json` file."""

    EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
    BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>")

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            if os.path.isdir(path):
                config = os.path.join(path, "tokenizer_config.json")
                if os.path.exists(config) or not os.path.exists(os.path.join(path, "tokenizer.json")):
                    self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
                else:
                    self.hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
            else:
                self.hf = PreTrainedTokenizerFast(tokenizer_file=path)
        except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a file it cannot read
            raise ValueError(f"--tokenizer-model {path!r} is not a Hugging Face tokenizer: pass a tokenizer.json or "
                             "a folder saved by save_pretrained; for a SentencePiece .model use --tokenizer-type "
                             "GPTSentencePieceTokenizer or SentencePieceTokenizer "
                             f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        vocab = self.hf.get_vocab()
        self.eod = self.hf.eos_token_id
        if self.eod is None:
            self.eod = next((vocab[t] for t in self.EOD_CANDIDATES if t in vocab), None)
        if self.eod is None:
            raise ValueError(f"--tokenizer-model {path!r} defines no eos token and none of {self.EOD_CANDIDATES}: "
                             "set eos_token in its tokenizer_config.json or add an end-of-text token")
        self.bos = self.hf.bos_token_id
        if self.bos is None:
            self.bos = next((vocab[t] for t in self.BOS_CANDIDATES if t in vocab), None)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def tokenize(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids])


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from local `vocab.json` and `merges.txt` (via the `tokenizers` package)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            self.bpe = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as err:  # the Rust error names neither flag
            raise ValueError(f"cannot read GPT-2 BPE files --vocab-file {vocab_file!r} / --merge-file "
                             f"{merge_file!r}: {err}. Pass GPT-2's vocab.json and merges.txt") from err
        self.bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.bpe.decoder = decoders.ByteLevel()
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if "<|endoftext|>" not in vocab:
            raise ValueError(f"--vocab-file {vocab_file!r} has no '<|endoftext|>' token, which GPT2BPETokenizer "
                             "uses as end of document")
        self.eod = vocab["<|endoftext|>"]
        self.bos = None

    @property
    def vocab_size(self) -> int:
        return self.bpe.get_vocab_size()

    def tokenize(self, text: str) -> list[int]:
        return self.bpe.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.bpe.decode([int(i) for i in ids])


class NullTokenizer:
    """Text is whitespace-separated token ids; `eod` is the extra id `vocab_size - 1` (Megatron-LM)."""

    def __init__(self, vocab_size: int) -> None:
        self._ids_without_eod = int(vocab_size)
        self.eod = self._ids_without_eod
        self.bos = None

    @property
    def vocab_size(self) -> int:
        return self._ids_without_eod + 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as err:
            raise ValueError(f"NullTokenizer expects whitespace-separated integer ids: {err}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer id {bad[0]} outside [0, {self.vocab_size}) (--vocab-size "
                             f"{self._ids_without_eod}, plus eod): raise --vocab-size")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(cfg: DataConfig):
    """The tokenizer selected by `cfg.tokenizer_type`, with its files checked up front."""
    kind = cfg.tokenizer_type
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        model = _require_file(cfg.tokenizer_model, "--tokenizer-model", kind, "a SentencePiece .model file")
        return SentencePieceTokenizer(model) if kind == "SentencePieceTokenizer" else GPTSentencePieceTokenizer(model)
    if kind in ("HFTokenizer", "HuggingFaceTokenizer"):
        path = _require_file(cfg.tokenizer_model, "--tokenizer-model", kind,
                             "a local tokenizer folder or tokenizer.json (nothing is downloaded)")
        return HFTokenizer(path)
    if kind == "GPT2BPETokenizer":
        vocab = _require_file(cfg.vocab_file, "--vocab-file", kind, "GPT-2's vocab.json")
        merges = _require_file(cfg.merge_file, "--merge-file", kind, "GPT-2's merges.txt")
        return GPT2BPETokenizer(vocab, merges)
    if kind == "NullTokenizer":
        if cfg.vocab_size is None or cfg.vocab_size <= 0:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N (a positive number of ids; "
                             "eod is the extra id N)")
        return NullTokenizer(cfg.vocab_size)
    if kind is None:
        raise ValueError(f"--tokenizer-type is required: one of {', '.join(TOKENIZER_TYPES)}")
    raise ValueError(f"unknown --tokenizer-type {kind!r}: use one of {', '.join(TOKENIZER_TYPES)}")
