"""Megatron-DeepSpeed users' launch commands run unedited (tests/support/upstream_commands.py holds them).

Each upstream command, with its real sizes and only its paths replaced (a tiny SentencePiece model stands in
for Llama's tokenizer, tmp folders for data and checkpoints), goes through `pretrain_gpt.py --dry-run`
(`main`, in process, with the launcher's WORLD_SIZE). Then: what each accepted upstream flag became, the
refusals and their reasons, all flag problems reported at once with a hint for a typo, and the reference
code's FP8 environment recipe (explicit flags win; recorded in the config and the checkpoint's config.json).
"""
from __future__ import annotations

import json
import re

import pytest

import pretrain_gpt
from megatron.arguments import parse_config
from megatron.config import RecomputeGranularity, SmoothSwiGLUGranularity
from megatron.fp8.recipe import Fp8Format
from megatron.tokenizer.train import train_sentencepiece
from tests.support.config import tiny_argv
from tests.support.upstream_commands import REFERENCE_FP8_ENV, habana_llama2, microsoft_llama2, reference_fp8

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex an old sphinx".split()


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("upstream")
    corpus = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 9)) + "." for i in range(200)]
    return {"root": str(root), "tokenizer": train_sentencepiece(corpus, str(root / "tok"), vocab_size=300)}


def _commands(p: dict) -> dict:
    r, tok = p["root"], p["tokenizer"]
    return {
        "microsoft": microsoft_llama2(f"{r}/data/bookcorpus", tok, f"{r}/ckpt", f"{r}/ds.json", False),
        "microsoft-activation-checkpoint": microsoft_llama2(f"{r}/data/bookcorpus", tok, f"{r}/ckpt",
                                                            f"{r}/ds.json", True),
        # the default HL_SAVE=1: --save with --verify-checkpoint --verify-checkpoint-model-type LLAMA
        "habana-7b": habana_llama2(7, f"{r}/data", tok, f"{r}/out"),
        "habana-70b": habana_llama2(70, f"{r}/data", tok, f"{r}/out", hl={"HL_SAVE": 0}),
        # MW_DTYPE=fp16_pts is refused (test below); everything else of the recipe is honoured
        "reference-fp8": reference_fp8(f"{r}/data", tok, f"{r}/out", f"{r}/cache"),
    }


@pytest.mark.parametrize("name", ["microsoft", "microsoft-activation-checkpoint", "habana-7b", "habana-70b",
                                  "reference-fp8"])
def test_upstream_command_passes_dry_run(paths, name, monkeypatch, capsys):
    argv, world, env = _commands(paths)[name]
    for var in REFERENCE_FP8_ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, "fp32" if var == "MW_DTYPE" else value)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert pretrain_gpt.main(argv + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "parameters:" in out
    config = json.loads(out[out.index("{"):out.index("\nparameters:")])
    m = config["model"]
    assert m["normalization"] == "RMSNorm" and m["swiglu"] and m["position_embedding_type"] == "rope"
    # The script's sizes reached the model: its parameter count from first principles (Llama layer, untied
    # embedding and head over the padded vocabulary, no biases).
    flag = lambda name: int(argv[argv.index(name) + 1])  # noqa: E731
    h, ffn, layers, heads = (flag(f) for f in ("--hidden-size", "--ffn-hidden-size", "--num-layers",
                                               "--num-attention-heads"))
    kv = flag("--num-key-value-heads") if "--num-key-value-heads" in argv else heads
    kv_width = h // heads * kv
    per_layer = h * (h + 2 * kv_width) + h * h + 3 * h * ffn + 2 * h
    expected = layers * per_layer + h + 2 * m["padded_vocab_size"] * h
    assert int(re.search(r"parameters: ([\d,]+)", out).group(1).replace(",", "")) == expected


def test_what_the_upstream_flags_became(paths):
    argv, world, _ = _commands(paths)["microsoft-activation-checkpoint"]
    cfg = parse_config(argv, world_size=world, env={})
    assert cfg.model.recompute_granularity is RecomputeGranularity.FULL
    notes = "\n".join(cfg.compat.notes)
    assert "--no-query-key-layer-scaling: no-op" in notes and "--data-impl mmap: no-op" in notes
    argv, world, _ = _commands(paths)["habana-70b"]
    cfg = parse_config(argv, world_size=world, env={})
    assert cfg.optimizer.optimizer == "adam" and cfg.model.num_key_value_heads == 8
    assert cfg.logging.log_batch_size and cfg.logging.log_timers
    assert cfg.compat.kernels.fused_sdpa and cfg.compat.kernels.fused_rmsnorm
    assert not cfg.compat.kernels.fused_sdpa_recompute and not cfg.compat.kernels.fast_softmax
    for flag in ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                 "--no-gradient-accumulation-fusion", "--log-validation-ppl-to-tensorboard",
                 "--use-torch-compiled-autograd false", "--compiled-autograd-fallback-mode nothing"):
        assert flag in "\n".join(cfg.compat.notes), flag
    # deepspeed-activation-checkpointing alone is full recompute; with a granularity, that granularity
    assert parse_config(tiny_argv("--deepspeed-activation-checkpointing"), env={}).model.recompute_granularity \
        is RecomputeGranularity.FULL
    assert parse_config(tiny_argv("--deepspeed-activation-checkpointing", recompute_granularity="selective"),
                        env={}).model.recompute_granularity is RecomputeGranularity.SELECTIVE


def test_habanas_default_command_verifies_its_checkpoints(paths):
    argv, world, _ = habana_llama2(7, f"{paths['root']}/data", paths["tokenizer"], f"{paths['root']}/out")
    assert "--verify-checkpoint" in argv and parse_config(argv, world_size=world, env={}).checkpoint.verify


@pytest.mark.parametrize("switches, message", [
    (["--use-torch-compiled-autograd", "1"], "--use-torch-compiled-autograd true is not supported"),
    (["--use-fast-softmax"], "--use-fast-softmax is a mode of Habana's FusedSDPA"),
    (["--data-impl", "lazy"], "--data-impl: invalid choice 'lazy' (choose from mmap, infer)"),
    (["--use-fused-sdpa", "maybe"], "expected true/false or 1/0"),
])
def test_refusals_name_the_flag_and_the_reason(switches, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(tiny_argv(*switches), env={})


def test_use_torch_compile_maps_onto_our_flag():
    """Habana's --use-torch-compile true/false is our --torch-compile on/off. The flag is part of
    the command line: a parser without it (dropped or misspelt) must fail here, not pass as a tree from before
    the flag existed."""
    from megatron.arguments import build_parser

    actions = [a for a in build_parser()._actions if "--torch-compile" in a.option_strings]
    assert len(actions) == 1, "pretrain_gpt.py's parser has no --torch-compile"
    action = actions[0]
    assert action.dest == "torch_compile" and set(action.choices) == {"auto", "on", "off"} and action.default == "auto"
    assert parse_config(tiny_argv("--use-torch-compile=true"), env={}).training.torch_compile == "on"
    cfg = parse_config(tiny_argv("--use-torch-compile=0"), env={})
    assert cfg.training.torch_compile == "off" and "--use-torch-compile false: --torch-compile off" in cfg.compat.notes
    with pytest.raises(ValueError, match="--use-torch-compile true contradicts --torch-compile off"):
        parse_config(tiny_argv("--use-torch-compile=1", "--torch-compile", "off"), env={})


def test_a_typo_gets_the_closest_flag_and_all_problems_come_at_once():
    with pytest.raises(ValueError) as err:
        parse_config(tiny_argv("--num-layer", "4", "--normalization", "batchnorm", "--lr-decay-style", "steps",
                               "--use-fused-rmsnrom", "1"), env={})
    message = str(err.value)
    assert message.startswith("4 problems with the flags:")
    assert "unknown flag --num-layer (did you mean --num-layers?)" in message
    assert "unknown flag --use-fused-rmsnrom (did you mean --use-fused-rmsnorm?)" in message
    assert "--normalization: invalid choice 'batchnorm'" in message and "--lr-decay-style: invalid choice" in message
    # a semantic error is reported with the unknown flags when the values parsed
    with pytest.raises(ValueError, match=r"2 problems .*unknown flag --bogus.*--min-lr 1.0 is larger than --lr"):
        parse_config(tiny_argv("--bogus", min_lr=1.0), env={})


def test_reference_env_recipe_maps_onto_our_flags():
    env = dict(REFERENCE_FP8_ENV, MW_DTYPE="fp32")
    cfg = parse_config(tiny_argv(), env=env)
    assert cfg.fp8 is not None and cfg.fp8.format is Fp8Format.HYBRID and cfg.fp8.grad_stochastic_rounding
    assert cfg.model.smooth_swiglu is SmoothSwiGLUGranularity.TOKEN and not cfg.fp8.mlp_fc2_bf16
    o = cfg.optimizer
    assert (o.optimizer, o.fp8_m_dtype, o.fp8_v_dtype, o.fp8_stochastic_rounding) == ("fp8adam", "e4m3", "e5m2",
                                                                                         False)
    recorded = {var: (value, meaning) for var, value, meaning in cfg.to_dict()["compat"]["env_recipe"]}
    assert set(recorded) == set(REFERENCE_FP8_ENV) and recorded["FP8_LINEAR"][0] == "true"
    assert any(n.startswith("environment SCALED_SWIGLU=true: --smooth-swiglu") for n in cfg.compat.notes)
    # explicit flags win over the environment
    cfg = parse_config(tiny_argv("--fp8-format", "e4m3", "--smooth-swiglu-granularity", "channel"), env=env)
    assert cfg.fp8.format is Fp8Format.E4M3 and cfg.model.smooth_swiglu is SmoothSwiGLUGranularity.CHANNEL
    # M2 with stochastic rounding, and nothing set: BF16 as before
    sr = parse_config(tiny_argv(), env=dict(env, M2_DTYPE="fp8_e5m2_sr")).optimizer
    assert sr.fp8_stochastic_rounding
    plain = parse_config(tiny_argv(), env={"FP8_LINEAR": "false", "M1_DTYPE": "fp32"})
    assert plain.fp8 is None and plain.optimizer.optimizer == "adam"


@pytest.mark.parametrize("env, message", [
    (dict(REFERENCE_FP8_ENV), "MW_DTYPE=fp16_pts is not supported: master weights stay FP32"),
    ({"FP8_LINEAR": "yes"}, "FP8_LINEAR='yes': expected true or false"),
    ({"M1_DTYPE": "fp8_e4m3"}, "M1_DTYPE=fp8_e4m3 needs FP8_OPTIMIZER=true"),
    ({"FP8_OPTIMIZER": "true", "M1_DTYPE": "fp16"}, "M1_DTYPE='fp16' is not supported"),
    ({"FP8_OPTIMIZER": "true", "M1_DTYPE": "fp8_e4m3_sr"}, "the first moment is always rounded to nearest"),
    ({"SFTZ": "true"}, "SFTZ=true"),
    ({"DELAYED_SCALED_SWIGLU": "true"}, "DELAYED_SCALED_SWIGLU=true"),
])
def test_env_recipe_refusals(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(tiny_argv(), env=env)


def test_env_recipe_error_says_what_the_environment_added():
    with pytest.raises(ValueError, match="the environment's FP8 recipe added: --smooth-swiglu"):
        parse_config(tiny_argv(), env={"SCALED_SWIGLU": "true"})  # Smooth-SwiGLU without FP8


def test_env_recipe_is_recorded_in_the_checkpoint_config(tmp_path):
    from megatron.checkpoint import store as ckpt
    from megatron.training.loop import pretrain

    env = {"FP8_LINEAR": "true", "SCALED_SWIGLU": "true", "DETACH_SCALED_SWIGLU": "true"}
    argv = tiny_argv("--fp8-backend", "emulated", train_iters=2, lr_warmup_iters=0, eval_iters=0, save=tmp_path)
    pretrain(parse_config(argv, env=env))
    folder = ckpt.iteration_dir(tmp_path, ckpt.read_tracker(tmp_path))
    saved = json.loads((folder / "config.json").read_text())
    assert [row[0] for row in saved["compat"]["env_recipe"]] == ["FP8_LINEAR", "SCALED_SWIGLU", "DETACH_SCALED_SWIGLU"]
    assert saved["fp8"]["format"] == "hybrid" and saved["model"]["smooth_swiglu"] == "token"


def _fake_hpex(monkeypatch) -> list[str]:
    """`habana_frameworks.torch.hpex.{kernels.FusedSDPA, normalization.FusedRMSNorm}` with the kernels' documented
    semantics (torch SDPA; x / rms(x) * weight), recording their calls."""
    import importlib.machinery
    import sys
    import types

    import torch
    import torch.nn.functional as F

    calls: list[str] = []

    class FusedSDPA:
        @staticmethod
        def apply(q, k, v, mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode):
            calls.append(f"FusedSDPA softmax={softmax_mode} recompute={recompute_mode}")
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=scale)

    class FusedRMSNorm:
        @staticmethod
        def apply(x, weight, eps):
            calls.append("FusedRMSNorm")
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    names = ("habana_frameworks", "habana_frameworks.torch", "habana_frameworks.torch.hpex",
             "habana_frameworks.torch.hpex.kernels", "habana_frameworks.torch.hpex.normalization")
    for name in names:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules[names[3]].FusedSDPA = FusedSDPA
    sys.modules[names[4]].FusedRMSNorm = FusedRMSNorm
    return calls


# Only "hpu" compares two computations (the kernels' reordered math, within FP32 rounding); "cpu" changes nothing.
@pytest.mark.parametrize("device", [pytest.param("hpu", marks=pytest.mark.isa_sensitive), "cpu"])
def test_habana_kernel_switches_select_the_fused_kernels_on_hpu_only(monkeypatch, device):
    import torch

    from megatron.hpu_kernels import apply_habana_kernels
    from megatron.model import GPTModel

    calls = _fake_hpex(monkeypatch)
    cfg = parse_config(tiny_argv("--use-fused-sdpa", "1", "--use-fused-rmsnorm", "true", "--use-fast-softmax",
                                 "--device", "cpu"), env={})
    torch.manual_seed(0)
    model = GPTModel(cfg.model, seed=0).eval()
    tokens = torch.randint(0, 128, (2, 32))
    before = model(tokens)
    lines = apply_habana_kernels(model, cfg.compat.kernels, device)
    after = model(tokens)
    names = {type(m).__name__ for m in model.modules()}
    if device == "hpu":
        assert {"HpuFusedRMSNorm", "HpuFusedSDPASelfAttention"} <= names and "HpuFusedRMSNorm" in repr(model)
        assert calls.count("FusedRMSNorm") == 2 * 2 + 1 and calls.count("FusedSDPA softmax=fast recompute=False") == 2
        assert lines[0] == "Habana FusedSDPA: 2 modules"
        # same math through the kernels' semantics: FP32 rounding of a reordered computation, no more
        assert torch.allclose(after, before, rtol=0, atol=1e-5 * before.abs().max().item())
        assert set(model.state_dict()) == set(GPTModel(cfg.model, seed=0).state_dict())
    else:
        assert calls == [] and "HpuFusedRMSNorm" not in names and "not applicable on cpu" in lines[0]
        assert torch.equal(after, before)
