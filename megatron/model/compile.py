"""`--torch-compile`: compile each transformer block's forward (as torchtitan does), and the FP8 quantization.

What is compiled
----------------
- Every `TransformerLayer` is compiled in place with `nn.Module.compile(dynamic=False)`: the module object and
  its parameters stay where they are, so state-dict keys do not gain `_orig_mod.` (checkpoints, optimizers,
  DDP/DeepSpeed wrappers and the Smooth-SwiGLU / FP8 hooks all still see the plain model). Blocks have one
  shape, so they share one compiled graph: dynamo caches on the code object, and every block is compiled with
  one backend object (`BLOCK_BACKEND`; a cache entry matches only its own backend). A block differing in shape
  or in its FP8 recipe gets its own entry, as does each variant of the step (delayed scaling's history turned
  valid, FP8 statistics iterations, evaluation): a handful per model, not per layer, under a recompile limit
  raised to 64 (`fused.raise_recompile_limit`). The startup line counts the graphs. The embedding and the final
  norm stay eager; the LM head with its cross-entropy is compiled with the blocks (`compile_lm_head`).
- The FP8 layers of the per-tensor recipes are traced into their block's graph (megatron/fp8/traced.py): one
  graph per block, so inductor fuses each FP8 cast into the op producing its operand (the RMSNorm before qkv
  and fc1, the SwiGLU product before fc2). The other recipes (tiled, stochastic rounding of gradients) and
  statistics iterations run the eager FP8 path there, a graph break whose quantization is the compiled
  functions of `megatron/fp8/fused.py` (`set_fused_quantization` on the model's FP8 layers). A pre-hook on each
  compiled block makes its FP8 weights once per optimizer step, outside the graph. If tracing the
  FP8 layers fails (a torch whose dynamo cannot), the warm-up compiles the blocks again with every FP8 layer a
  graph break, with a warning (`set_fp8_tracing`).
- The FP8 quantization alone can be compiled with the blocks left eager: a few small kernels (amax, scale,
  cast, the emulated GEMM's epilogue), seconds to compile, and most of what compiling gains for an FP8 step
  (docs/performance.md). `auto` does this where block compilation is not the default (CPU) or not supported.

`plan_torch_compile` decides, from the flag, the device and the run:

    --torch-compile   blocks                                   FP8 quantization
    on                compiled (refused with PP or ZeRO-3)     compiled
    off               eager                                    eager (nothing is compiled)
    auto, CUDA        compiled, or eager with PP / ZeRO-3      compiled
    auto, CPU         compiled for runs of >= BLOCKS_MIN_ITERS  compiled for runs of >= FUSED_MIN_ITERS iterations,
                      iterations (not with PP / ZeRO-3)         except where the eager layers' start-up graphs cast
                                                               (`eager_values_cast`: the BF16 GEMM mode)
    auto, HPU         eager                                    eager (Gaudi casts in its own kernels)

The iteration threshold on CPU: compiling the quantization of the demo model took 1-6 s with a warm inductor
cache and 28 s cold, and saves ~0.2-0.4 s per iteration (eager FP8 step 1.16-1.22x the eager BF16 step,
quantization compiled 0.91-1.03x, docs/performance.md), so it pays off within 100 iterations even cold; the
short runs of tests and smoke checks stay eager and start at once. That holds for the FP32 GEMM mode; in the BF16
GEMM mode the eager layers cast through graphs made at start-up for every shape, which are as fast (the demo model:
453.1 vs 457.6 ms per step, the quick demo's 70.6 vs 70.4 ms, AMD EPYC, docs/performance.md), so the quantization is
not compiled once more per shape there (14.8 s of start-up cold on the demo model). The blocks take longer to
compile (the demo model: 14-22 s cold, 2-4 s warm) and save less per iteration in BF16 (6%) than in FP8, where the
quantization's passes then fuse into the ops around them (the demo model's FP8 step on an AMD EPYC: 1.31x the
compiled BF16 step with the blocks eager, 1.09x compiled): from BLOCKS_MIN_ITERS iterations on the saving outweighs
the startup for both, and both runs of an FP8-vs-BF16 comparison of one length are compiled alike.

Startup: compilation happens on a block's first call. So that it is neither inside the first iterations' time
nor in tokens/s, `warm_up` runs one forward and backward on a synthetic micro-batch of the training shape (two
under delayed scaling: the first step's variant and every later step's; again with FP8 statistics on where the
run records them) right after the model is built, restoring everything it touched (RNG streams, the FP8 scaling
buffers and weight caches, gradients), and logs the time in one line. A later recompilation (evaluation runs without
gradients: one more graph per block) is counted where it happens. Under pipeline parallelism (DeepSpeed's
PipelineModule cannot run a micro-batch alone) and ZeRO-3 (the engine owns the parameters) there is no warm-up:
the FP8 quantization compiles in the first iteration (said in the log).

Composes with tensor parallelism, activation recompute (selective and full), the plain, DeepSpeed ZeRO 0-2 and
FSDP2 engines, and FSDP2's FP8 weight gathers (the block's pre-hook hands the graph the gathered FP8 bytes as they
are, `Fp8LayerState.refresh_step_weight`). Pipeline parallelism and ZeRO-3 (which swaps parameters in and out
around each block's forward) are refused by parse_config under `on`; under `auto` they keep the blocks eager with
a log line saying why.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from megatron.accelerator import bf16_autocast

logger = logging.getLogger("megatron")

MODES = ("auto", "on", "off")
# `auto` on CPU compiles the FP8 quantization for runs at least this long, and the blocks too for runs at least
# BLOCKS_MIN_ITERS long (module docstring).
FUSED_MIN_ITERS = 100
BLOCKS_MIN_ITERS = 1000


@dataclass(frozen=True)
class CompilePlan:
    """What `--torch-compile` compiles in this run, and why (the log line)."""

    blocks: bool
    fp8_quantization: bool
    why_blocks: str = ""  # why `auto` left the blocks eager where it would compile them, or the CPU rule (logged)
    why_fp8: str = ""  # the CPU rule for the FP8 quantization (logged when the model has FP8 layers)


def resolve_torch_compile(mode: str, device_type: str) -> bool:
    """Whether the transformer blocks are compiled, before the configuration's own limits (PP, ZeRO-3):
    `auto` = on for CUDA, off elsewhere (measured, docs/performance.md); `on`/`off` as given."""
    if mode not in MODES:
        raise ValueError(f"--torch-compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return device_type == "cuda"
    return mode == "on"


def plan_torch_compile(config: Any, device_type: str) -> CompilePlan:
    """The table of the module docstring."""
    mode = config.training.torch_compile
    blocks = resolve_torch_compile(mode, device_type)
    if mode != "auto":
        return CompilePlan(blocks, blocks)
    reason = unsupported_reason(config)
    if blocks and reason is not None:
        return CompilePlan(False, True, why_blocks=f"--torch-compile auto: transformer blocks eager with {reason}")
    if blocks:
        return CompilePlan(True, True)
    if device_type != "cpu":
        return CompilePlan(False, False)
    iters = config.training.train_iters
    if iters >= BLOCKS_MIN_ITERS and reason is None:
        return CompilePlan(True, True, why_blocks=f"--torch-compile auto on CPU: transformer blocks compiled "
                                                  f"(--train-iters {iters} >= {BLOCKS_MIN_ITERS}; shorter runs keep "
                                                  f"them eager, --torch-compile off too)")
    if iters >= FUSED_MIN_ITERS and eager_values_cast(config):
        return CompilePlan(False, False, why_fp8="--torch-compile auto on CPU: transformer blocks eager, and the FP8 "
                                                 "layers cast to their BF16 GEMMs' values in start-up graphs for every "
                                                 "shape (the BF16 GEMM mode: as fast as compiling the quantization "
                                                 "for each shape, which takes longer to start)")
    if iters >= FUSED_MIN_ITERS:
        return CompilePlan(False, True, why_fp8=f"--torch-compile auto on CPU: transformer blocks eager, the FP8 "
                                                f"quantization compiled (--train-iters {iters} >= {FUSED_MIN_ITERS})")
    return CompilePlan(False, False, why_fp8=f"--torch-compile auto on CPU: blocks and FP8 quantization eager "
                                             f"(--train-iters {iters} "
                                             f"< {FUSED_MIN_ITERS}; --torch-compile on compiles the blocks and the "
                                             "FP8 quantization)")


def eager_values_cast(config: Any) -> bool:
    """Whether the run's eager FP8 layers cast through the start-up's graphs for every shape (megatron/fp8/fused.py,
    `known_values`): a --bf16 run whose FP8 GEMMs are emulated as BF16 GEMMs on this CPU (megatron/fp8/cpu_gemm.py),
    one scale per tensor, gradients rounded to nearest. There compiling the quantization for each shape runs no
    faster (docs/performance.md) and only adds start-up time."""
    recipe = getattr(config, "fp8", None)
    if recipe is None or not config.training.bf16 or recipe.tiles is not None or recipe.grad_stochastic_rounding:
        return False
    if recipe.backend.value not in ("auto", "emulated"):
        return False
    from megatron.fp8 import cpu_gemm

    return cpu_gemm.mode() == "bf16"


def unsupported_reason(config: Any) -> Optional[str]:
    """Why block compilation cannot run with this configuration, or None."""
    parallel = config.parallel
    if parallel.pipeline_model_parallel_size > 1:
        return "--pipeline-model-parallel-size > 1 (DeepSpeed's pipeline engine runs the layers itself)"
    if parallel.deepspeed and parallel.zero_stage == 3:
        return "--zero-stage 3 (ZeRO-3 gathers parameters around each block's forward; use 0, 1 or 2)"
    return None


def check_torch_compile_supported(config: Any) -> None:
    """ValueError for the combinations `--torch-compile on` does not support (parse_config calls it)."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"--torch-compile on is not supported with {reason}; use --torch-compile off or auto")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    from megatron.model.transformer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def compile_blocks(model: nn.Module) -> int:
    """Compile every transformer block in place and fuse the FP8 layers' quantization; the block count."""
    from megatron.fp8 import set_fused_quantization

    blocks = transformer_blocks(model)
    for block in blocks:
        compile_block(block)
    set_fused_quantization(model, True)
    return len(blocks)


def compile_lm_head(model: nn.Module) -> bool:
    """Compile the model's LM head (`gpt.OutputHead`: the logits GEMM and the per-token FP32 cross-entropy) in place,
    where it is the plain one (tensor parallelism's vocab-parallel head stays eager); whether it was. Eager, the loss
    is a chain of passes over [tokens, vocab] FP32 tensors (the logits' FP32 copy, log-softmax, its gradient, the
    zero-filled NLL gradient); inductor fuses them into two loops over the BF16 logits (the demo model: ~20 ms of
    eager passes per step against ~7 ms, docs/performance.md)."""
    from megatron.model.gpt import OutputHead

    heads = [m for m in model.modules() if type(m) is OutputHead]
    for head in heads:
        head.compile(dynamic=False)
    return bool(heads)


def block_inductor_options() -> dict[str, Any]:
    """Inductor's settings for a transformer block (also the performance model's, megatron/perf/extract.py):
    - backward keeps the FP8 casts of the forward instead of recomputing them (megatron/fp8/partition.py);
    - on CPU, the FP8 cast of a concatenation of pointwise parts (fc1's dy) is made on its parts, in the loop that
      writes them (megatron/fp8/cat_casts.py);
    - `emulate_precision_casts`: a value the block rounds to BF16 (the RMSNorm output under `--bf16`, the
      input of qkv and fc1) is rounded inside fused kernels too, as eager rounds it, so the FP8 cast that
      follows quantizes the same BF16 value in both (by default inductor elides the round trip and quantizes
      the FP32 value: docs/fp8.md, "Compiled and eager numerics"). A conversion in registers: no extra bytes."""
    from megatron.fp8.cat_casts import CastThroughCat
    from megatron.fp8.partition import SaveFp8Casts

    return {"joint_custom_pre_pass": SaveFp8Casts(), "post_grad_custom_pre_pass": CastThroughCat(),
            "emulate_precision_casts": True}


class _BlockBackend:
    """The one torch.compile backend of every transformer block. Dynamo's cache entries carry their backend and
    match only the same object (its BACKEND_MATCH guard), so a backend made per block would compile every block
    separately: identical blocks share one graph only through one backend. `graphs` counts the graphs compiled."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs, config_patches=block_inductor_options())


BLOCK_BACKEND = _BlockBackend()


def compile_block(block: nn.Module) -> None:
    """One block compiled in place with the blocks' shared backend, after the FP8 weights' pre-hook."""
    from megatron.fp8.fused import raise_recompile_limit

    register_fp8_weight_refresh(block)
    raise_recompile_limit()
    block.compile(dynamic=False, backend=BLOCK_BACKEND)


@torch.compiler.disable
def refresh_fp8_weights(block: nn.Module, args: Any) -> None:
    from megatron.fp8 import Fp8Linear

    per_call = {id(m.linear_fc2) for m in block.modules() if getattr(m, "fc2_weight_column_scaled", False)}
    for m in block.modules():
        if isinstance(m, Fp8Linear):
            m.fp8.refresh_scale_validity()
            if id(m) in per_call:
                m.refresh_step_column_maxima()
            else:
                m.refresh_step_weight()


def register_fp8_weight_refresh(block: nn.Module) -> None:
    """Before each call of the compiled `block`, eagerly: this step's FP8 weight of each of its FP8 layers from
    the per-step cache (`Fp8Linear.refresh_step_weight`), so that the traced layers quantize W once per optimizer
    step, not once per micro-batch (a Smooth-SwiGLU fc2 makes W diag(c) per call: it gets this step's column
    maxima of W instead, from which the amax of W diag(c) follows without a pass over W). A hook on the compiled
    module itself runs outside its graph."""
    block.register_forward_pre_hook(refresh_fp8_weights)


def warm_up(model: nn.Module, run_micro_batch, evaluate_micro_batch=None,
            evaluation_stats: tuple[bool, ...] = (False,)) -> float:
    """Seconds spent in `run_micro_batch()` (a forward + backward that triggers compilation), leaving the model as
    it was: RNG streams forked, buffers (FP8 amaxes, scales) restored, FP8 statistics dropped, FP8 weight caches
    dropped, gradients cleared. It runs with FP8 statistics off (most iterations' step), and again with them on
    where the run records them (its first and logging iterations). Under delayed scaling each of those runs twice:
    the first step's graphs wait for each tensor's amax (the history holds no scale yet), every later step's take
    the history's scale (`Fp8LayerState.known_valid`), a variant of its own that would otherwise compile inside
    the second iteration. `evaluate_micro_batch` (a forward), where the run evaluates: run in eval mode without
    gradients after them, as an evaluation after training steps runs it (`_warm_up_evaluation`), once per FP8
    statistics switch in `evaluation_stats`, whose graphs would otherwise compile inside the first evaluation."""
    model.train()  # the mode training runs in (dynamo guards on it)
    from megatron.fp8 import Fp8Linear, Fp8Scaling

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    fp8_layers = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    counters = {name: m.fp8.weight_quantizations for name, m in fp8_layers.items()}
    # The step most iterations run: without FP8 statistics (on in the first and the logging iterations only). The
    # synthetic batch's statistics must not reach the first log line: they are dropped below.
    stats = {name: m.fp8.stats_enabled for name, m in fp8_layers.items()}
    delayed = [m for m in fp8_layers.values() if m.fp8.recipe.scaling is Fp8Scaling.DELAYED]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=devices):
            for with_stats in [False] + ([True] if any(stats.values()) else []):
                for name, m in fp8_layers.items():
                    m.fp8.configure(stats_enabled=with_stats and stats[name])
                    m.fp8.forget_scale_validity()
                    m.fp8.forget_weights()  # each step casts its weights afresh
                run_micro_batch()
                for m in delayed:  # as after the first optimizer step (the scales are restored below)
                    m.fp8.learn_scale_validity([True] * len(m.fp8.known_valid))
                    m.fp8.forget_weights()
                if delayed:
                    run_micro_batch()
            if evaluate_micro_batch is not None:
                for with_stats in evaluation_stats if any(stats.values()) else (False,):
                    _warm_up_evaluation(model, fp8_layers, stats, delayed, evaluate_micro_batch, with_stats)
        return time.perf_counter() - start
    finally:  # also after a failed compilation: the eager parts may have run
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for name, m in fp8_layers.items():
            m.fp8.weight_quantizations = counters[name]
            m.fp8.configure(stats_enabled=stats[name])
            if m.fp8.stats is not None:
                m.fp8.stats.reset()
            m.fp8.forget_weights()
            m.fp8.forget_scale_validity()
        for p in model.parameters():
            p.grad = None


def _warm_up_evaluation(model: nn.Module, fp8_layers: dict, stats: dict, delayed: list, evaluate_micro_batch,
                        with_stats: bool) -> None:
    """The evaluation's forward (no gradients, eval mode), the FP8 layers as after a training step (delayed scaling's
    history holds a scale), their statistics on where `with_stats` and the run records them."""
    for name, m in fp8_layers.items():
        m.fp8.configure(stats_enabled=with_stats and stats[name])
        m.fp8.forget_weights()
    for m in delayed:
        m.fp8.learn_scale_validity([True] * len(m.fp8.known_valid))
    model.eval()
    try:
        with torch.no_grad():
            evaluate_micro_batch()
    finally:
        model.train()


def apply_torch_compile(config: Any, model: nn.Module, device: torch.device) -> CompilePlan:
    """The `--torch-compile` step of building a training run: compile what `plan_torch_compile` says and warm
    it up on one synthetic micro-batch of the training shape (logged, excluded from tokens/s)."""
    from megatron.fp8 import set_fused_quantization

    if config.training.torch_compile == "on":  # parse_config refuses this already; a config built otherwise too
        check_torch_compile_supported(config)
    plan = plan_torch_compile(config, device.type)
    fp8_layers = set_fused_quantization(model, plan.fp8_quantization)
    for why in (plan.why_blocks, plan.why_fp8 if fp8_layers else ""):
        if why:
            logger.info("> torch.compile: %s", why)
    n = compile_blocks(model) if plan.blocks else 0
    fused = plan.fp8_quantization and fp8_layers > 0
    if not n and not fused:
        return plan
    head = compile_lm_head(model) if n else False
    parts = ([f"{n} transformer blocks"] if n else []) + (["the LM head's loss"] if head else []) + (
        ["the FP8 quantization"] if fused else [])
    what = " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)
    reason = unsupported_reason(config)
    if reason is not None:  # auto with PP or ZeRO-3: the FP8 quantization only (the blocks stay eager)
        logger.info("> torch.compile: %s compiled in the first iteration (no warm-up with %s; the startup is "
                    "inside that iteration's time)", what, reason.split(" (")[0])
        return plan
    run, evaluation = _synthetic_steps(config, model, device)
    graphs_before = BLOCK_BACKEND.graphs
    try:
        switches = evaluation_stats_switches(config) if evaluation is not None else (False,)
        seconds = _warm_up_blocks(model, run, n, fp8_layers, evaluation, switches)
    except Exception as exc:  # noqa: BLE001 - the fused quantization falls back by itself; compiled blocks cannot
        if not n:
            raise
        raise ValueError(f"--torch-compile: compiling the transformer blocks failed ({_first_line(exc)}); pass "
                         "--torch-compile off to train eagerly (MEGATRON_TRACEBACK=1 shows the compiler's "
                         "traceback)") from exc
    from megatron.fp8 import fused as fp8_fused

    if n:  # the graphs the warm-up compiled, for all the blocks together (more only if blocks differ)
        graphs = BLOCK_BACKEND.graphs - graphs_before
        what = what.replace(f"{n} transformer blocks",
                            f"{n} transformer blocks ({graphs} graph{'' if graphs == 1 else 's'} for all)", 1)
    failed = fp8_fused.failed_functions() if fused else []
    if failed:  # CompiledOrEager warned already; the startup line must not claim compiled quantization
        logger.info("> torch.compile: %s warmed up in %.1f s; the FP8 quantization runs eagerly (compiling %s "
                    "failed, see the warning above)", what, seconds, ", ".join(failed))
    else:
        logger.info("> torch.compile: %s compiled in %.1f s%s (startup, not counted in tokens/s)", what, seconds,
                    " for training and evaluation" if evaluation is not None else "")
    return plan


def _synthetic_steps(config: Any, model: nn.Module, device: torch.device) -> tuple[Any, Any]:
    """(a training micro-batch's forward and backward, an evaluation micro-batch's forward or None where the run
    does not evaluate) on one synthetic micro-batch of the training shape, called as the training loop and
    `MicroBatchEngine.evaluate` call the model (`warm_up` sets the modes)."""
    from megatron.data.provider import make_batch

    t = config.training
    text = torch.zeros(t.micro_batch_size, config.model.seq_length + 1, dtype=torch.long)
    batch = make_batch(text, None, config.data).to(device)

    def forward() -> torch.Tensor:
        with bf16_autocast(device.type, t.bf16):
            per_token = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        return (per_token * batch.loss_mask).sum()

    def run() -> None:
        forward().backward()

    return run, (forward if evaluates(config) else None)


def evaluates(config: Any) -> bool:
    """Whether the run computes validation or test losses: `--eval-iters` above 0 and a validation or test split
    (mock data, `--valid-data-path` / `--test-data-path`, or `--split` weights beyond the training one)."""
    from megatron.data.gpt_dataset import parse_split_weights

    t, d = config.training, config.data
    if t.eval_iters <= 0:
        return False
    if d.mock_data or d.valid_data_path or d.test_data_path:
        return True
    return bool(d.data_path) and sum(parse_split_weights(d.split)[1:]) > 0


def evaluation_stats_switches(config: Any) -> tuple[bool, ...]:
    """The FP8 statistics switches the run's evaluations find, sorted: an evaluation after iteration i (every
    `--eval-interval`, and after the last) runs with the switch iteration i left for the next one, on where i + 1
    logs (`Fp8Hooks.log_values`)."""
    t, interval = config.training, config.logging.log_interval
    points = range(t.eval_interval, t.train_iters + 1, t.eval_interval) if t.eval_interval else range(0)
    switches = {(t.train_iters + 1) % interval == 0}
    for i in points:  # both switches found: the rest cannot add one
        switches.add((i + 1) % interval == 0)
        if len(switches) == 2:
            break
    return tuple(sorted(switches))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def _warm_up_blocks(model: nn.Module, run, blocks: int, fp8_layers: int, evaluation=None,
                    evaluation_stats: tuple[bool, ...] = (False,)) -> float:
    """`warm_up`; if compiling blocks with FP8 layers traced into them fails (a torch whose dynamo cannot trace
    them), once more with those layers as graph breaks (the eager FP8 path inside compiled blocks), warned."""
    try:
        return warm_up(model, run, evaluation, evaluation_stats)
    except Exception as exc:  # noqa: BLE001 - retried below; a second failure propagates
        if not (blocks and fp8_layers):
            raise
        import torch._dynamo

        from megatron.fp8 import set_fp8_tracing

        logger.warning("> torch.compile: tracing the FP8 layers into the transformer blocks failed (%s); the FP8 "
                       "layers run as graph breaks inside the compiled blocks", _first_line(exc))
        set_fp8_tracing(model, False)
        torch._dynamo.reset()
        return warm_up(model, run, evaluation, evaluation_stats)
