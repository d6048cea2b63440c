"""Flag validation: every error names the flag and the fix; unsupported flags are refused."""
import re

import pytest

from megatron.arguments import parse_config
from megatron.config import LrDecayStyle, Normalization, PositionEmbedding
from megatron.model import GPTModel
from megatron.perf.flops import count_parameters
from tests.support.config import tiny_argv


def test_tiny_config_resolves():
    cfg = parse_config(tiny_argv())
    assert cfg.model.padded_vocab_size == 128
    assert cfg.model.kv_channels == 16 and cfg.model.num_key_value_heads == 2
    assert cfg.model.normalization is Normalization.RMSNORM
    assert cfg.model.position_embedding_type is PositionEmbedding.ROPE
    assert cfg.training.num_micro_batches == 2
    assert cfg.scheduler.decay_style is LrDecayStyle.COSINE and cfg.scheduler.decay_iters == 20
    assert cfg.fp8 is None


@pytest.mark.parametrize("overrides, switches, message", [
    (dict(global_batch_size=6), [], "--global-batch-size 6 must be divisible by --micro-batch-size 4"),
    (dict(lr=None), [], "missing required flag: --lr "),
    (dict(train_samples=100), [], "exactly one of --train-iters and --train-samples"),
    (dict(num_key_value_heads=3), [], "--num-key-value-heads 3"),
    (dict(hidden_size=66), [], "--hidden-size 66 must be divisible by --num-attention-heads"),
    (dict(max_position_embeddings=16), [], "--seq-length 32 exceeds --max-position-embeddings 16"),
    (dict(vocab_size=None), [], "--vocab-size is required"),
    (dict(lr_warmup_iters=50), [], "warm-up (50 iterations) is longer than the decay"),
    (dict(min_lr=1.0), [], "--min-lr 1.0 is larger than --lr"),
    ({}, ["--fp16"], "--fp16 is not supported: use --bf16"),
    (dict(zero_stage=1), [], "--deepspeed_config and --zero-stage need --deepspeed"),
    (dict(pipeline_model_parallel_size=2), [], "world size 1 is not divisible by tensor x pipeline parallel size 2"),
    (dict(tensor_model_parallel_size=2), [], "world size 1 is not divisible by tensor x pipeline parallel size 2"),
    (dict(fp8_optimizer_block_size=128), [], "--fp8-optimizer-* flags need --optimizer fp8adam"),
    ({}, ["--no-fp8-wgrad"], "only apply to FP8 training: add --fp8-format"),
    (dict(fp8_format="hybrid", fp8_first_last_layers_bf16=1), [], "keeps every one of the 2 layers"),
])
def test_validation_errors_name_the_flag(overrides, switches, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(tiny_argv(*switches, **overrides))


def test_no_data_source_is_an_error():
    argv = [a for a in tiny_argv() if a != "--mock-data"]
    with pytest.raises(ValueError, match="--data-path"):
        parse_config(argv)


def test_train_samples_and_warmup_fraction():
    cfg = parse_config(tiny_argv(train_iters=None, train_samples=81, lr_warmup_iters=None, lr_warmup_fraction=0.25))
    assert cfg.training.train_iters == 11  # ceil(81 / 8)
    assert cfg.scheduler.warmup_iters == 2  # int(0.25 * 11)


def test_analytic_parameter_count_matches_model():
    for switches in ([], ["--normalization", "LayerNorm"]):
        cfg = parse_config(tiny_argv(*switches))
        assert count_parameters(cfg.model) == GPTModel(cfg.model).num_parameters()
    argv = [a for a in tiny_argv() if a not in ("--untie-embeddings-and-output-weights", "--disable-bias-linear")]
    cfg = parse_config(argv)
    assert count_parameters(cfg.model) == GPTModel(cfg.model).num_parameters()


def test_fp8_weight_copies_are_those_of_the_converted_model():
    """2 bytes (FP8 and its transpose) per weight of every layer `convert_to_fp8` swaps; one linear at ZeRO-3."""
    from megatron.fp8 import Fp8Linear, convert_to_fp8
    from megatron.model import GPTModel
    from megatron.perf.flops import memory_estimate_bytes

    for extra in ((), ("--fp8-mlp-fc2-bf16",), ("--fp8-first-last-layers-bf16", "1")):
        config = parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", *extra, num_layers=4))
        model = GPTModel(config.model, device="meta")
        convert_to_fp8(model, config.fp8)
        sizes = [m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear)]
        got = memory_estimate_bytes(config)["fp8_weights_in_step_GiB"] * 2**30
        assert got == pytest.approx(2.0 * sum(sizes), rel=1e-12), extra
    zero3 = parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", "--deepspeed", "--zero-stage", "3",
                                   num_layers=4), world_size=2)
    assert memory_estimate_bytes(zero3)["fp8_weights_in_step_GiB"] * 2**30 == pytest.approx(2.0 * max(sizes))
    assert memory_estimate_bytes(parse_config(tiny_argv("--bf16")))["fp8_weights_in_step_GiB"] == 0.0


def test_memory_estimate_counts_fp8_saved_activations():
    """FP8 linears keep the inputs of QKV, proj, fc1 (h wide) and fc2 (ffn wide) in 1 byte instead of 2."""
    from megatron.perf.flops import memory_estimate_bytes

    shape = dict(num_layers=4, seq_length=32, micro_batch_size=4)
    bf16 = memory_estimate_bytes(parse_config(tiny_argv("--bf16", **shape)))
    fp8 = memory_estimate_bytes(parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", **shape)))
    cfg = parse_config(tiny_argv(**shape)).model
    per_layer = 32 * 4 * (3 * cfg.hidden_size + cfg.ffn_hidden_size)
    assert (bf16["activations_GiB"] - fp8["activations_GiB"]) * 2**30 == pytest.approx(4 * per_layer, rel=1e-12)
    edges = memory_estimate_bytes(parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid",
                                                         "--fp8-first-last-layers-bf16", "1", **shape)))
    assert (bf16["activations_GiB"] - edges["activations_GiB"]) * 2**30 == pytest.approx(2 * per_layer, rel=1e-12)
    full = dict(shape, recompute_granularity="full")
    fp8_full = memory_estimate_bytes(parse_config(tiny_argv("--bf16", "--fp8-format", "hybrid", **full)))
    bf16_full = memory_estimate_bytes(parse_config(tiny_argv("--bf16", **full)))
    assert fp8_full.pop("fp8_weights_in_step_GiB") > 0 and bf16_full.pop("fp8_weights_in_step_GiB") == 0
    assert fp8_full == bf16_full  # only BF16 layer inputs are kept
    tp = dict(full, tensor_model_parallel_size=2)
    kept = memory_estimate_bytes(parse_config(tiny_argv("--bf16", **tp), world_size=2))["activations_GiB"]
    split = memory_estimate_bytes(parse_config(tiny_argv("--bf16", "--sequence-parallel", **tp),
                                               world_size=2))["activations_GiB"]
    assert kept == bf16_full["activations_GiB"] and split * 2 == kept  # sequence parallel: half the tokens each


def test_distributed_timeout_minutes_reaches_the_process_group(monkeypatch):
    """Megatron's --distributed-timeout-minutes (a hung rank used to be waited for 10 minutes, hard-coded)."""
    import datetime

    import torch.distributed as dist

    from megatron.accelerator import get_accelerator
    from megatron.parallel_state import initialize_parallel_state

    config = parse_config(tiny_argv("--distributed-timeout-minutes", "3"), world_size=1)
    assert config.parallel.distributed_timeout_minutes == 3.0
    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setenv("MEGATRON_FORCE_COLLECTIVES", "1")  # a one-process group, so that init_process_group is called
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(Stop):
        initialize_parallel_state(config.parallel, get_accelerator("cpu"))
    assert seen["timeout"] == datetime.timedelta(minutes=3)
    with pytest.raises(ValueError, match="--distributed-timeout-minutes must be > 0"):
        parse_config(tiny_argv("--distributed-timeout-minutes", "0"), world_size=1)


def test_zero_stage_from_the_json_counts_as_the_flag(tmp_path):
    """A stage given only in --deepspeed_config is resolved at parse time: the torch.compile refusal, the memory
    estimate and the compile plan see it (a ZeRO-3 JSON run used to warm up compiled code on partitioned weights)."""
    import json

    from megatron.model.compile import plan_torch_compile

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    argv = tiny_argv("--deepspeed", "--deepspeed_config", str(path), train_iters=100)
    config = parse_config(argv, world_size=2)
    assert config.parallel.zero_stage == 3
    assert plan_torch_compile(config, "cuda").blocks is False  # ZeRO-3: blocks stay eager under auto
    with pytest.raises(ValueError, match="--torch-compile on is not supported with --zero-stage 3"):
        parse_config(argv + ["--torch-compile", "on"], world_size=2)
    assert not parse_config(tiny_argv("--deepspeed"), world_size=2).parallel.zero_stage  # DeepSpeed's default 0
    path.write_text(json.dumps({"zero_optimization": {"stage": "three"}}))
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        parse_config(argv, world_size=2)


def _saved_run(root, padded_vocab_size: int):
    """A --save folder as far as the flags read it: the tracker and the newest iteration's config.json."""
    import json

    (root / "iter_0000002").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    (root / "iter_0000002" / "config.json").write_text(json.dumps({"model": {"padded_vocab_size": padded_vocab_size}}))
    return str(root)


@pytest.mark.parametrize("saved, tp, kept", [(256, 1, True), (256, 2, True), (384, 2, True), (100, 1, False),
                                             (129, 2, False), (128, 1, False)])
def test_a_resumed_run_keeps_the_checkpoints_padded_vocabulary(tmp_path, saved, tp, kept):
    """Without --make-vocab-size-divisible-by, --load keeps the saved padded vocabulary (one note for the log) when it
    holds the vocabulary (128 here) and this TP size divides it; otherwise the default padding stands and the loader
    names the flag. An explicit flag always wins."""
    load = _saved_run(tmp_path / "run", saved)
    cfg = parse_config(tiny_argv("--load", load, "--tensor-model-parallel-size", str(tp)), world_size=tp)
    default = 128 * tp
    assert cfg.model.padded_vocab_size == (saved if kept else default)
    notes = [n for n in cfg.compat.notes if "padded vocabulary" in n]
    assert len(notes) == (1 if kept and saved != default else 0), notes  # a note only when it changes something
    explicit = parse_config(tiny_argv("--load", load, "--tensor-model-parallel-size", str(tp),
                                      "--make-vocab-size-divisible-by", "128"), world_size=tp)
    assert explicit.model.padded_vocab_size == default
    assert cfg.data.make_vocab_size_divisible_by == explicit.data.make_vocab_size_divisible_by == 128


def test_a_fresh_or_unreadable_load_folder_pads_by_default(tmp_path):
    assert parse_config(tiny_argv("--load", str(tmp_path / "none"))).model.padded_vocab_size == 128
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert parse_config(tiny_argv("--load", str(tmp_path / "bad"))).model.padded_vocab_size == 128


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--data-cache-path"])
def test_an_unwritable_output_folder_is_named_at_start_up(tmp_path, monkeypatch, flag):
    """Checked when the flags are parsed, not at the first save hours later: a folder on a read-only file system, one
    without write permission (simulated: root passes permission checks), a file where a folder should be."""
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    real_statvfs, real_access = os.statvfs, os.access

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly() if str(p) == str(locked) else real_statvfs(p))
    with pytest.raises(ValueError, match=f"^{flag} .*locked/run: cannot write there \\(it would be created in "
                                         ".*locked\\): a read-only file system or no permission"):
        parse_config(tiny_argv(flag, str(locked / "run")))
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    with pytest.raises(ValueError, match=f"^{flag} .*locked: cannot write there: a read-only"):
        parse_config(tiny_argv(flag, str(locked)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"{flag} .*file is a file, not a folder"):
        parse_config(tiny_argv(flag, str(tmp_path / "file")))
    assert parse_config(tiny_argv(flag, str(tmp_path / "new" / "deeper")))  # created later, under a writable one


def test_every_missing_required_flag_in_one_message():
    with pytest.raises(ValueError) as err:
        parse_config([], env={})
    message = str(err.value)
    assert message.startswith("missing required flags: --num-layers, --hidden-size, --num-attention-heads, "
                              "--seq-length, --micro-batch-size, --lr, --train-iters (or --train-samples)"), message


def test_help_is_short_at_the_top_and_shows_every_default():
    from megatron.arguments import build_parser

    text = build_parser().format_help()
    assert text.splitlines()[0].startswith("usage: pretrain_gpt.py FLAGS  (required: --num-layers")
    flat = " ".join(text.split())
    for flag, default in (("--fp8-margin FP8_MARGIN", "default: 0"), ("--fp8-amax-history-len", "default: 1"),
                          ("--seed SEED", "default: 1234"), ("--lr-decay-style", "default: linear")):
        assert f"{flag}" in flat and default in flat.split(flag, 1)[1][:200], (flag, default)


def test_megatron_lms_group_query_attention_spelling_is_accepted():
    """Megatron-LM: --group-query-attention with --num-query-groups N, or 1 group when N is not given."""
    def kv_heads(*switches: str) -> int:
        return parse_config(tiny_argv(*switches, num_key_value_heads=None)).model.num_key_value_heads

    assert kv_heads("--group-query-attention", "--num-query-groups", "2") == 2
    assert kv_heads("--group-query-attention") == 1
    assert kv_heads() == 4  # --num-attention-heads: multi-head


def test_fp16s_help_says_it_is_refused():
    from megatron.arguments import build_parser

    action = next(a for a in build_parser()._actions if "--fp16" in a.option_strings)
    assert action.help.startswith("refused")


def test_every_flag_says_what_it_does_in_help():
    from megatron.arguments import build_parser

    silent = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help]
    assert silent == []
