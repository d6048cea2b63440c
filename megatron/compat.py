"""Megatron-DeepSpeed compatibility: what lets an upstream launch script run here unedited.

This file owns, in one place, everything that exists only because Microsoft's and Habana's Megatron-DeepSpeed
(and the FP8 paper's reference code built on Habana's) spell things their way:

* upstream spellings of values we have under another name (`--normalization rmsnorm`, `--optimizer fusedadamw`);
* flags accepted as documented no-ops (they ask for what we always do, or switch off fusions we do not have),
  each logged once at startup with the reason (`NOOP_FLAGS`);
* flags refused with a reason (compiled autograd) rather than ignored;
* Habana's `--verify-checkpoint` (and its `--verify-checkpoint-model-type`): megatron/checkpoint/verify.py;
* the Habana kernel switches (`--use-fused-sdpa`, `--use-fused-rmsnorm`, ...): `HabanaKernels`, applied to the
  model on HPU by `megatron.hpu_kernels`, logged as not applicable elsewhere;
* the reference code's environment-variable FP8 recipe (FP8_LINEAR, SCALED_SWIGLU, ...): `env_recipe_flags`
  turns it into our flags, which go *before* the command line's, so a flag given explicitly wins.

`parse_config` (megatron/arguments.py) calls `add_compat_arguments`, `env_recipe_flags`,
`parse_collecting_problems` (all flag problems in one error, a typo hint from difflib) and `resolve_compat`;
the result, `CompatConfig`, is part of `MegatronConfig` (so the recipe mapping lands in the checkpoint's
config.json) and its `notes` are logged at startup. docs/guides/migrate.md has the user-facing tables.
"""
from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Tuple

# Upstream value spellings -> ours. All three Megatron-DeepSpeed repositories spell norms in lowercase.
NORMALIZATION_SPELLINGS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
# Upstream "adam" is already AdamW (decoupled decay); "adamw" and Habana's "fusedadamw" are the same update.
OPTIMIZER_SPELLINGS = {"adamw": "adam", "fusedadamw": "adam"}

# Flags that ask for what we already do, or switch off fusions we do not have: accepted, one log line each.
NOOP_FLAGS = {
    "--no-query-key-layer-scaling": "query-key layer scaling (an FP16 overflow guard) is never applied here",
    "--no-masked-softmax-fusion": "there is no masked-softmax fusion here (attention is torch SDPA)",
    "--no-bias-gelu-fusion": "there is no bias-GeLU fusion here",
    "--no-bias-dropout-fusion": "there is no bias-dropout fusion here",
    "--no-gradient-accumulation-fusion": "there is no gradient-accumulation fusion here (grads accumulate in "
                                         "the parameters' .grad)",
    "--log-validation-ppl-to-tensorboard": "validation perplexity is always written to TensorBoard here",
}
ENV_RECIPE_VARS = ("FP8_LINEAR", "DISABLE_FP8", "DISABLE_FP8_MLP_LINEAR2", "SCALED_SWIGLU", "DETACH_SCALED_SWIGLU",
                   "DELAYED_SCALED_SWIGLU", "FP8_OPTIMIZER", "MW_DTYPE", "M1_DTYPE", "M2_DTYPE", "SFTZ")
# The reference's moment dtypes (experimental/fp8_optimizer.py QuantDequant) -> --fp8-optimizer-{m,v}-dtype.
_MOMENT_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2",
                  "fp8_e4m3_sr": "e4m3", "fp8_e5m2_sr": "e5m2"}


def normalization_type(value: str) -> str:
    """`--normalization` value: ours (LayerNorm, RMSNorm) or the upstream lowercase spelling."""
    return NORMALIZATION_SPELLINGS.get(value.lower(), value)


def optimizer_type(value: str) -> str:
    return OPTIMIZER_SPELLINGS.get(value.lower(), value)


def upstream_bool(value: str) -> bool:
    """Habana's boolean flags take a value (`--use-fused-sdpa 1`, `--use-torch-compile=false`)."""
    lowered = value.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false or 1/0, got {value!r}")


@dataclass(frozen=True)
class HabanaKernels:
    """Habana's fused-kernel switches; used on HPU only (megatron/hpu_kernels.py)."""

    fused_sdpa: bool = False
    fused_sdpa_recompute: bool = False
    fused_rmsnorm: bool = False
    fast_softmax: bool = False

    @property
    def any(self) -> bool:
        return self.fused_sdpa or self.fused_rmsnorm


@dataclass(frozen=True)
class CompatConfig:
    """What the upstream flags and environment resolved to: kernels, the env recipe and the startup notes."""

    kernels: HabanaKernels = HabanaKernels()
    env_recipe: Tuple[Tuple[str, str, str], ...] = ()  # (VAR, value, what it became)
    notes: Tuple[str, ...] = field(default=(), compare=False)


def add_compat_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-DeepSpeed compatibility (docs/guides/migrate.md)")
    g.add_argument("--data-impl", choices=["mmap", "infer"], default=None, help="no-op: the reader is always mmap")
    for flag, why in NOOP_FLAGS.items():
        g.add_argument(flag, action="store_true", help=f"no-op: {why}")
    g.add_argument("--use-torch-compiled-autograd", type=upstream_bool, default=None,
                   help="only false is accepted (no-op); compiled autograd is not supported")
    g.add_argument("--compiled-autograd-fallback-mode", choices=["nothing", "warn", "error"], default=None,
                   help="no-op without compiled autograd")
    g.add_argument("--use-torch-compile", type=upstream_bool, default=None, help="Habana's spelling of torch.compile")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="recompute activations (our recompute); alone it means --recompute-granularity full")
    g.add_argument("--use-fused-sdpa", type=upstream_bool, default=None, help="HPU: Habana's FusedSDPA attention")
    g.add_argument("--use-fused-sdpa-with-recompute", type=upstream_bool, default=None,
                   help="HPU: FusedSDPA in its recompute mode")
    g.add_argument("--use-fused-rmsnorm", type=upstream_bool, default=None, help="HPU: Habana's FusedRMSNorm")
    g.add_argument("--use-fast-softmax", action="store_true", help="HPU: FusedSDPA's fast softmax mode")
    g.add_argument("--verify-checkpoint", action="store_true",
                   help="after each save, read every file back and compare it with what was written (bit for bit) "
                        "before the checkpoint is committed (megatron/checkpoint/verify.py)")
    g.add_argument("--verify-checkpoint-model-type", type=str, default=None,
                   help="with --verify-checkpoint: GPT or LLAMA (Habana's names for the model verified; this "
                        "project's model is both)")


def parse_collecting_problems(parser: argparse.ArgumentParser,
                              argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], bool]:
    """Parse `argv`, collecting every unknown flag (with the closest known one as a hint) and every invalid
    choice instead of stopping at the first as argparse does: a user porting a launch script sees all its
    problems in one round. Returns (namespace, problems, whether every choice was valid)."""
    parser.exit_on_error = False  # a bad type (--num-layers x) raises ArgumentError, turned into ValueError
    choices = {}
    for action in parser._actions:  # checked after parsing, all at once
        if action.choices is not None and action.option_strings:
            choices[action.dest] = (action.option_strings[0], list(action.choices))
            action.metavar = action.metavar or "{" + ",".join(map(str, action.choices)) + "}"
            action.choices = None
    try:
        a, unknown = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    known = list(parser._option_string_actions)
    problems = []
    after_unknown_flag = False
    for token in unknown:
        if token.startswith("-") and not token.lstrip("-").replace(".", "").isdigit():
            flag = token.split("=")[0]
            hint = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            problems.append(f"unknown flag {flag}" + (f" (did you mean {hint[0]}?)" if hint else ""))
            after_unknown_flag = "=" not in token
        elif not after_unknown_flag:
            problems.append(f"unexpected argument {token!r}")
        else:
            after_unknown_flag = False
    choices_ok = True
    for dest, (flag, allowed) in choices.items():
        value = getattr(a, dest)
        for v in (value if isinstance(value, list) else [value]):
            if v is not None and v not in allowed:
                choices_ok = False
                problems.append(f"{flag}: invalid choice {v!r} (choose from {', '.join(map(str, allowed))})")
    return a, problems, choices_ok


def _flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _env_true(env: Mapping[str, str], name: str) -> Optional[bool]:
    value = env.get(name)
    if value is None or value == "":
        return None
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise ValueError(f"environment variable {name}={value!r}: expected true or false (the reference code's values)")


# The reference's switches we do not implement: refused when true (with what it is and the fix), noted when false.
_REFUSED_SWITCHES = {
    "DISABLE_FP8": "the reference's debug switch: FP8 code path without FP8 casts) is not supported: unset it, "
                   "or set FP8_LINEAR=false for BF16",
    "DELAYED_SCALED_SWIGLU": "scales from the previous step) is not supported: unset it or set it to false",
    "SFTZ": "stochastic flush of FP8 subnormals in the optimizer) is not supported: unset it or set it to false",
}


def _refused_switch(env: Mapping[str, str], name: str, note) -> None:
    value = _env_true(env, name)
    if value:
        raise ValueError(f"environment variable {name}=true ({_REFUSED_SWITCHES[name]}")
    if value is False:
        note(name, "nothing to do (false)")


def _moment_flags(env: Mapping[str, str], name: str, flag: str, stochastic_ok: bool) -> list[str]:
    value = env[name].lower()
    if value not in _MOMENT_DTYPES:
        raise ValueError(f"environment variable {name}={env[name]!r} is not supported: Fp8AdamW stores moments as "
                         f"{', '.join(sorted(_MOMENT_DTYPES))} (fp16 moments are not implemented); change it")
    if value.endswith("_sr") and not stochastic_ok:
        raise ValueError(f"environment variable {name}={env[name]!r}: the first moment is always rounded to "
                         "nearest here (stochastic rounding applies to v only, docs/fp8_adam.md); use fp8_e4m3")
    flags = [flag, _MOMENT_DTYPES[value]]
    if stochastic_ok and value.startswith("fp8_"):
        flags.append("--fp8-optimizer-stochastic-rounding" if value.endswith("_sr")
                     else "--no-fp8-optimizer-stochastic-rounding")
    return flags


def env_recipe_flags(env: Mapping[str, str]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The reference code's FP8 environment recipe as our flags, and the mapping (VAR, value, meaning) to print.

    Meanings, from the reference repository (Anonymous1252022/Megatron-DeepSpeed, scripts/run_llama.sh and the
    Python that reads the variables): FP8_LINEAR puts the linears in FP8 (E4M3 forward, E5M2 gradients cast with
    stochastic rounding: our hybrid format with --fp8-grad-stochastic-rounding); DISABLE_FP8_MLP_LINEAR2 keeps
    fc2 in high precision; SCALED_SWIGLU is Smooth-SwiGLU with one scale per token (the reference's form);
    DETACH_SCALED_SWIGLU takes no gradient through that scale (ours never does); FP8_OPTIMIZER with
    M1_DTYPE/M2_DTYPE stores Adam's moments in those formats with one scale per tensor; MW_DTYPE is the master
    weights' format, which stays FP32 here. The returned flags go before the command line's: explicit flags win.
    """
    mapping: list[tuple[str, str, str]] = []

    def note(name: str, meaning: str) -> None:
        mapping.append((name, env[name], meaning))

    flags = _env_linears(env, note) + _env_swiglu(env, note) + _env_optimizer(env, note)
    master = env.get("MW_DTYPE")
    if master:
        if master.lower() != "fp32":
            raise ValueError(f"environment variable MW_DTYPE={master} is not supported: master weights stay FP32 "
                             "here (the reference's narrow master weights are a simulation we do not reproduce); "
                             "unset MW_DTYPE or set MW_DTYPE=fp32")
        note("MW_DTYPE", "FP32 master weights (as always here)")
    return flags, mapping


def _env_linears(env: Mapping[str, str], note) -> list[str]:
    """FP8_LINEAR, DISABLE_FP8 and DISABLE_FP8_MLP_LINEAR2 as flags (`note` records each one's meaning)."""
    flags: list[str] = []
    fp8 = _env_true(env, "FP8_LINEAR")
    if fp8:
        flags += ["--fp8-format", "hybrid", "--fp8-grad-stochastic-rounding"]
        note("FP8_LINEAR", "--fp8-format hybrid --fp8-grad-stochastic-rounding")
    elif fp8 is False:
        note("FP8_LINEAR", "no FP8 linears (unless --fp8-format is given)")
    _refused_switch(env, "DISABLE_FP8", note)
    fc2 = _env_true(env, "DISABLE_FP8_MLP_LINEAR2")
    if fc2 is not None:
        if fc2:
            flags.append("--fp8-mlp-fc2-bf16")
        note("DISABLE_FP8_MLP_LINEAR2", "--fp8-mlp-fc2-bf16" if fc2 else "fc2 in FP8 like the other linears")
    return flags


def _env_swiglu(env: Mapping[str, str], note) -> list[str]:
    """SCALED_SWIGLU, DETACH_SCALED_SWIGLU, DELAYED_SCALED_SWIGLU and SFTZ as flags."""
    flags: list[str] = []
    smooth = _env_true(env, "SCALED_SWIGLU")
    if smooth:
        flags += ["--smooth-swiglu", "--smooth-swiglu-granularity", "token"]
        note("SCALED_SWIGLU", "--smooth-swiglu --smooth-swiglu-granularity token (the reference's per-token form; "
                              "docs/smooth_swiglu.md recommends channel)")
    elif smooth is False:
        note("SCALED_SWIGLU", "plain SwiGLU (unless --smooth-swiglu is given)")
    detach = _env_true(env, "DETACH_SCALED_SWIGLU")
    if detach is False and smooth:
        raise ValueError("environment variable DETACH_SCALED_SWIGLU=false (a gradient through the Smooth-SwiGLU "
                         "scale) is not supported: our scale is a constant of the backward, as with "
                         "DETACH_SCALED_SWIGLU=true; set it to true")
    if detach is not None:
        note("DETACH_SCALED_SWIGLU", "the Smooth-SwiGLU scale takes no gradient (always so here)" if detach
             else "nothing to do (no SCALED_SWIGLU)")
    _refused_switch(env, "DELAYED_SCALED_SWIGLU", note)
    _refused_switch(env, "SFTZ", note)
    return flags


def _env_optimizer(env: Mapping[str, str], note) -> list[str]:
    """FP8_OPTIMIZER with M1_DTYPE / M2_DTYPE as flags."""
    flags: list[str] = []
    fp8_adam = _env_true(env, "FP8_OPTIMIZER")
    if fp8_adam:
        flags.append("--fp8-optimizer")
        note("FP8_OPTIMIZER", "--fp8-optimizer (Fp8AdamW, one scale per tensor)")
        for name, flag, sr in (("M1_DTYPE", "--fp8-optimizer-m-dtype", False),
                               ("M2_DTYPE", "--fp8-optimizer-v-dtype", True)):
            if env.get(name):
                moment = _moment_flags(env, name, flag, sr)
                flags += moment
                note(name, " ".join(moment))
        return flags
    if fp8_adam is False:
        note("FP8_OPTIMIZER", "AdamW with FP32 moments (unless --optimizer fp8adam is given)")
    for name in ("M1_DTYPE", "M2_DTYPE"):
        if env.get(name) and env[name].lower() != "fp32":
            raise ValueError(f"environment variable {name}={env[name]} needs FP8_OPTIMIZER=true (the moments "
                             f"are only stored narrow by the FP8 optimizer): set it, or {name}=fp32")
        if env.get(name):
            note(name, "FP32 moments (no FP8_OPTIMIZER)")
    return flags


VERIFY_MODEL_TYPES = ("GPT", "LLAMA")  # --verify-checkpoint-model-type values that name this project's model


def _check_verify_checkpoint(a: argparse.Namespace) -> None:
    kind = a.verify_checkpoint_model_type
    if kind is not None and not a.verify_checkpoint:
        raise ValueError("--verify-checkpoint-model-type needs --verify-checkpoint (it names the model verified)")
    if kind is not None and kind.upper() not in VERIFY_MODEL_TYPES:
        raise ValueError(f"--verify-checkpoint-model-type {kind}: this project trains a Llama-style GPT; use one of "
                         f"{', '.join(VERIFY_MODEL_TYPES)}")
    if a.verify_checkpoint and not a.save:
        raise ValueError("--verify-checkpoint checks the checkpoints of --save: pass --save DIR or drop it")


def resolve_compat(a: argparse.Namespace, device: str) -> CompatConfig:
    """Check the compatibility flags of parsed `a`; returns the kernels and the notes to log at startup."""
    _check_verify_checkpoint(a)
    if a.use_torch_compiled_autograd:
        raise ValueError("--use-torch-compiled-autograd true is not supported (no compiled autograd here): "
                         "pass false or drop it")
    notes = [f"{flag}: no-op, {why}" for flag, why in NOOP_FLAGS.items() if getattr(a, _flag_dest(flag))]
    if a.data_impl is not None:
        notes.append(f"--data-impl {a.data_impl}: no-op, indexed datasets are always read with mmap")
    if a.use_torch_compiled_autograd is False:
        notes.append("--use-torch-compiled-autograd false: no-op, compiled autograd is never used here")
    if a.compiled_autograd_fallback_mode is not None:
        notes.append(f"--compiled-autograd-fallback-mode {a.compiled_autograd_fallback_mode}: no-op "
                     "without compiled autograd")
    if a.use_torch_compile is not None:
        notes.append(f"--use-torch-compile {str(a.use_torch_compile).lower()}: --torch-compile "
                     f"{'on' if a.use_torch_compile else 'off'}")
    if a.deepspeed_activation_checkpointing:
        notes.append("--deepspeed-activation-checkpointing: activations are recomputed by our recompute "
                     f"(--recompute-granularity {a.recompute_granularity or 'full'})")
    kernels = HabanaKernels(fused_sdpa=bool(a.use_fused_sdpa) or bool(a.use_fused_sdpa_with_recompute),
                            fused_sdpa_recompute=bool(a.use_fused_sdpa_with_recompute),
                            fused_rmsnorm=bool(a.use_fused_rmsnorm), fast_softmax=a.use_fast_softmax)
    if a.use_fast_softmax and not kernels.fused_sdpa:
        raise ValueError("--use-fast-softmax is a mode of Habana's FusedSDPA: add --use-fused-sdpa true, or drop it")
    switches = [f for f, on in (("--use-fused-sdpa", kernels.fused_sdpa and not kernels.fused_sdpa_recompute),
                                ("--use-fused-sdpa-with-recompute", kernels.fused_sdpa_recompute),
                                ("--use-fused-rmsnorm", kernels.fused_rmsnorm),
                                ("--use-fast-softmax", kernels.fast_softmax)) if on]
    if switches:  # megatron/hpu_kernels.py logs the decision again once the device is known
        where = {"hpu": "used (HPU)", "auto": "used if the device resolves to HPU, else not applicable"}.get(
            device, f"not applicable on --device {device} (Habana kernels, HPU only)")
        notes.append(f"{', '.join(switches)}: {where}")
    return CompatConfig(kernels=kernels, notes=tuple(notes))
