"""DeepSpeed's configuration from our flags (no DeepSpeed run): the generated JSON, a user JSON's keys kept and
checked against the flags, flag combinations. The DeepSpeed runs are in tests/e2e/test_deepspeed_launch.py."""
import re

import pytest

from megatron.arguments import parse_config
from megatron.training.deepspeed_config import DeepSpeedConfigError, build_deepspeed_config
from tests.support.config import tiny_argv
from tests.support.launch import BASE

pytest.importorskip("deepspeed")


# ---------------------------------------------------------------------------- configuration
def _cfg(*switches, **overrides):
    return parse_config(tiny_argv("--deepspeed", *switches, **{**BASE, **overrides}), world_size=2)


def test_generated_config_comes_from_the_flags():
    ds = build_deepspeed_config(_cfg("--zero-stage", "2", "--bf16", clip_grad=0.5), num_parameters=1000)
    assert ds["train_batch_size"] == 8 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert "bf16" not in ds and "fp16" not in ds and ds["zero_allow_untested_optimizer"] is True
    assert build_deepspeed_config(_cfg())["zero_optimization"]["stage"] == 0
    assert "torch_autocast" not in build_deepspeed_config(_cfg())


def test_user_json_keys_are_kept_and_missing_ones_filled():
    user = {"zero_optimization": {"stage": 1, "overlap_comm": True}, "wall_clock_breakdown": True}
    ds = build_deepspeed_config(_cfg(), user_json=user)
    assert ds["zero_optimization"]["overlap_comm"] is True and ds["wall_clock_breakdown"] is True
    assert ds["zero_optimization"]["stage"] == 1 and ds["train_batch_size"] == 8
    assert "reduce_bucket_size" not in user["zero_optimization"]  # the caller's dict is not modified


@pytest.mark.parametrize("user, switches, message", [
    ({"train_batch_size": 16}, [], "`train_batch_size` is 16 but --global-batch-size gives 8"),
    ({"train_micro_batch_size_per_gpu": 4}, [], "`train_micro_batch_size_per_gpu` is 4 but --micro-batch-size gives 2"),
    ({"gradient_accumulation_steps": 4}, [], "`gradient_accumulation_steps` is 4 but --global-batch-size 8 / "),
    ({"gradient_clipping": 0.0}, [], "`gradient_clipping` is 0.0 but --clip-grad gives 1.0"),
    ({"zero_optimization": {"stage": 2}}, ["--zero-stage", "1"], "`zero_optimization.stage` is 2 but --zero-stage gives 1"),
    ({"torch_autocast": {"enabled": True}}, [], "`torch_autocast.enabled` is true but --bf16 is not given"),
    ({"torch_autocast": {"enabled": False}}, ["--bf16"], "`torch_autocast.enabled` is false but --bf16 is given"),
    ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, ["--bf16"], "only bfloat16 is supported"),
    ({"bf16": {"enabled": True}}, ["--bf16"], "`bf16.enabled` is true, which makes DeepSpeed cast the model"),
    ({"fp16": {"enabled": True}}, [], "`fp16.enabled` is true, but FP16 training is not supported"),
    ({"optimizer": {"type": "AdamW"}}, [], "remove the `optimizer` section"),
    ({"scheduler": {"type": "WarmupLR"}}, [], "remove the `scheduler` section"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, [], "offload_optimizer"),
    ({"zero_optimization": {"stage": 1, "compute_grad_norm": False}}, [], "compute_grad_norm` must stay true"),
])
def test_json_and_flag_mismatches_name_both(user, switches, message):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(message)):
        build_deepspeed_config(_cfg(*switches), user_json=user)


def test_json_file_errors(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    # Found by parse_config already (it reads the JSON's ZeRO stage), i.e. before any process is launched.
    with pytest.raises(ValueError, match="is not valid JSON"):
        build_deepspeed_config(_cfg("--deepspeed_config", str(bad)))
    with pytest.raises(ValueError, match="file not found"):
        build_deepspeed_config(_cfg("--deepspeed_config", str(tmp_path / "missing.json")))


@pytest.mark.parametrize("argv, message", [
    (["--zero-stage", "1"], "--deepspeed_config and --zero-stage need --deepspeed"),
    (["--deepspeed", "--zero-stage", "4"], "--zero-stage must be 0, 1, 2 or 3"),
    (["--deepspeed", "--no-save-optim"], "--no-save-optim is not supported with --deepspeed"),
    (["--local_rank", "1"], "--local_rank 1 disagrees with the environment's LOCAL_RANK=0"),
])
def test_flag_combinations(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(tiny_argv(*argv))


def test_local_rank_flag_agreeing_with_the_environment_is_accepted(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    parse_config(tiny_argv("--local_rank", "1"))
    parse_config(tiny_argv("--local-rank=1"))
