"""Every other spelling of a flag (upstream aliases, legacy switches, `--no-*` forms, upstream value spellings) lands in
the same config field as the main spelling, with the value it gives: parsed both ways, the configs are equal, and
that field differs from the default run's."""
import json

import pytest

from megatron.arguments import build_parser, parse_config
from tests.support.config import tiny_argv

# (other spelling's argv, main spelling's argv, the config field both set, argv of a run where that field differs).
# A `--no-X` form's main spelling is `--X --no-X` (the last one wins). A field of None: the flag is not kept in the config (--local_rank is checked against
# LOCAL_RANK and dropped).
FP8ADAM = ["--optimizer", "fp8adam"]
ALIASES = [
    (["--num-query-groups", "1"], ["--num-key-value-heads", "1"], "model.num_key_value_heads", []),
    (["--rope-theta", "500000"], ["--rotary-position-embeddings-theta", "500000"], "model.rotary_base", []),
    (["--rotary-base", "500000"], ["--rotary-position-embeddings-theta", "500000"], "model.rotary_base", []),
    (["--layernorm-epsilon", "1e-6"], ["--norm-epsilon", "1e-6"], "model.norm_epsilon", []),
    (["--deepspeed", "--deepspeed-config", "{json}"], ["--deepspeed", "--deepspeed_config", "{json}"],
     "parallel.deepspeed_config", []),
    (["--local-rank", "0"], ["--local_rank", "0"], None, []),
    (["--no-fp8-optimizer-compile", *FP8ADAM], ["--fp8-optimizer-compile", "--no-fp8-optimizer-compile", *FP8ADAM],
     "optimizer.fp8_compile", FP8ADAM),
    (["--no-fp8-optimizer-stochastic-rounding", *FP8ADAM],
     ["--fp8-optimizer-stochastic-rounding", "--no-fp8-optimizer-stochastic-rounding", *FP8ADAM],
     "optimizer.fp8_stochastic_rounding", FP8ADAM),
    (["--no-divergence-guard"], ["--divergence-guard", "--no-divergence-guard"], "divergence.enabled", []),
    (["--no-fsdp-reshard-after-forward", "--use-torch-fsdp2"],
     ["--fsdp-reshard-after-forward", "--no-fsdp-reshard-after-forward", "--use-torch-fsdp2"],
     "parallel.fsdp_reshard_after_forward", []),
    # legacy switches and upstream spellings of a value
    (["--fp8-hybrid"], ["--fp8-format", "hybrid"], "fp8", []),
    (["--fp8-e4m3"], ["--fp8-format", "e4m3"], "fp8", ["--fp8-format", "hybrid"]),
    (["--fp8-optimizer"], FP8ADAM, "optimizer.optimizer", []),
    (["--optimizer", "adamw"], ["--optimizer", "adam"], "optimizer.optimizer", FP8ADAM),
    (["--optimizer", "fusedadamw"], ["--optimizer", "adam"], "optimizer.optimizer", FP8ADAM),
    (["--normalization", "layernorm"], ["--normalization", "LayerNorm"], "model.normalization", []),
    (["--recompute-activations"], ["--recompute-granularity", "selective"], "model.recompute_granularity", []),
    (["--deepspeed-activation-checkpointing"], ["--recompute-granularity", "full"], "model.recompute_granularity",
     []),
    (["--use-torch-compile", "false"], ["--torch-compile", "off"], "training.torch_compile", []),
    (["--use-rotary-position-embeddings"], ["--position-embedding-type", "rope"], "model.position_embedding_type",
     []),
]


def _base_argv() -> list[str]:
    # the tiny run without its rotary switch and in RMSNorm: each alias above moves a field away from it
    return [a for a in tiny_argv() if a != "--use-rotary-position-embeddings"]


def _field(config, path: str):
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _config(argv: list[str], json_path: str):
    return parse_config(_base_argv() + [a.replace("{json}", json_path) for a in argv], world_size=1, env={})


@pytest.mark.parametrize("alias, main, field, other", ALIASES, ids=[" ".join(a[0]) for a in ALIASES])
def test_alias_lands_in_the_main_flags_field(alias, main, field, other, tmp_path):
    json_path = str(tmp_path / "ds.json")
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    by_alias, by_main = _config(alias, json_path), _config(main, json_path)
    assert by_alias == by_main
    if field is not None:
        reference = _config(other, json_path)
        assert _field(by_alias, field) != _field(reference, field), (field, _field(by_alias, field))


def test_local_rank_alias_is_checked_like_the_main_spelling(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    for flag in ("--local-rank", "--local_rank"):
        with pytest.raises(ValueError, match=f"--local_rank 3 disagrees with the environment's LOCAL_RANK=0"):
            parse_config(_base_argv() + [flag, "3"], world_size=1, env={})


def test_every_other_spelling_of_the_parser_is_in_the_table():
    """A flag with several option strings (an alias, a --no-* form) added to the parser needs a row above."""
    tested = {s for row in ALIASES for s in row[0]}
    others = {s for action in build_parser()._actions for s in action.option_strings[1:]} - {"--help"}
    assert others <= tested, sorted(others - tested)
