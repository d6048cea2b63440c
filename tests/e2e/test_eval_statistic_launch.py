"""Every engine reports the same validation loss for the same checkpoint: the token-weighted mean over the validation
set and the data-parallel replicas. With `--eod-mask-loss` on short documents the micro-batches count different
numbers of tokens, so a mean of micro-batch (or batch) means would differ.

One checkpoint is written by the torch engine; the torch engine (1 process), DeepSpeed ZeRO-1 over 2 data-parallel
ranks and DeepSpeed's pipeline over 2 stages each load it and evaluate the validation split without training.

Bound: the engines compute the same per-token losses and add them in different orders and precisions (the torch
engine adds micro-batch sums in float64; the pipeline weights each micro-batch's float32 sum and DeepSpeed adds them
in float32 over 4 micro-batches per call and the replicas). Each float32 operation on a sum adds a relative error of
at most 2^-24 = 6e-8, and fewer than 16 of them stand between a micro-batch sum and the result, so the results agree
to 1e-6 relative. The test also checks that the mean of micro-batch means differs from the token-weighted mean by
more than 10 x that bound on this data, so it would catch an engine that reports it."""
import json

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from tests.support.data import VOCAB, data_argv
from tests.support.launch import launch_checked

RTOL = 1e-6
EVAL_SCRIPT = r'''
import json, os, sys
sys.path.insert(0, os.getcwd())
from megatron.arguments import parse_config
from megatron.training.loop import Trainer
trainer = Trainer(parse_config(sys.argv[2:]))
loss = trainer.evaluate(trainer.valid_ds)
if int(os.environ.get("RANK", "0")) == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"loss": loss}, f)
from megatron.parallel_state import finish_distributed_run
finish_distributed_run(0)
'''
MEANS_SCRIPT = r'''
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from megatron.arguments import parse_config
from megatron.training.loop import Trainer
from megatron.data.provider import build_loader
trainer = Trainer(parse_config(sys.argv[2:]))
t = trainer.config.training
loader = iter(build_loader(trainer.valid_ds, 0, t.micro_batch_size, 0, 1, 0))
sums = []
with torch.no_grad():
    for batch in trainer._batches(loader, t.eval_iters * t.num_micro_batches):
        masked, count = trainer._forward_loss(trainer.model.eval(), batch)
        sums.append([float(masked), float(count)])
with open(sys.argv[1], "w") as f:
    json.dump(sums, f)
'''


def _short_documents(prefix, num_docs: int, seed: int) -> str:
    """Counting patterns of 1 to 15 tokens, each followed by an eod: many eods per sample, in varying numbers."""
    rng = np.random.default_rng(seed)
    with MMapIndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for _ in range(num_docs):
            start, step, length = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(1, 16)
            builder.add_document(np.append((start + step * np.arange(length)) % VOCAB, VOCAB))
        builder.finalize()
    return str(prefix)


def _evaluate(tmp_path, name: str, nproc: int, argv: list[str]) -> float:
    script, out = tmp_path / "evaluate.py", tmp_path / f"{name}.json"
    script.write_text(EVAL_SCRIPT)
    launch_checked(nproc, [str(out), *argv], script=str(script))
    return json.loads(out.read_text())["loss"]


def test_torch_deepspeed_and_pipeline_engines_report_the_same_validation_loss(tmp_path):
    train, valid = _short_documents(tmp_path / "train", 600, 1), _short_documents(tmp_path / "valid", 200, 2)
    common = dict(micro_batch_size=2, global_batch_size=8, eval_iters=3, eval_interval=1000, lr_warmup_iters=0,
                  load=tmp_path / "ckpt")
    launch_checked(1, [*data_argv(train, valid, **{**common, "load": None}, train_iters=3, save=tmp_path / "ckpt",
                                  save_interval=3), "--eod-mask-loss"])
    argv = [*data_argv(train, valid, **common, train_iters=3), "--eod-mask-loss"]
    torch_loss = _evaluate(tmp_path, "torch", 1, argv)
    zero1 = _evaluate(tmp_path, "zero1", 2, [*argv, "--deepspeed", "--zero-stage", "1"])
    pipeline = _evaluate(tmp_path, "pipeline", 2, [*argv, "--deepspeed", "--zero-stage", "0",
                                                   "--pipeline-model-parallel-size", "2"])
    for name, loss in (("zero1", zero1), ("pipeline", pipeline)):
        assert abs(loss - torch_loss) <= RTOL * torch_loss, (name, loss, torch_loss)

    script, out = tmp_path / "means.py", tmp_path / "means.json"
    script.write_text(MEANS_SCRIPT)
    launch_checked(1, [str(out), *argv], script=str(script))
    sums = json.loads(out.read_text())
    assert len(sums) == 3 * 4 and len({count for _, count in sums}) > 1  # micro-batches of different token counts
    weighted = sum(s for s, _ in sums) / sum(c for _, c in sums)
    mean_of_means = sum(s / c for s, c in sums) / len(sums)
    assert abs(weighted - torch_loss) <= RTOL * torch_loss, (weighted, torch_loss)
    assert abs(mean_of_means - weighted) > 10 * RTOL * weighted, (mean_of_means, weighted)
