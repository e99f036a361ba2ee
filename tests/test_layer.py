"""The torch layer against oracles: nn.MultiheadAttention, F.scaled_dot_product_attention,
the seed 000 tutorial's own numbers, and the sinusoidal formula written out here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnctl.model.config import build_config
from attnctl.nn.check import reference_mha
from attnctl.nn.layer import AttentionLayer, Recorder
from attnctl.nn.positions import causal_mask, sinusoidal_positions
from attnctl.nn.runner import run_text
from attnctl.stages.plan import layer_parameters

# Printed by seed 000's own code (MultiHeadAttention(8, 2) after nn.Embedding(3, 8) under
# torch.manual_seed(42)) for 猫吃鱼: attn_weights, shape (1, 2, 3, 3).
SEED_000_WEIGHTS = [
    [
        [0.2785862684249878, 0.32334038615226746, 0.39807331562042236],
        [0.313981294631958, 0.34083092212677, 0.345187783241272],
        [0.3200955390930176, 0.30858978629112244, 0.3713147044181824],
    ],
    [
        [0.34332242608070374, 0.3849591314792633, 0.2717185318470001],
        [0.313076913356781, 0.4226261377334595, 0.2642970085144043],
        [0.3383941352367401, 0.35438603162765503, 0.30721986293792725],
    ],
]


def make_layer(seed: int = 0, vocab: int = 50, **options) -> AttentionLayer:
    config = build_config(**options)
    torch.manual_seed(seed)
    return AttentionLayer(config, vocab).eval()


def layer_input(layer: AttentionLayer, ids: torch.Tensor) -> torch.Tensor:
    x = layer.embedding(ids)
    if layer.config.pos == "sinusoidal":
        x = x + sinusoidal_positions(ids.shape[1], layer.config.d_model)
    return x


CASES = [
    dict(d_model=64, heads=8, mask="none", bias=True),
    dict(d_model=64, heads=8, mask="causal", bias=True),
    dict(d_model=48, heads=3, mask="causal", bias=False),
    dict(d_model=32, heads=1, mask="none", bias=False),
    dict(d_model=512, heads=8, mask="causal", bias=True),
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(map(str, o.values())))
def test_math_path_equals_nn_multihead_attention(options):
    layer = make_layer(**options, norm="none")
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        ours = layer(ids)
        x = layer_input(layer, ids)
        mask = None
        if options["mask"] == "causal":
            mask = ~causal_mask(7)  # nn.MultiheadAttention: True = blocked
        out, weights = reference_mha(layer)(
            x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False
        )
    assert (ours.attention_output - out).abs().max() <= 1e-5
    assert (ours.weights - weights).abs().max() <= 1e-5
    assert ours.output is ours.attention_output  # norm "none": no residual


@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(map(str, o.values())))
def test_math_path_equals_scaled_dot_product_attention(options):
    layer = make_layer(**options, norm="none")
    ids = torch.randint(0, 50, (2, 7))
    heads, d_k = layer.config.heads, layer.config.d_k
    with torch.no_grad():
        ours = layer(ids)
        x = layer_input(layer, ids)

        def split(t):
            return t.view(2, 7, heads, d_k).transpose(1, 2)

        q, k, v = split(layer.W_q(x)), split(layer.W_k(x)), split(layer.W_v(x))
        allowed = causal_mask(7) if options["mask"] == "causal" else None  # True = may attend
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        expected = layer.W_o(attended.transpose(1, 2).reshape(2, 7, heads * d_k))
    assert (ours.attention_output - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_sdpa_impl_equals_math_impl(mask):
    ids = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        math_out = make_layer(d_model=64, heads=4, mask=mask)(ids)
        sdpa_out = make_layer(d_model=64, heads=4, mask=mask, impl="sdpa")(ids)
    assert sdpa_out.weights is None
    assert (math_out.output - sdpa_out.output).abs().max() <= 1e-5


def test_weights_rows_sum_to_one_and_causal_zeros_above_diagonal():
    layer = make_layer(d_model=64, heads=4, mask="causal")
    with torch.no_grad():
        weights = layer(torch.randint(0, 50, (2, 11))).weights
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 11), atol=1e-6)
    above = torch.triu(torch.ones(11, 11, dtype=torch.bool), diagonal=1)
    assert torch.all(weights[..., above] == 0)
    assert torch.all(weights[..., ~above] > 0)


def test_post_norm_is_layernorm_of_residual():
    layer = make_layer(d_model=32, heads=4)
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        result = layer(ids)
        x = layer_input(layer, ids)
        expected = F.layer_norm(
            x + result.attention_output, (32,), layer.norm.weight, layer.norm.bias
        )
    assert (result.output - expected).abs().max() <= 1e-5


def test_sinusoidal_positions_match_the_formula():
    table = sinusoidal_positions(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)
    assert sinusoidal_positions(3, 5).shape == (3, 5)  # odd widths work too


def test_seed_000_weights_match_the_tutorial():
    trace = run_text("猫吃鱼", build_config("cat-eats-fish", device="cpu"))
    assert [t.text for t in trace.tokens[0]] == ["猫", "吃", "鱼"]
    assert [t.id for t in trace.tokens[0]] == [0, 1, 2]
    got = torch.tensor(trace.attention_lists())
    assert got.shape == (1, 2, 3, 3)
    assert (got[0] - torch.tensor(SEED_000_WEIGHTS)).abs().max() <= 1e-6
    assert got[0, 0, 0].tolist() == pytest.approx([0.27858627, 0.32334039, 0.39807332], abs=1e-8)


def test_parameters_are_what_the_plan_lists():
    for options in (dict(), dict(bias=False, norm="none")):
        layer = make_layer(vocab=123, **options)
        expected = [(p.name, p.shape) for p in layer_parameters(layer.config, 123)]
        assert [(n, tuple(p.shape)) for n, p in layer.named_parameters()] == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_and_stays_close_to_float32(dtype):
    layer = make_layer(d_model=64, heads=4, mask="causal")
    ids = torch.randint(0, 50, (1, 8))
    with torch.no_grad():
        full = layer(ids).weights
        half = layer.to(dtype)(ids, Recorder()).weights
    assert half.dtype == dtype
    assert (half.float() - full).abs().max() < 0.05
