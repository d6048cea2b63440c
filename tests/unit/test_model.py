"""GPTModel: shapes, causality, GQA, recompute equivalence, masks from the data provider."""
import pytest
import torch

from megatron.arguments import parse_config
from megatron.data.provider import get_ltor_masks_and_position_ids
from megatron.model import GPTModel, transformer
from tests.support.config import tiny_argv


def _model(*switches, **overrides):
    torch.manual_seed(0)
    cfg = parse_config(tiny_argv(*switches, **overrides)).model
    return GPTModel(cfg).eval(), cfg


def test_output_shapes_and_loss():
    model, cfg = _model()
    tokens = torch.randint(0, 128, (3, 32))
    assert model(tokens).shape == (3, 32, cfg.padded_vocab_size)
    loss = model(tokens, labels=tokens)
    assert loss.shape == (3, 32) and loss.dtype == torch.float32
    # At init the model is close to uniform over the vocabulary.
    assert abs(loss.mean().item() - torch.log(torch.tensor(128.0)).item()) < 0.5


def test_megatron_core_attribute_names():
    model, _ = _model()
    names = {n for n, _ in model.named_modules()}
    for expected in ("embedding.word_embeddings", "decoder.layers.0.input_layernorm",
                     "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj",
                     "decoder.layers.0.pre_mlp_layernorm", "decoder.layers.0.mlp.linear_fc1",
                     "decoder.layers.1.mlp.linear_fc2", "decoder.final_layernorm", "output_layer"):
        assert expected in names
    layer = model.decoder.layers[0]
    assert layer.mlp.linear_fc1.out_features == 2 * model.config.ffn_hidden_size  # [gate | up]
    assert layer.self_attention.linear_qkv.out_features == 64 + 2 * 2 * 16  # q + k + v with 2 kv heads
    assert layer.self_attention.linear_qkv.bias is None


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("rope, norm", [(True, "RMSNorm"), (False, "RMSNorm"), (True, "LayerNorm")])
def test_causality(rope, norm):
    argv = tiny_argv(normalization=norm)
    if not rope:
        argv.remove("--use-rotary-position-embeddings")
    torch.manual_seed(0)
    model = GPTModel(parse_config(argv).model).eval()
    assert (model.rotary is not None) == rope
    assert (model.embedding.position_embeddings is None) == rope
    tokens = torch.randint(0, 128, (2, 32))
    base = model(tokens)
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 128
    out = model(changed)
    # Earlier positions compute on the same inputs in the same order; a masked score adds an exact 0 (exp(-inf)):
    # bitwise equal on any CPU. A later position moves by O(1) of the logits' scale (rounding: ~1e-7 of it).
    assert torch.equal(base[:, :20], out[:, :20]), "a token saw a later token"
    assert (base[:, 20:] - out[:, 20:]).abs().max() > 1e-3 * base.abs().max()


@pytest.mark.isa_sensitive
def test_gqa_equals_mha_with_repeated_kv_heads():
    """With kv heads duplicated into every query group, GQA must equal MHA exactly (in exact arithmetic)."""
    gqa, _ = _model(num_key_value_heads=2)
    mha, cfg = _model(num_key_value_heads=4)
    state = gqa.state_dict()
    new_state = {}
    for key, value in state.items():
        if key.endswith("linear_qkv.weight"):
            d = 16
            groups = value.view(2, (2 + 2) * d, 64)  # per kv group: 2 q heads, k, v
            rows = []
            for g in range(2):
                q, k, v = groups[g, :2 * d], groups[g, 2 * d:3 * d], groups[g, 3 * d:]
                for h in range(2):  # each of the group's query heads becomes its own MHA group
                    rows.append(torch.cat([q[h * d:(h + 1) * d], k, v]))
            value = torch.cat(rows)
        new_state[key] = value
    mha.load_state_dict(new_state)
    tokens = torch.randint(0, 128, (2, 32))
    out_gqa, out_mha = gqa.double()(tokens), mha.double()(tokens)
    # float64 end to end. The QKV GEMMs have other widths, so a kernel may block their sums of `hidden` products
    # differently: a reordered sum of n terms moves by at most ~n ulps; n = hidden, per layer. Wrong heads: O(1).
    bound = cfg.hidden_size * cfg.num_layers * 2.0**-52 * out_gqa.abs().max()
    assert (out_gqa - out_mha).abs().max() <= bound


def _attention_saved_shapes(attention, hidden, rotary):
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        attention(hidden, rotary, None)
    return shapes


@pytest.mark.skipif(not transformer.SDPA_ENABLE_GQA, reason="this torch's SDPA has no enable_gqa (torch < 2.5)")
def test_gqa_keeps_key_and_value_at_their_own_head_count(monkeypatch):
    """GQA attends each key/value head for its group of query heads inside SDPA: autograd saves no K or V expanded to
    the query heads, and the expansion it replaces gives the same output and gradients (float64)."""
    model, cfg = _model(num_key_value_heads=2)
    attention = model.decoder.layers[0].self_attention.double().train()
    hidden = torch.randn(2, 32, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    b, s, d = 2, 32, cfg.kv_channels
    expanded = (b, cfg.num_attention_heads, s, d)
    saved = _attention_saved_shapes(attention, hidden, None)
    assert (b, cfg.num_key_value_heads, s, d) in saved
    # q and the attention output are the only (b, heads, s, d) tensors SDPA saves; K and V expanded would add two.
    assert saved.count(expanded) == 2, saved

    def output_and_grads():
        attention.zero_grad(set_to_none=True)
        hidden.grad = None
        out = attention(hidden, None, None)
        out.square().sum().backward()
        return [out.detach(), hidden.grad.clone(), attention.linear_qkv.weight.grad.clone()]

    grouped = output_and_grads()
    monkeypatch.setattr(transformer, "SDPA_ENABLE_GQA", False)
    repeated_saved = _attention_saved_shapes(attention, hidden, None)
    assert repeated_saved.count(expanded) == 4, repeated_saved
    repeated = output_and_grads()
    # Same products, summed in another order over at most s keys (forward) or `heads / groups` query heads
    # (backward's K and V gradients): each result moves by a few ulps of its largest term's magnitude.
    for a, r in zip(grouped, repeated):
        terms = max(s, cfg.num_attention_heads) * cfg.hidden_size
        assert (a - r).abs().max() <= terms * 2.0**-52 * r.abs().max()


# Not isa_sensitive: recompute runs the same kernels on the same inputs again, bitwise equal under any ISA.
@pytest.mark.parametrize("switches", [("--recompute-granularity", "full"), ("--recompute-activations",),
                                      ("--recompute-granularity", "full", "--recompute-method", "block")])
def test_recompute_gives_identical_gradients(switches):
    ref, _ = _model()
    rec, _ = _model(*switches)
    rec.load_state_dict(ref.state_dict())
    ref.train(), rec.train()
    tokens = torch.randint(0, 128, (2, 32))
    ref(tokens, labels=tokens).mean().backward()
    rec(tokens, labels=tokens).mean().backward()
    for (name, p1), (_, p2) in zip(ref.named_parameters(), rec.named_parameters()):
        assert torch.equal(p1.grad, p2.grad), name  # recompute repeats the same operations: bitwise


def test_reset_masks_and_positions():
    eod = 0
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3]])
    loss_mask, pos, mask = get_ltor_masks_and_position_ids(tokens, eod, True, True, True)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert loss_mask.tolist() == [[1, 1, 0, 1, 1, 1, 0, 1]]
    m = mask[0, 0]
    assert m[3, 2].item() is False and m[3, 3].item() is True  # new document cannot see the previous one
    assert m[2, 0].item() is True  # the EOD token belongs to its own document
    assert m[1, 2].item() is False  # causal


@pytest.mark.isa_sensitive
def test_reset_attention_mask_isolates_documents_in_the_model():
    model, _ = _model()
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3] * 4])
    _, pos, mask = get_ltor_masks_and_position_ids(tokens, 0, False, True, True)
    out = model(tokens, pos, mask)
    changed = tokens.clone()
    changed[0, 1] = 44  # inside the first document
    out2 = model(changed, pos, mask)
    assert torch.equal(out[0, 3:], out2[0, 3:])  # masked scores add exact zeros, as in test_causality
    assert (out[0, :3] - out2[0, :3]).abs().max() > 1e-3 * out.abs().max()
