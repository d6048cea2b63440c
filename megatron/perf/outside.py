"""The work of a step outside the transformer blocks, counted from the configuration: embedding, final norm,
LM head and loss (per micro-batch, on the stages that hold them), and once per optimizer step the optimizer, the
FP8 weight casts and the delayed-scaling update.

These parts run eagerly (only the blocks are compiled), so each op is a kernel and its bytes are what it reads
and writes, except the loss without tensor parallelism: `--torch-compile` compiles the plain LM head and its
cross-entropy with the blocks (megatron/model/compile.py, `compile_lm_head`; the vocabulary-parallel head of TP runs
eagerly). The bytes per element used below, with their reasons:
- embedding: a gather of `tokens` rows (read and write them, fp32 weights); backward zero-fills the dense
  gradient and adds the rows into it;
- final norm: an RMSNorm forward (read fp32, write bf16) and backward (read input and grad, write grad);
- LM head: three BF16 GEMMs (forward, dgrad, wgrad), 2 tokens h V FLOPs each;
- loss: eager upcast (2 + 4 bytes per logit), log-softmax (4 + 4), NLL (4); backward: NLL's gradient (4),
  log-softmax's (4 + 4 + 4), the cast back to BF16 (4 + 2); compiled (TP 1): the forward reads the BF16 logits twice
  (their max, then the sum of exponentials: 4), the backward reads them once and writes their BF16 gradient (4);
- AdamW (torch): read weight, grad, m, v (4 each), write weight, m, v: 28 bytes per parameter; Fp8AdamW: weight
  read and written (8), grad (4), m and v read and written at 1 byte each (4): 16; BF16 weights (Megatron's
  layout) add the BF16 copy written from the FP32 master (2); gradient clipping reads each gradient (4) and
  zeroing writes it (4);
- FP8 weight casts (per FP8 weight element, once per step): amax (read the weight), cast (read it again, write
  1 byte), dgrad's row-major transpose for `_scaled_mm` (read 1, write 1); three kernels per weight. A
  Smooth-SwiGLU fc2 casts W diag(c) per micro-batch inside the graph (in the block's kernels); per step it only
  takes W's column maxima (one read).
- the delayed-scaling update: a few small kernels per amax group (launch-bound).
"""
from __future__ import annotations

from megatron.config import MegatronConfig, SmoothSwiGLUGranularity
from megatron.perf.flops import block_linear_weights, count_parameters, sharding_stage
from megatron.perf.kernels import Kernel, KernelClass

P = KernelClass.POINTWISE
# Fp8AdamW's update is one kernel per chunk of this many elements on GPUs and Gaudi (megatron/optimizer/fp8_adam.py)
FP8_ADAM_CHUNK = 2**26
# Kernels of the batched delayed-scaling update per step (stacked histories: roll, max, scale, write back)
SCALING_UPDATE_KERNELS = 12


def embedding_kernels(config: MegatronConfig, tokens: int) -> list[Kernel]:
    """Per micro-batch, on the first pipeline stage."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    h, vocab = m.hidden_size, m.padded_vocab_size // tp
    rows = tokens * h * 4.0
    return [Kernel("embedding gather", P, bytes=2 * rows, where="forward"),
            Kernel("embedding grad zero-fill", P, bytes=vocab * h * 4.0, where="backward"),
            Kernel("embedding grad index-add", P, bytes=3 * rows, where="backward")]


def head_kernels(config: MegatronConfig, tokens: int) -> list[Kernel]:
    """Per micro-batch, on the last pipeline stage: final norm, LM head GEMMs (vocabulary split over TP), loss."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    h, vocab = m.hidden_size, m.padded_vocab_size // tp
    gemm_flops = 2.0 * tokens * h * vocab
    gemm_bytes = 2.0 * (tokens * h + h * vocab + tokens * vocab)
    logits = float(tokens * vocab)
    kernels = [Kernel("final norm", P, bytes=tokens * h * 6.0, where="forward"),
               Kernel("final norm backward", P, bytes=tokens * h * 10.0, where="backward"),
               Kernel("LM head", KernelClass.GEMM, gemm_flops, gemm_bytes, where="forward"),
               Kernel("LM head", KernelClass.GEMM, gemm_flops, gemm_bytes, count=2, where="backward")]
    if tp == 1:  # compiled with the blocks: one fused loop each way
        return kernels + [Kernel("loss (compiled)", P, bytes=4 * logits, where="forward"),
                          Kernel("loss backward (compiled)", P, bytes=4 * logits, where="backward")]
    return kernels + [Kernel("loss upcast", P, bytes=6 * logits, where="forward"),
                      Kernel("log-softmax", P, bytes=8 * logits, where="forward"),
                      Kernel("NLL", P, bytes=4 * logits, where="forward"),
                      Kernel("NLL backward", P, bytes=4 * logits, where="backward"),
                      Kernel("log-softmax backward", P, bytes=12 * logits, where="backward"),
                      Kernel("grad downcast", P, bytes=6 * logits, where="backward")]


def weight_bytes(config: MegatronConfig) -> float:
    """Bytes of one weight element: BF16 weights (--params-dtype bf16) or FP32."""
    return 2.0 if config.training.params_dtype == "bf16" else 4.0


def device_parameters(config: MegatronConfig) -> float:
    p = config.parallel
    return count_parameters(config.model) / (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def optimizer_kernels(config: MegatronConfig) -> list[Kernel]:
    """Once per step: the optimizer update on this device's share (ZeRO >= 1 shards it), clipping and zeroing."""
    params = device_parameters(config)
    zero = sharding_stage(config)
    owned = params / (config.training.data_parallel_size if zero >= 1 else 1)
    fp8_adam = config.optimizer.optimizer == "fp8adam"
    per_param = (16.0 if fp8_adam else 28.0) + (2.0 if config.training.params_dtype == "bf16" else 0.0)
    launches = max(1.0, owned / FP8_ADAM_CHUNK) if fp8_adam else 1.0
    name = "Fp8AdamW update" if fp8_adam else "AdamW update"
    return [Kernel(name, KernelClass.OPTIMIZER, bytes=owned * per_param / launches, count=launches, where="step"),
            Kernel("gradient clipping and zeroing", KernelClass.OPTIMIZER, bytes=8.0 * params, where="step")]


def fp8_weight_kernels(config: MegatronConfig) -> list[Kernel]:
    """Once per step: the FP8 copies of this device's FP8 weights, and the delayed-scaling update."""
    if config.fp8 is None:
        return []
    m, p = config.model, config.parallel
    # launches of each weight's kernels per step: one per FP8 layer of this stage
    layers = max(m.num_layers - 2 * config.fp8.first_last_layers_bf16, 0) / p.pipeline_model_parallel_size
    size = weight_bytes(config)
    column_scaled_fc2 = m.smooth_swiglu is SmoothSwiGLUGranularity.CHANNEL
    out = []
    for name, elements in block_linear_weights(m).items():
        if name == "fc2" and config.fp8.mlp_fc2_bf16:
            continue
        n = elements / p.tensor_model_parallel_size  # this device's piece of one layer's weight
        if name == "fc2" and column_scaled_fc2:
            out.append(Kernel("fc2 weight column maxima", KernelClass.QUANTIZATION, bytes=size * n,
                              count=layers, where="step"))
            continue
        out += [Kernel(f"{name} weight amax", KernelClass.QUANTIZATION, bytes=size * n, count=layers,
                       where="step"),
                Kernel(f"{name} weight cast", KernelClass.QUANTIZATION, bytes=(size + 1.0) * n, count=layers,
                       where="step"),
                Kernel(f"{name} weight transpose", KernelClass.QUANTIZATION, bytes=2.0 * n, count=layers,
                       where="step")]
    if config.fp8.scaling.value == "delayed":
        out.append(Kernel("delayed-scaling update", KernelClass.QUANTIZATION, count=SCALING_UPDATE_KERNELS,
                          where="step"))
    return out
