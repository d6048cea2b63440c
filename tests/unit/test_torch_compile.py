"""`--torch-compile`: per-block compilation composes with checkpoints and training; the compile plan and its
failure paths.

One compiled tiny FP8 run is shared by the default-suite tests (a module fixture: compiling costs 15-25 s on
a 2-core CPU); the launcher-level compositions (tensor parallelism, DeepSpeed ZeRO-1, full recompute) are in
tests/e2e/test_torch_compile_launch.py.
"""
from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from megatron.arguments import parse_config
from megatron.model.compile import (BLOCKS_MIN_ITERS, FUSED_MIN_ITERS, check_torch_compile_supported,
                                    plan_torch_compile, resolve_torch_compile)
from megatron.training.loop import pretrain
from tests.support.config import tiny_argv
from tests.support.flags import COMPILE_RUN, FP8_HYBRID as FP8
from tests.support.logs import LogLines

# Llama2-7B's 32 blocks.
COMMON = {**COMPILE_RUN, "num_layers": 32}
from tests.support.run_noise import assert_losses_within_noise


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """32 blocks, as Llama2-7B has, trained with delayed scaling (its history turns valid at the second step: one
    more graph) and no logging iteration (whose SwiGLU diagnostics break the graph); dynamo raising where it would
    otherwise run a block eagerly past its recompile limit. Dynamo's cache is emptied first: graphs that another
    test of this process compiled would not be counted."""
    import torch._dynamo.config as dynamo_config

    from megatron.model.compile import BLOCK_BACKEND

    torch._dynamo.reset()
    graphs_before = BLOCK_BACKEND.graphs
    save = tmp_path_factory.mktemp("compiled") / "ckpt"
    with LogLines() as handler:
        with dynamo_config.patch(fail_on_recompile_limit_hit=True):
            result = pretrain(parse_config(tiny_argv(*FP8, "--fp8-recipe", "delayed", "--torch-compile", "on",
                                                     save=save, save_interval=12, **{**COMMON, "log_interval": 100})))
    return SimpleNamespace(result=result, lines=handler.lines, save=save, graphs=BLOCK_BACKEND.graphs - graphs_before)


def test_blocks_share_one_graph_and_none_runs_eagerly(compiled_run) -> None:
    """The startup line names the blocks, the graphs the warm-up compiled for all of them, and the time. Identical
    blocks share one backend: the graphs are those of the step's variants, not a multiple of the block count, and
    past dynamo's recompile limit the fixture's run would have raised. Delayed scaling's graphs differ between the
    first step (no scale in the history yet) and every later one: the warm-up compiles both, so that the second
    iteration does not compile the blocks again inside its time, and a run without logging or evaluation
    iterations compiles nothing after the startup line."""
    lines = [line for line in compiled_run.lines if "torch.compile:" in line and "transformer blocks" in line]
    assert len(lines) == 1 and re.search(rf"{COMMON['num_layers']} transformer blocks \(2 graphs for all\), the LM "
                                         r"head's loss and the FP8 quantization compiled in [\d.]+ s", lines[0]), lines
    assert compiled_run.graphs == 2, compiled_run.graphs


def test_nothing_compiles_after_the_startup_under_delayed_scaling_with_fp8_statistics_and_evaluation() -> None:
    """With FP8 statistics (on in the first iteration) the warm-up also runs the statistics variants, and the steps
    after the first take the whole-block graph again (`transformer._fp8_statistics_on`): before, the statistics
    step's graph-broken entry served them, and they compiled the FP8 layers' frames anew. A run that evaluates
    also warms up the evaluation's forward, whose graphs compiled inside the first evaluation before."""
    from megatron.model.compile import BLOCK_BACKEND

    before = BLOCK_BACKEND.graphs
    # Micro-batches of 5 sequences, which no other test compiles: the process's dynamo cache holds none of their
    # graphs. Validation after iterations 2 and 3, test after 3.
    run = {**COMPILE_RUN, "train_iters": 3, "lr_warmup_iters": 0, "log_interval": 100, "micro_batch_size": 5,
           "global_batch_size": 5, "eval_iters": 1, "eval_interval": 2}
    with LogLines() as handler:
        pretrain(parse_config(tiny_argv(*FP8, "--fp8-recipe", "delayed", "--torch-compile", "on", "--log-fp8-stats",
                                        **run)))
    [line] = [line for line in handler.lines if "torch.compile:" in line and "transformer blocks" in line]
    assert line.endswith("for training and evaluation (startup, not counted in tokens/s)"), line
    assert len([line for line in handler.lines if "validation loss at iteration" in line]) == 2
    warmed = int(re.search(r"\((\d+) graphs? for all\)", line).group(1))
    assert warmed > 2 and BLOCK_BACKEND.graphs - before == warmed, (line, BLOCK_BACKEND.graphs - before)


def test_the_lm_head_and_its_loss_are_compiled_with_the_blocks(compiled_run) -> None:
    """The plain LM head (logits GEMM and FP32 cross-entropy) runs compiled in place, its state-dict keys unchanged;
    tensor parallelism's vocab-parallel head is another class and stays eager."""
    from torch import nn

    from megatron.model.compile import compile_lm_head
    from megatron.model.gpt import OutputHead
    from megatron.parallel.layers import VocabParallelOutputHead

    [head] = [m for m in compiled_run.result.model.modules() if isinstance(m, OutputHead)]
    assert getattr(head, "_compiled_call_impl", None) is not None
    tp_head = nn.Module()
    tp_head.output_head = VocabParallelOutputHead(None, False)
    assert not compile_lm_head(tp_head) and getattr(tp_head.output_head, "_compiled_call_impl", None) is None


def test_state_dict_keys_unchanged(compiled_run) -> None:
    keys = list(compiled_run.result.model.state_dict())
    eager = pretrain(parse_config(tiny_argv(*FP8, "--torch-compile", "off",
                                            **{**COMMON, "train_iters": 2, "lr_warmup_iters": 1})))
    assert keys == list(eager.model.state_dict())
    assert not any("_orig_mod" in k for k in keys)


def test_losses_within_rounding_noise_of_eager(compiled_run) -> None:
    reference = pretrain(parse_config(tiny_argv(*FP8, "--torch-compile", "off", **COMMON))).losses
    control = pretrain(parse_config(tiny_argv(*FP8, "--torch-compile", "off",
                                              **{**COMMON, "micro_batch_size": 2}))).losses
    assert_losses_within_noise(compiled_run.result.losses, reference, control)


def test_compiled_checkpoint_resumes_eagerly(compiled_run) -> None:
    resumed = pretrain(parse_config(tiny_argv(*FP8, "--torch-compile", "off", load=compiled_run.save,
                                              **{**COMMON, "train_iters": 14})))
    assert resumed.state.iteration == 14 and len(resumed.losses) == 2
    assert all(torch.isfinite(torch.tensor(resumed.losses)))


def test_auto_is_on_for_cuda_only() -> None:
    assert resolve_torch_compile("auto", "cuda") and not resolve_torch_compile("auto", "cpu")
    assert resolve_torch_compile("on", "cpu") and not resolve_torch_compile("off", "cuda")
    with pytest.raises(ValueError, match="--torch-compile"):
        resolve_torch_compile("yes", "cpu")


def _plan_config(mode: str, iters: int, pp: int = 1, zero=None, fp8_param_gather: bool = False):
    return SimpleNamespace(training=SimpleNamespace(torch_compile=mode, train_iters=iters),
                           parallel=SimpleNamespace(pipeline_model_parallel_size=pp, deepspeed=zero is not None,
                                                    zero_stage=zero, fp8_param_gather=fp8_param_gather))


@pytest.mark.parametrize("mode,device,iters,pp,zero,blocks,quant", [
    ("on", "cpu", 2, 1, None, True, True),
    ("off", "cuda", 10**5, 1, None, False, False),
    ("auto", "cuda", 2, 1, None, True, True),
    ("auto", "cuda", 2, 2, None, False, True),  # PP: blocks eager, quantization still compiled
    ("auto", "cuda", 2, 1, 3, False, True),  # ZeRO-3 likewise
    ("auto", "cpu", FUSED_MIN_ITERS - 1, 1, None, False, False),  # short CPU runs start at once
    ("auto", "cpu", FUSED_MIN_ITERS, 1, None, False, True),
    ("auto", "cpu", FUSED_MIN_ITERS, 2, None, False, True),
    ("auto", "cpu", BLOCKS_MIN_ITERS - 1, 1, None, False, True),
    ("auto", "cpu", BLOCKS_MIN_ITERS, 1, None, True, True),  # long CPU runs repay compiling the blocks
    ("auto", "cpu", BLOCKS_MIN_ITERS, 2, None, False, True),  # but not with PP
    ("auto", "cpu", BLOCKS_MIN_ITERS, 1, 3, False, True),  # nor ZeRO-3
    ("auto", "hpu", 10**5, 1, None, False, False),  # Gaudi casts in its own kernels
])
def test_compile_plan_table(mode, device, iters, pp, zero, blocks, quant) -> None:
    """The table of megatron/model/compile.py's docstring, row by row."""
    plan = plan_torch_compile(_plan_config(mode, iters, pp, zero), device)
    assert (plan.blocks, plan.fp8_quantization) == (blocks, quant)
    if mode == "auto" and device == "cpu":
        assert str(iters) in plan.why_fp8 + plan.why_blocks  # the log line names the rule it applied


@pytest.mark.parametrize("gemm_mode,extra,quant", [
    ("bf16", (), False),  # the eager layers' start-up graphs: as fast as compiling the quantization per shape
    ("exact", (), True),  # FP32 GEMMs: the quantization compiled per shape saves passes
    ("bf16", ("--fp8-recipe", "blockwise"), True),  # tile scales: not what the start-up graphs cast
    ("bf16", ("--fp8-grad-stochastic-rounding",), True),
])
def test_auto_on_cpu_leaves_the_fp8_layers_eager_where_the_start_up_graphs_cast_them(gemm_mode, extra, quant) -> None:
    """Runs of 100-999 iterations on CPU: in the BF16 GEMM mode of a --bf16 run with one scale per tensor, the eager
    FP8 layers cast through graphs made at start-up for every shape (megatron/fp8/fused.py, `known_values`), so the
    quantization is not compiled once more per shape; otherwise it is."""
    from megatron.fp8 import cpu_gemm

    config = parse_config(tiny_argv(*FP8, "--bf16", *extra, train_iters=500))
    with cpu_gemm.use_mode(gemm_mode):
        plan = plan_torch_compile(config, "cpu")
    assert (plan.blocks, plan.fp8_quantization) == (False, quant)
    assert ("BF16 GEMM mode" in plan.why_fp8) != quant, plan.why_fp8


def test_fp8_param_gather_compiles_the_blocks_under_auto_on_cuda() -> None:
    plan = plan_torch_compile(_plan_config("auto", 2, fp8_param_gather=True), "cuda")
    assert plan.blocks and plan.why_blocks == ""


@pytest.mark.parametrize("pp,deepspeed,zero,needle", [(2, False, None, "--pipeline-model-parallel-size"),
                                                       (1, True, 3, "--zero-stage 3")])
def test_unsupported_combinations_are_refused(pp, deepspeed, zero, needle) -> None:
    config = SimpleNamespace(parallel=SimpleNamespace(pipeline_model_parallel_size=pp, deepspeed=deepspeed,
                                                      zero_stage=zero, fp8_param_gather=False))
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_torch_compile_supported(config)


def test_on_is_refused_at_parse_time_and_auto_falls_back_with_a_log_line(caplog) -> None:
    """`on` + pipeline parallelism fails in parse_config (before any process group); `auto` on a device where
    it would compile turns itself off and says why."""
    from megatron.model.compile import apply_torch_compile

    argv = tiny_argv("--pipeline-model-parallel-size", "2", "--deepspeed", "--torch-compile", "on")
    with pytest.raises(ValueError, match=re.escape("--torch-compile on is not supported with "
                                                   "--pipeline-model-parallel-size > 1")):
        parse_config(argv, world_size=2)
    argv = tiny_argv("--pipeline-model-parallel-size", "2", "--deepspeed", "--torch-compile", "auto")
    config = parse_config(argv, world_size=2)
    with caplog.at_level(logging.INFO, logger="megatron"):
        assert apply_torch_compile(config, torch.nn.Linear(2, 2), torch.device("cuda")).blocks is False
    assert any("transformer blocks eager with --pipeline-model-parallel-size > 1" in r.getMessage()
               for r in caplog.records)


def test_a_failed_quantization_compile_is_reported_not_claimed(monkeypatch, caplog) -> None:
    """Where torch.compile cannot build the FP8 quantization (no C++ compiler on the node, an unsupported torch),
    the run trains on the eager reference and its startup line says so instead of 'compiled'."""
    from megatron.fp8 import convert_to_fp8, fused as fp8_fused
    from megatron.model import GPTModel
    from megatron.model.compile import apply_torch_compile

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    for wrapper in fp8_fused._ALL:  # a fresh process: nothing compiled or failed yet (restored afterwards)
        monkeypatch.setattr(wrapper, "compiled", None)
        monkeypatch.setattr(wrapper, "failed", False)
    monkeypatch.setattr(torch, "compile", broken_compile)
    caplog.set_level(logging.INFO, logger="megatron")  # as a training run's setup_logging leaves it
    config = parse_config(tiny_argv(*FP8, "--torch-compile", "auto", **{**COMMON, "train_iters": 100}))
    model = GPTModel(config.model)
    convert_to_fp8(model, config.fp8)
    with LogLines() as handler:
        plan = apply_torch_compile(config, model, torch.device("cpu"))
    assert plan.fp8_quantization and not plan.blocks
    assert fp8_fused.failed_functions()
    lines = [line for line in handler.lines if "torch.compile:" in line]
    assert any("runs eagerly" in line for line in lines) and not any("compiled in" in line for line in lines), lines


def test_a_failed_block_compile_is_one_error_naming_the_flag(monkeypatch) -> None:
    from megatron.model import GPTModel
    from megatron.model.compile import apply_torch_compile

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no C++ compiler\nmore lines")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    config = parse_config(tiny_argv("--torch-compile", "on", **COMMON))
    with pytest.raises(ValueError, match=r"compiling the transformer blocks failed \(RuntimeError: no C\+\+ compiler\)"
                                         r"; pass --torch-compile off"):
        apply_torch_compile(config, GPTModel(config.model), torch.device("cpu"))


def test_a_failed_fp8_trace_falls_back_to_graph_breaks(monkeypatch) -> None:
    """A torch whose dynamo cannot trace the FP8 layers into a block: the blocks are compiled again with those
    layers as graph breaks (the eager FP8 path), with one warning; the run's startup line still follows."""
    from megatron.fp8 import Fp8Linear, convert_to_fp8
    from megatron.model import GPTModel
    from megatron.model import compile as compile_mod

    real_warm_up = compile_mod.warm_up
    calls = []

    def warm_up(model, run, evaluation=None, evaluation_stats=(False,)):
        traced = [m.fp8.trace_in_compiled_graph for m in model.modules() if isinstance(m, Fp8Linear)]
        calls.append(all(traced))
        if all(traced):
            def failing() -> None:  # fails part-way, as a compilation does: the eager parts ran already
                run()
                raise RuntimeError("dynamo cannot trace this\nmore")
            return real_warm_up(model, failing, evaluation, evaluation_stats)
        return real_warm_up(model, run, evaluation, evaluation_stats)

    monkeypatch.setattr(compile_mod, "warm_up", warm_up)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the blocks' compile itself: not under test
    config = parse_config(tiny_argv(*FP8, "--torch-compile", "on", **COMMON))
    model = GPTModel(config.model)
    convert_to_fp8(model, config.fp8)
    before = {n: b.clone() for n, b in model.named_buffers()}
    with LogLines() as handler:
        plan = compile_mod.apply_torch_compile(config, model, torch.device("cpu"))
    assert plan.blocks and calls == [True, False]
    assert not any(m.fp8.trace_in_compiled_graph for m in model.modules() if isinstance(m, Fp8Linear))
    warned = [line for line in handler.lines if "tracing the FP8 layers" in line]
    assert len(warned) == 1 and "RuntimeError: dynamo cannot trace this" in warned[0], handler.lines
    assert any("compiled in" in line for line in handler.lines)
    for name, b in model.named_buffers():  # the failed attempt's amaxes were rolled back
        assert torch.equal(b, before[name]), name


@pytest.mark.parametrize("eval_iters, data, want", [
    (1, dict(mock_data=True), True),
    (0, dict(mock_data=True), False),
    (1, dict(data_path=("corpus",), split="969,30,1"), True),
    (1, dict(data_path=("corpus",), split="100,0,0"), False),
    (1, dict(data_path=("corpus",), split="98,0,2"), True),
    (1, dict(train_data_path=("train",)), False),
    (1, dict(train_data_path=("train",), valid_data_path=("valid",)), True),
    (1, dict(train_data_path=("train",), test_data_path=("test",)), True),
])
def test_the_warm_up_runs_the_evaluation_where_the_run_evaluates(eval_iters, data, want) -> None:
    from megatron.model.compile import evaluates

    fields = {**dict(mock_data=False, data_path=(), split="969,30,1", valid_data_path=(), test_data_path=()),
              **{k: v for k, v in data.items() if k != "train_data_path"}}
    config = SimpleNamespace(training=SimpleNamespace(eval_iters=eval_iters), data=SimpleNamespace(**fields))
    assert evaluates(config) is want


@pytest.mark.parametrize("iters, eval_interval, log_interval, want", [
    (3, 2, 100, (False,)),  # after iterations 2 and 3: iterations 3 and 4 do not log
    (3, 2, 1, (True,)),  # every iteration logs
    (3, 2, 2, (False, True)),  # after 2 (3 does not log) and after 3 (4 logs)
    (1000, 100, 10, (False,)),
    (999, 100, 10, (False, True)),  # the last evaluation, after 999, comes before a logging iteration
    (10, 0, 5, (False,)),  # no interval: after the last iteration only
])
def test_the_evaluation_warm_up_takes_the_fp8_statistics_switch_each_evaluation_finds(iters, eval_interval,
                                                                                       log_interval, want) -> None:
    from megatron.model.compile import evaluation_stats_switches

    config = SimpleNamespace(training=SimpleNamespace(train_iters=iters, eval_interval=eval_interval),
                             logging=SimpleNamespace(log_interval=log_interval))
    assert evaluation_stats_switches(config) == want
