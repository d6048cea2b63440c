"""The step model (megatron/perf): kernels read from inductor's scheduler at tiny shapes on fake tensors, the
roofline, the collectives' bytes, the projection's arithmetic, the --project-on flags."""
from __future__ import annotations

import dataclasses
import math

import pytest

from megatron.arguments import parse_config
from megatron.perf import calibration, comm
from megatron.perf.extract import BlockKernels, extract_block, extract_linear
from megatron.perf.flops import count_parameters, flops_per_iteration
from megatron.perf.hardware import GEMM_EFFICIENCY, MEMORY_EFFICIENCY, Device, device
from megatron.perf.kernels import Kernel, KernelClass
from megatron.perf.step import project

TINY = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --num-key-value-heads 2 "
        "--seq-length 32 --max-position-embeddings 32 --swiglu --normalization RMSNorm --disable-bias-linear "
        "--use-rotary-position-embeddings --untie-embeddings-and-output-weights --attention-dropout 0 "
        "--hidden-dropout 0 --mock-data --vocab-size 128 --train-iters 10 --lr 1e-4 --bf16 --micro-batch-size 1 "
        "--global-batch-size 4")
TENSORWISE = " --fp8-format hybrid --fp8-recipe tensorwise"
M, K, N = 32, 64, 128  # tokens, in, out of the linear below


def _config(extra: str = "", world: int = 1):
    return parse_config(f"{TINY} {extra}".split(), world_size=world)


def test_a_linears_three_gemms_are_counted_once_each_with_their_flops():
    kernels = extract_linear(K, N, M, None)
    gemms = [k for k in kernels.kernels if k.kind is KernelClass.GEMM]
    assert [k.where for k in gemms] == ["forward", "backward", "backward"]
    assert all(k.flops == 2 * M * K * N and not k.fp8 for k in gemms)
    # forward: x [M, K] and W [N, K] in BF16 read, y [M, N] in BF16 written
    assert gemms[0].bytes == 2 * (M * K + N * K + M * N)
    # autocast's cast of the FP32 weight to BF16: read 4 bytes, write 2, per element, once in each graph
    casts = [k for k in kernels.kernels if k.kind is KernelClass.POINTWISE]
    assert [k.bytes for k in casts] == [6 * K * N, 6 * K * N]
    assert kernels.graphs == 2


def test_an_fp8_linear_runs_scaled_mm_and_its_input_cast_reads_and_writes_what_it_must():
    recipe = _config(TENSORWISE).fp8
    kernels = extract_linear(K, N, M, recipe)
    gemms = [k for k in kernels.kernels if k.kind is KernelClass.GEMM]
    assert len(gemms) == 3 and all(k.fp8 and k.flops == 2 * M * K * N for k in gemms)
    quantization = [k.bytes for k in kernels.kernels if k.kind is KernelClass.QUANTIZATION and k.where == "forward"]
    # x's amax reads x once (BF16); its cast for fprop and its transposed cast for wgrad, one kernel as Triton fuses
    # them (two loops on CPU), read x once and write 1 byte per element twice; each plus a few scalars
    assert any(2 * M * K <= b < 2 * M * K + 64 for b in quantization), quantization
    assert any(4 * M * K <= b < 4 * M * K + 64 for b in quantization), quantization
    assert not any(3 * M * K <= b < 3 * M * K + 64 for b in quantization), quantization
    # backward: dy (BF16 [M, N]) cast to E5M2 for dgrad and transposed for wgrad in one pass, as Transformer Engine's
    # cast-transpose does
    backward = [k.bytes for k in kernels.kernels if k.kind is KernelClass.QUANTIZATION and k.where == "backward"]
    assert any(4 * M * N <= b < 4 * M * N + 64 for b in backward), backward
    # the weight is cast once per step before the graph (the block's pre-hook), never in it
    assert not any(b >= 4 * K * N for b in quantization), quantization


def test_an_fp8_layer_that_breaks_the_graph_is_counted_op_by_op():
    """Rowwise scaling runs the eager FP8 layer inside a compiled block (a graph break): its three GEMMs are counted
    from the eager ops (FP8, 2MKN each), its fused quantization from the compiled function's kernels, and nothing
    else; a traced layer has no eager kernel at all."""
    rowwise = extract_linear(K, N, M, _config("--fp8-format e4m3 --fp8-recipe rowwise").fp8)
    gemms = [k for k in rowwise.kernels if k.kind is KernelClass.GEMM]
    assert [(k.name, k.where, k.fp8, k.flops) for k in gemms] == [
        ("_scaled_mm", "forward", True, 2 * M * K * N), ("_scaled_mm", "backward", True, 2 * M * K * N),
        ("_scaled_mm", "backward", True, 2 * M * K * N)]
    # forward: Q(x) [M, K] and Q(W) [N, K] in E4M3 read, y [M, N] in BF16 written, plus the [M] and [N] factors
    assert gemms[0].bytes == M * K + N * K + 2 * M * N + 4 * (M + N)
    quantization = [k for k in rowwise.kernels if k.kind is KernelClass.QUANTIZATION]
    # each reads at most one operand in FP32 and writes its E4M3 copy and factors: 5 bytes per element and change
    largest = max(M * K, N * K, M * N)
    assert quantization and all(k.bytes <= 5 * largest + 4 * (M + N) + 256 for k in quantization)
    traced = extract_linear(K, N, M, _config(TENSORWISE).fp8)
    assert not any(k.name.startswith("eager ") for k in traced.kernels)
    assert [k.name for k in traced.kernels if k.kind is KernelClass.GEMM] == ["_scaled_mm"] * 3


def test_a_block_has_one_forward_and_one_backward_graph_and_causal_attention_flops():
    cfg = _config()
    block = extract_block(cfg.model, None, 2)
    assert block.graphs == 2
    attention = [k for k in block.kernels if k.kind is KernelClass.ATTENTION]
    b, h, s, d = 2, 4, 32, 16
    forward = 4.0 * b * h * s * s * d / 2  # causal: half the score matrix
    assert [(k.where, k.flops) for k in attention] == [("forward", forward), ("backward", 2.5 * forward)]
    # the block's GEMM FLOPs are the model's linear FLOPs of one layer, three passes
    linear = sum(k.flops for k in block.kernels if k.kind is KernelClass.GEMM)
    per_layer = flops_per_iteration(dataclasses.replace(cfg.model, num_layers=1, padded_vocab_size=0), 2)
    attention_full = 3 * 4.0 * s * cfg.model.query_projection_size * b * s
    assert linear == per_layer - attention_full


DEV = Device("test", bf16_tflops=100.0, fp8_tflops=200.0, hbm_gbps=1000.0, memory_gib=80.0, intra_node_gbps=100.0,
             scale_out_gbps=10.0, devices_per_node=8, launch_us=5.0, source="test")


def test_the_roofline_takes_the_larger_of_compute_and_memory_and_never_less_than_the_launch():
    flops, size = 1e12, 1e9
    compute = flops / (200e12 * GEMM_EFFICIENCY)
    memory = size / (1000e9 * MEMORY_EFFICIENCY)
    assert Kernel("g", KernelClass.GEMM, flops, size, fp8=True).seconds(DEV) == max(compute, memory)
    assert Kernel("g", KernelClass.GEMM, flops, 1e12, count=3).seconds(DEV) == 3 * 1e12 / (1000e9 * MEMORY_EFFICIENCY)
    assert Kernel("p", KernelClass.POINTWISE, bytes=10.0).seconds(DEV) == DEV.launch_us * 1e-6
    assert math.isclose(Kernel("p", KernelClass.POINTWISE, bytes=size, count=2).seconds(DEV), 2 * memory)


def test_collectives_bytes_follow_the_layout():
    params = count_parameters(_config().model)
    ddp = comm.step_collectives(_config(world=4), 8)
    assert [(c.op, c.bytes, c.count) for c in ddp] == [("all-reduce", 4.0 * params, 1)]
    assert math.isclose(ddp[0].seconds(DEV), 2 * 3 / 4 * 4.0 * params / (100e9 * comm.COMM_EFFICIENCY) + 10e-6)
    zero1 = comm.step_collectives(_config("--deepspeed --zero-stage 1 --params-dtype bf16", world=4), 8)
    # DeepSpeed's ZeRO-1 all-reduces the gradients in the weights' dtype, then gathers the updated weights
    assert [(c.op, c.bytes) for c in zero1] == [("all-reduce", 2.0 * params), ("all-gather", 2.0 * params)]
    zero2 = comm.step_collectives(_config("--deepspeed --zero-stage 2 --global-batch-size 16", world=4), 8)
    # ZeRO-2 reduces each micro-batch's gradients (DeepSpeed's per-owner all-reduces: a full all-reduce's bytes)
    assert [(c.op, c.bytes, c.count) for c in zero2] == [("all-reduce", 4.0 * params, 4),
                                                         ("all-gather", 4.0 * params, 1)]
    tp = comm.step_collectives(_config("--tensor-model-parallel-size 2", world=2), 8)
    # 2 all-reduces forward + 2 backward per layer and micro-batch (4 micro-batches), BF16 activations; per
    # micro-batch the embedding's output (FP32 weights), the head's input gradient, the loss's 3 values per token
    assert [(c.op, c.bytes, c.count, c.across_nodes) for c in tp] == [
        ("all-reduce", 2.0 * 32 * 64, 4 * 2 * 4, False), ("all-reduce", 4.0 * 32 * 64, 4, False),
        ("all-reduce", 2.0 * 32 * 64, 4, False), ("all-reduce", 4.0 * 32, 3 * 4, False)]
    across = comm.step_collectives(_config("--global-batch-size 16", world=16), 8)
    assert across[0].across_nodes  # 16 ranks of 8 per node: at the scale-out bandwidth
    assert math.isclose(across[0].seconds(DEV), 2 * 15 / 16 * 4.0 * params / (10e9 * comm.COMM_EFFICIENCY) + 10e-6)


def _block(flops: float) -> BlockKernels:
    return BlockKernels((Kernel("f", KernelClass.GEMM, flops, 0.0, where="forward"),),
                        (Kernel("b", KernelClass.GEMM, 2 * flops, 0.0, where="backward"),), 2, 0.0)


def test_the_projection_adds_its_parts_and_derives_tokens_and_mfu():
    cfg = _config()
    p = project(cfg, DEV, None, _block(1e12))
    assert math.isclose(p.step_seconds, sum(p.by_class.values()))
    gemm = 4 * 2 * 3e12 / (100e12 * GEMM_EFFICIENCY)  # 4 micro-batches x 2 layers x 3e12 FLOPs, BF16
    head = p.by_class[KernelClass.GEMM] - gemm
    assert 0 < head < 1e-3 * gemm
    assert p.by_class[KernelClass.COMMUNICATION] == 0 and p.by_class[KernelClass.BUBBLE] == 0
    assert math.isclose(p.tokens_per_second_per_device, 4 * 32 / p.step_seconds)
    assert math.isclose(p.mfu, flops_per_iteration(cfg.model, 4) / p.step_seconds / 100e12)
    # on 2 devices: half the micro-batches each, a gradient all-reduce partly hidden by the last backward
    p2 = project(_config(world=2), DEV, None, _block(1e12), devices=2)
    assert math.isclose(p2.by_class[KernelClass.GEMM] - head / 2, gemm / 2, rel_tol=1e-9)


def test_pipeline_stages_add_a_bubble_of_stages_minus_one_micro_batches():
    cfg = _config("--pipeline-model-parallel-size 2 --deepspeed --zero-stage 1", world=2)
    p = project(cfg, DEV, None, _block(1e12))
    per_micro = sum(k.seconds(DEV) for k in p.kernels if k.where in ("forward", "backward")) / 4
    assert math.isclose(p.by_class[KernelClass.BUBBLE], per_micro)


def test_project_on_flags_are_checked():
    with pytest.raises(ValueError, match="--project-on only applies with --dry-run"):
        _config("--project-on h200")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        _config("--dry-run --project-on tpu")
    with pytest.raises(ValueError, match="--project-devices needs --project-on"):
        _config("--dry-run --project-devices 8")
    assert _config("--dry-run --project-on H200,gaudi2").training.project_on == ("h200", "gaudi2")
    assert device("gaudi3").fp8_tflops == device("gaudi3").bf16_tflops


def test_the_dry_run_prints_the_projection_of_the_run_and_its_bf16_twin():
    from megatron.training.dry_run import describe

    text = describe(_config(f"{TENSORWISE} --dry-run --project-on h100 --project-devices 1"))
    assert "1 x h100 (projected):" in text and calibration.CALIBRATION_SUMMARY in text
    assert "this run (FP8 hybrid tensorwise): step" in text and "the same run in BF16: step" in text
    assert "FP8 / BF16 speed-up (projected):" in text and "10 iterations in" in text


@pytest.mark.slow
def test_the_calibration_summary_printed_with_projections_is_the_tables():
    rows = calibration.calibration_rows(parse_config)
    assert calibration.summary(rows) == calibration.CALIBRATION_SUMMARY


def test_under_tensor_parallelism_a_device_runs_a_tp_th_of_the_blocks_gemms_and_attention():
    """Each device's block has 1/tp of the heads and FFN channels: its GEMM and attention FLOPs are exactly 1/tp of
    the whole block's (integers in float64)."""
    from megatron.perf.planner import device_block_model

    cfg = _config()
    whole = extract_block(cfg.model, None, 2)
    piece = extract_block(device_block_model(cfg.model, 2), None, 2)

    def flops(block, kind):
        return sum(k.flops for k in block.kernels if k.kind is kind)

    for kind in (KernelClass.GEMM, KernelClass.ATTENTION):
        assert flops(piece, kind) * 2 == flops(whole, kind), kind
    assert device_block_model(cfg.model, 1) is cfg.model


def test_the_loss_is_one_compiled_loop_each_way_without_tensor_parallelism():
    """`--torch-compile` compiles the plain LM head and its cross-entropy with the blocks: 4 + 4 bytes per logit (the
    BF16 logits read twice forward, once backward with their gradient written). Under tensor parallelism the
    vocabulary-parallel loss runs eagerly: 18 + 22 bytes per logit of this device's vocabulary shard."""
    from megatron.perf.outside import head_kernels

    def loss_bytes(cfg, where):
        return sum(k.bytes for k in head_kernels(cfg, 32) if "LM head" not in k.name and "norm" not in k.name
                   and k.where == where)

    whole = _config()
    logits = 32 * whole.model.padded_vocab_size  # tokens x vocabulary
    assert (loss_bytes(whole, "forward"), loss_bytes(whole, "backward")) == (4 * logits, 4 * logits)
    split = _config("--tensor-model-parallel-size 2", world=2)
    logits = 32 * split.model.padded_vocab_size // 2  # this device's shard
    assert (loss_bytes(split, "forward"), loss_bytes(split, "backward")) == (18 * logits, 22 * logits)
