"""BF16 GEMMs on CPUs without fast BF16 kernels: FP32 GEMMs on BF16-rounded operands.

A BF16 GEMM on a GPU (and on CPUs with AVX-512/AMX through oneDNN) multiplies BF16 operands, accumulates in
FP32 and rounds the result to BF16 once. Products of two BF16 values are exact in FP32, so the same numbers
come out of an FP32 GEMM of the BF16-rounded operands whose output is rounded to BF16 once; only the
summation order differs. On x86 CPUs where oneDNN cannot use AVX-512 (AVX2-only CPUs such as many AMD EPYC,
laptops and desktops, or any CPU with `ONEDNN_MAX_CPU_ISA` capped below AVX512_CORE) torch's BF16 matmul
takes a generic path ~20-60x slower than FP32 (512^3: ~120-220 ms vs ~2-6 ms), and every `--bf16` run crawls.

`install()` therefore re-registers torch's CPU autocast kernels of the GEMM-like ops (`mm`, `addmm`, `bmm`,
`baddbmm`, `matmul`, `linear`, `scaled_dot_product_attention`) on such CPUs: each rounds its floating-point
operands to BF16, runs the op in FP32 (autocast excluded) and rounds the output to BF16. The operations are
recorded by autograd as usual, so the backward GEMMs run in FP32 too, with BF16-rounded incoming gradients
and BF16-rounded results, as a BF16 backward would. Every autocast region of the process is covered: our
training loop, the evaluation tools and DeepSpeed's `torch_autocast`. Attention in FP32 on BF16-rounded
q/k/v does not round the softmax probabilities to BF16 before the second GEMM, as some BF16 kernels do; it is
the more accurate of the two.

The choice is made once per process and logged in one line. `MEGATRON_CPU_BF16_GEMM` overrides it:
`auto` (default: by the CPU), `native` (torch's BF16 kernels) or `fp32` (the emulation, on any CPU).

Attention is decided on its own, on every CPU: torch's BF16 flash attention backward on CPU carries a large cost
per (batch, head) at short sequences, where its FP32 kernel is several times faster; at long ones the BF16 kernel is
the faster. `bench/bench_attention.py`, forward + backward through the autocast kernel here, FP32 / BF16 time, 2
threads, torch 2.13, Intel Xeon with AMX: sequence 128 with head dim 32 / 64 / 128: 0.34-0.38x / 0.65x / 0.88x;
sequence 256: 0.82x / 1.15x / 1.66x; sequence 64, head dim 64: 0.55x; 384-1024: 1.30-2.17x (head dims 32-128); the
demo shape (sequence 128, head dim 32) 0.30x with oneDNN capped at AVX512_CORE; capped at AVX512_CORE_BF16 (no AMX)
0.53-0.95x for sequences 128-512 and head dims 32-128, so the rule below keeps BF16 at a few shapes where FP32 would be
up to ~5% faster there. The BF16 forward alone is always the faster (the demo shape: 1.9 against 5.0 ms). So where
autograd will differentiate it (grad mode on, an operand requiring grad) and sequence x head dim <=
`FP32_ATTENTION_MAX_WORK` (8192), `scaled_dot_product_attention` under CPU BF16 autocast runs in FP32 on the
BF16-rounded q/k/v and rounds its output to BF16 once, as above; evaluation and longer sequences keep torch's BF16
kernel. `MEGATRON_CPU_BF16_ATTENTION`: `auto` (default: that rule), `native`
(torch's kernel always) or `fp32` (FP32 for every attention that trains).
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Callable, Iterator

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "MEGATRON_CPU_BF16_GEMM"
_CHOICES = ("auto", "native", "fp32")
# oneDNN ISA names that keep its AVX-512 BF16 paths (AVX512_CORE and above, AVX10); anything else
# (SSE41, AVX, AVX2, AVX2_VNNI, ...) caps it below them.
_AVX512_PREFIXES = ("AVX512", "AVX10")
_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "scaled_dot_product_attention")
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (float64 stays)

ATTENTION_ENV_VAR = "MEGATRON_CPU_BF16_ATTENTION"
_ATTENTION = "scaled_dot_product_attention"
_library: torch.library.Library | None = None  # the registrations; they stay in force while referenced
_registered: set[str] = set()  # the ops of `_OPS` registered in it
_installed: str | None = None  # the mode install() settled, once it ran
_forced: str | None = None  # use_mode()


class CpuBf16ConfigError(ValueError):
    """`MEGATRON_CPU_BF16_GEMM` holds a value we do not know."""


def onednn_isa_cap() -> str | None:
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip().upper()
        if value and value not in ("ALL", "DEFAULT"):
            return value
    return None


def slow_bf16_gemm_reason() -> str | None:
    """Why torch's CPU BF16 matmul has no fast kernel here, or None where it has one.

    torch routes CPU BF16 matmuls to oneDNN when the CPU has AVX-512 (F/BW/VL/DQ) or is an ARM CPU with
    BF16 instructions; otherwise to a generic loop. `ONEDNN_MAX_CPU_ISA` below AVX512_CORE forces the slow
    path too (measured: 512^3 in ~120 ms vs ~2 ms FP32 on an AVX-512 CPU with the cap set to AVX2).
    """
    if os.uname().machine.lower() in ("aarch64", "arm64"):
        return None if "bf16" in cpu_flags() else "an ARM CPU without BF16 instructions"
    if not torch.cpu._is_avx512_supported():
        return "an x86 CPU without AVX-512"
    cap = onednn_isa_cap()
    if cap is not None and not cap.startswith(_AVX512_PREFIXES):
        return f"ONEDNN_MAX_CPU_ISA={cap}"
    return None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def env_choice(var: str, choices: tuple[str, ...], error: type[ValueError], others: str,
               auto: Callable[[], str]) -> str:
    """The mode environment variable `var` names (one of `choices`; unset or "auto": `auto()`, chosen by the CPU);
    `error` for any other value, its message naming the variable and, in `others`, what else may be set."""
    choice = os.environ.get(var, "auto").strip().lower() or "auto"
    if choice not in choices:
        raise error(f"{var}={os.environ[var]!r} is not one of {', '.join(choices)}: unset it (auto: chosen by the "
                    f"CPU), or set {others}")
    return auto() if choice == "auto" else choice


def decided_at_import(decide: Callable[[], str], error: type[ValueError]) -> str | None:
    """`decide()`, or None where the environment holds a bad value: the module's mode function reports it then,
    where an entry point turns it into one clear line (an import cannot)."""
    try:
        return decide()
    except error:
        return None


def decide_mode() -> str:
    """"native" or "fp32" from `MEGATRON_CPU_BF16_GEMM` and the CPU; raises on a value we do not know."""
    return env_choice(ENV_VAR, _CHOICES, CpuBf16ConfigError,
                      "native (torch's BF16 kernels) or fp32 (FP32 GEMMs on BF16-rounded operands)",
                      lambda: "native" if slow_bf16_gemm_reason() is None else "fp32")


# Decided once, at import: a plain module constant is what the compiled FP8 GEMMs can read without a graph
# break (torch.compile guards on it).
_MODE = decided_at_import(decide_mode, CpuBf16ConfigError)


def cpu_bf16_gemm_mode() -> str:
    """"native" or "fp32": how CPU BF16 GEMMs run in this process."""
    return _MODE if _MODE is not None else decide_mode()


def emulates_bf16_gemms() -> bool:
    """True where CPU BF16 GEMMs are FP32 GEMMs on BF16-rounded operands (see the module docstring)."""
    return (_forced or _MODE) == "fp32"


def decide_attention_mode() -> str:
    """"auto", "native" or "fp32" from `MEGATRON_CPU_BF16_ATTENTION` (module docstring); raises on a value we do not
    know."""
    return env_choice(ATTENTION_ENV_VAR, _CHOICES, CpuBf16ConfigError,
                      "native (torch's BF16 attention) or fp32 (attention that trains in FP32 on BF16-rounded "
                      "operands, at any length)", lambda: "auto")


_ATTENTION_MODE = decided_at_import(decide_attention_mode, CpuBf16ConfigError)


def cpu_bf16_attention_mode() -> str:
    """"auto", "native" or "fp32": how CPU BF16 autocast attention runs where autograd differentiates it."""
    return _ATTENTION_MODE if _ATTENTION_MODE is not None else decide_attention_mode()


# sequence length x head dim up to which attention that trains runs in FP32 under `auto` (module docstring)
FP32_ATTENTION_MAX_WORK = 8192


def _emulates_attention(args: tuple, kwargs: dict) -> bool:
    """Whether this attention call runs in FP32: as the GEMMs where `use_mode` forces them or they are emulated;
    else by the attention mode, for a call autograd will differentiate (`auto`: at short sequences only)."""
    if _forced is not None or emulates_bf16_gemms():
        return emulates_bf16_gemms()
    mode = cpu_bf16_attention_mode()
    values = (*args, *kwargs.values())
    if mode == "native" or not torch.is_grad_enabled() or not any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in values):
        return False
    if mode == "fp32":
        return True
    q = args[0] if args else kwargs.get("query")
    k = args[1] if len(args) > 1 else kwargs.get("key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return False
    return max(q.shape[-2], k.shape[-2]) * q.shape[-1] <= FP32_ATTENTION_MAX_WORK


def _to_bf16(value, emulate: bool):
    """What autocast casts (floating tensors but float64) as BF16; kept in FP32 (BF16-rounded) to emulate."""
    if isinstance(value, torch.Tensor) and value.dtype in _ELIGIBLE:
        value = value.to(torch.bfloat16)
        return value.float() if emulate else value
    return value


def _is_subclass(value) -> bool:
    """A tensor subclass with its own operators (torchao's Float8TrainingTensor); not the fake and functional
    tensors of tracing, which stand for plain tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value)


def _autocast_kernel(op, attention: bool = False):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args, **kwargs):
        # torch's own autocast kernel casts to BF16 and runs the op below autocast; only use_mode() reaches
        # that branch here for a GEMM (on CPUs with fast BF16 kernels only attention is registered). A tensor
        # subclass (torchao's Float8TrainingTensor) implements its own GEMM and takes only the BF16 cast.
        values = (*args, *kwargs.values())
        emulate = (_emulates_attention(args, kwargs) if attention else emulates_bf16_gemms()) and \
            not any(_is_subclass(v) for v in values)
        args = [_to_bf16(a, emulate) for a in args]
        kwargs = {k: _to_bf16(v, emulate) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(keys):
            out = op(*args, **kwargs)
        return out.to(torch.bfloat16)

    return kernel


def _keep_precision_casts(on: bool) -> bool:
    """Make inductor keep the BF16 round trip `x.to(bf16).float()` inside fused kernels (it drops it by default,
    and a compiled emulated GEMM would then multiply unrounded operands); returns the previous setting."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "emulate_precision_casts"):  # older torch
        return False
    previous = bool(inductor_config.emulate_precision_casts)
    inductor_config.emulate_precision_casts = on
    return previous


def tag_compile_cache() -> str:
    """Name this process's CPU BF16 modes in torch.compile's cache keys (`torch.compiler.config.cache_key_tag`, after
    any tag of the user's own, `TORCH_COMPILE_CACHE_KEY_TAG`); the tag. The modes change what AOTAutograd traces from
    the same dynamo graph (the autocast kernels registered here), which its cache key does not otherwise see: a
    graph compiled in one mode would be loaded from the on-disk cache in another."""
    from torch.compiler import config

    tag = f"megatron-cpu-bf16:gemm={_forced or cpu_bf16_gemm_mode()},attention={cpu_bf16_attention_mode()}"
    if hasattr(config, "cache_key_tag"):
        own = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "")
        config.cache_key_tag = f"{own}|{tag}" if own else tag
    return tag


def _register(names: tuple[str, ...] = _OPS) -> None:
    """The autocast kernels of `names` (default: every GEMM-like op) in place of torch's, each registered once."""
    global _library
    if _library is None:
        _library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name in names:
            if name not in _registered:
                _library.impl(name, _autocast_kernel(getattr(torch.ops.aten, name).default, name == _ATTENTION),
                              "AutocastCPU")
                _registered.add(name)


def check_unused() -> None:
    """For runs without BF16: a set `MEGATRON_CPU_BF16_GEMM` is validated and said to do nothing."""
    for var, decide in ((ENV_VAR, cpu_bf16_gemm_mode), (ATTENTION_ENV_VAR, cpu_bf16_attention_mode)):
        if os.environ.get(var, "").strip():
            logger.info("CPU BF16: %s=%s has no effect: this run does not use BF16 autocast (no --bf16)", var,
                        decide())


def install() -> str:
    """Decide the CPU BF16 GEMM mode once and, for "fp32", register the emulating autocast kernels.

    Idempotent and cheap after the first call (it runs at every entry into CPU BF16 autocast); returns the
    mode and logs it once.
    """
    global _installed
    if _installed is not None:
        return _installed
    mode = cpu_bf16_gemm_mode()
    tag_compile_cache()
    if mode == "fp32":
        _register()
        _keep_precision_casts(True)
        logger.info("CPU BF16: BF16 autocast GEMMs and attention run in FP32 on BF16-rounded operands, "
                    "rounded to BF16 once (torch's BF16 matmul has no fast kernel on %s; %s=native keeps "
                    "torch's kernels)", slow_bf16_gemm_reason() or f"request ({ENV_VAR}=fp32)", ENV_VAR)
    elif cpu_bf16_attention_mode() != "native":
        _register((_ATTENTION,))  # attention's alone: the GEMMs keep torch's autocast kernels
        which = "all" if cpu_bf16_attention_mode() == "fp32" else \
            f"up to sequence x head dim {FP32_ATTENTION_MAX_WORK} (where torch's BF16 backward is the slower)"
        logger.info("CPU BF16: torch's BF16 GEMMs (CPU capability %s; %s=fp32 emulates them in FP32); attention "
                    "that trains, %s, in FP32 on BF16-rounded operands (%s=native|fp32 overrides)",
                    torch.backends.cpu.get_cpu_capability(), ENV_VAR, which, ATTENTION_ENV_VAR)
    else:
        logger.info("CPU BF16: torch's BF16 kernels (CPU capability %s; %s=fp32 emulates them in FP32; %s=native)",
                    torch.backends.cpu.get_cpu_capability(), ENV_VAR, ATTENTION_ENV_VAR)
    _installed = mode
    return mode


@contextlib.contextmanager
def use_mode(mode: str) -> Iterator[None]:
    """Run CPU BF16 autocast GEMMs as `mode` ("native" or "fp32") inside the block, whatever this CPU's
    default: how a benchmark times both side by side and a test checks both on any CPU."""
    global _forced
    if mode not in ("native", "fp32"):
        raise ValueError(f"mode must be native or fp32, got {mode!r}")
    _register()
    previous, _forced = _forced, mode
    casts = _keep_precision_casts(True) if mode == "fp32" else None
    tag_compile_cache()
    try:
        yield
    finally:
        _forced = previous
        tag_compile_cache()
        if casts is not None:
            _keep_precision_casts(casts)
