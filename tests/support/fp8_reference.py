"""What the FP8 tests share: an independent float64 FP8 reference, a linear layer beside its FP8 twin, and a tiny
stand-in GPT.

The stand-in has the attribute structure of `megatron.model` GPTModel (embedding.word_embeddings,
decoder.layers[i].{input_layernorm, self_attention.linear_qkv, self_attention.linear_proj,
pre_mlp_layernorm, mlp.linear_fc1 (w1|w2), mlp.linear_fc2}, decoder.final_layernorm, output_layer) so that
`convert_to_fp8` can be tested without the real model.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.fp8.linear import Fp8Linear

# --- independent FP8 reference (float64, from the bit layout, no torch FP8 casts) ------------------------

_LAYOUTS = {  # exponent bits, mantissa bits, bias, whether the all-ones exponent holds normal numbers
    "e4m3": (4, 3, 7, True),  # OCP E4M3FN: only S.1111.111 is NaN
    "e5m2": (5, 2, 15, False),  # IEEE-like: all-ones exponent is inf/NaN
}


def fp8_grid(fmt: str) -> torch.Tensor:
    """All non-negative finite values of the format, in code order (= ascending), float64."""
    e_bits, m_bits, bias, top_exponent_is_normal = _LAYOUTS[fmt]
    values = []
    for e in range(2**e_bits):
        for m in range(2**m_bits):
            if e == 2**e_bits - 1 and (not top_exponent_is_normal or m == 2**m_bits - 1):
                continue  # inf / NaN codes
            if e == 0:
                values.append(m / 2**m_bits * 2.0 ** (1 - bias))
            else:
                values.append((1 + m / 2**m_bits) * 2.0 ** (e - bias))
    return torch.tensor(values, dtype=torch.float64)


def reference_quantize(x: torch.Tensor, fmt: str, fp8_max: float | None = None) -> torch.Tensor:
    """Saturate to +-fp8_max, then round to nearest on the grid, ties to the even code. float64 out."""
    grid = fp8_grid(fmt)
    if fp8_max is not None:
        grid = grid[grid <= fp8_max]
    x = x.double()
    mag = x.abs().clamp(max=grid[-1].item())
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    out = torch.where(pick_hi, grid[hi], grid[lo]) * torch.sign(x)
    return torch.where(torch.isnan(x), x, out)


# --- a linear layer beside its FP8 twin ------------------------------------------------------------------


def linear_pair(recipe, in_features: int, out_features: int, bias: bool = True, cls: type | None = None,
                seed: int = 0) -> tuple[nn.Linear, nn.Module]:
    """An `nn.Linear` (seeded) and an FP8 linear (`cls`, default `Fp8Linear`) converted from a copy of it: the same
    weights, so the pair's outputs and gradients differ by the FP8 recipe alone."""
    torch.manual_seed(seed)
    ref = nn.Linear(in_features, out_features, bias=bias)
    return ref, (cls or Fp8Linear).from_linear(copy.deepcopy(ref), recipe)


def fp8_node(y: torch.Tensor):
    """The autograd node of the FP8 GEMMs that produced `y` (`Fp8Gemms` or the tiled Function): the first such node
    on the way back from `y` through views and reshapes."""
    node = y.grad_fn
    while node is not None and not type(node).__name__.startswith(("Fp8GemmsBackward", "TiledFp8LinearFunction")):
        node = node.next_functions[0][0]
    assert node is not None, "no FP8 autograd node behind this tensor"
    return node


def kept_state_and_weight(y: torch.Tensor):
    """(the layer state, the FP8 weight) that the FP8 node behind `y` keeps for backward (None: cast again there)."""
    node = fp8_node(y)
    eager = getattr(node, "eager", None)
    if eager is not None:  # per-tensor: the saved FP8 operand goes with the cached weight
        assert (node.saved_tensors[2] is None) == (eager.weight_fp8 is None)
        return eager.state, eager.weight_fp8
    return node.state, node.weight_fp8


# --- a stand-in GPT with the real model's attribute structure --------------------------------------------


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.linear_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.linear_qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, h))


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False)  # w1 | w2
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear, gate = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(linear * F.silu(gate))


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attention = _Attention(hidden, heads)
        self.pre_mlp_layernorm = nn.RMSNorm(hidden)
        self.mlp = _SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)


class _Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(hidden, heads, ffn) for _ in range(layers))
        self.final_layernorm = nn.RMSNorm(hidden)


class TinyGPT(nn.Module):
    """2 layers, hidden 64, vocab 128 by default; forward(tokens) -> logits."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 4, ffn: int = 128,
                 vocab: int = 128) -> None:
        super().__init__()
        self.embedding = _Embedding(vocab, hidden)
        self.decoder = _Decoder(layers, hidden, heads, ffn)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens)
        for layer in self.decoder.layers:
            x = layer(x)
        return self.output_layer(self.decoder.final_layernorm(x))
