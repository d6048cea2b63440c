"""`convert_to_fp8`: swap the linears of the transformer blocks for `Fp8Linear`; the model-wide switches of those
layers (fused quantization, tracing, statistics).

What is converted: every `nn.Linear` inside `model.decoder.layers` (QKV, attention output, fc1 = w1|w2,
fc2 = w3), as in the paper and in Transformer Engine. What stays in high precision: the embeddings, the LM
head (`model.output_layer`), the norms, attention's softmax and matmuls, and everything outside
`decoder.layers`. Options of the recipe narrow it further:
- `first_last_layers_bf16 = N`: the first N and last N transformer layers stay unconverted (the layers
  nearest the embeddings and the loss are the most sensitive to quantization);
- `mlp_fc2_bf16`: every `mlp.linear_fc2` stays unconverted (the paper's "W3 in BF16" ablation; the input of
  fc2 is the SwiGLU output where the outliers live).
`module_filter(fqn, module) -> bool` can veto any further layer (fqn as in `model.named_modules()`).

The swap shares the original Parameter objects, so device, dtype, requires_grad, parameter attributes, the
state_dict keys and an optimizer created earlier are all unchanged; only the module type changes, and
`print(model)` shows the FP8 format and scaling of each converted layer.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.nn as nn

from megatron.fp8 import stats as fp8_stats
from megatron.fp8.linear import Fp8Linear
from megatron.fp8.recipe import Fp8Recipe
from megatron.fp8.scaling import ROLE_NAMES

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[str, nn.Module], bool]


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            "convert_to_fp8 expects a GPT model with `model.decoder.layers` (an nn.ModuleList of transformer "
            f"layers); got {type(model).__name__}")
    return layers


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, new)


def convert_to_fp8(
    model: nn.Module,
    recipe: Fp8Recipe,
    amax_group: Any = None,
    module_filter: ModuleFilter | None = None,
) -> list[str]:
    """Swap the linears of `model.decoder.layers` for `Fp8Linear` in place; return the converted names.

    `amax_group` is the process group over which the amaxes of these layers are max-reduced (every rank
    holding a shard or a replica of the same tensors); it is stored on each module. None means the default
    group when torch.distributed is initialized.
    """
    layers = _decoder_layers(model)
    n_layers = len(layers)
    keep = recipe.first_last_layers_bf16
    if 2 * keep >= n_layers and keep > 0:
        logger.warning("first_last_layers_bf16=%d keeps all %d layers in high precision", keep, n_layers)
    prefix = next(name for name, m in model.named_modules() if m is layers)

    converted: list[str] = []
    for index, layer in enumerate(layers):
        if index < keep or index >= n_layers - keep:
            continue
        # Collect first, then swap: never mutate a module tree while iterating it.
        targets = [(name, m) for name, m in layer.named_modules()
                   if isinstance(m, nn.Linear) and not isinstance(m, Fp8Linear)]
        for name, linear in targets:
            fqn = f"{prefix}.{index}.{name}"
            if recipe.mlp_fc2_bf16 and name.endswith("mlp.linear_fc2"):
                continue
            if module_filter is not None and not module_filter(fqn, linear):
                continue
            _set_submodule(layer, name, Fp8Linear.from_linear(linear, recipe, amax_group))
            converted.append(fqn)

    total = sum(isinstance(m, nn.Linear) for m in model.modules())
    logger.info("converted %d/%d linear layers to FP8 (%s, %s scaling)", len(converted), total,
                recipe.format.value, recipe.scaling.value)
    return converted


def set_fused_quantization(model: nn.Module, enabled: bool) -> int:
    """Make every `Fp8Linear` of `model` quantize through the compiled functions of fused.py (`enabled`) or the
    eager reference; the number of layers set. A per-model setting: two models in one process (a benchmark's
    variants, a test's reference and its subject) each keep their own."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.fp8.configure(fused_quantization=enabled)
    return len(layers)


def set_fp8_tracing(model: nn.Module, enabled: bool) -> int:
    """Whether the `Fp8Linear`s of `model` are traced into a compiled transformer block's graph (traced.py) or
    run eagerly there (a graph break per layer, the fallback); the number of layers set. Read when dynamo traces
    a block, so a change retraces it."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.fp8.configure(trace_in_compiled_graph=enabled)
    return len(layers)


def enable_fp8_stats(model: nn.Module, enabled: bool = True) -> None:
    """Turn FP8 quantization statistics (stats.py) on or off for every `Fp8Linear` in `model`."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.fp8.configure(stats_enabled=enabled)


def collect_fp8_stats(model: nn.Module, reset: bool = True) -> dict[str, float]:
    """Statistics since the last read, keyed `fp8/<layer>/<role>/<metric>`; one host transfer in total.

    Layers that recorded nothing (statistics never switched on, or no forward since the last read) are left out.
    """
    named = [(name, m.fp8.stats) for name, m in model.named_modules()
             if isinstance(m, Fp8Linear) and m.fp8.stats is not None]
    return fp8_stats.collect(named, ROLE_NAMES, reset)
